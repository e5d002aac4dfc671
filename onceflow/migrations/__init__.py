"""Alembic migrations shipped inside the package; applied by ``onceflow migrate``."""
