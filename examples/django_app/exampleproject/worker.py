"""What ``onceflow worker`` loads for this project: Django first, then the stages.

    onceflow worker --app exampleproject.worker:flow --worker-class orders

The same move as a Django project's ``celery.py``: the settings module is named
and Django is set up before any model is imported.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproject.settings")
django.setup()

from orders.stages import flow  # noqa: E402 - needs the app registry populated above

app = flow.app

__all__ = ["app", "flow"]
