"""The Celery side: stages as tasks (arrives with the Celery runtime issue)."""
