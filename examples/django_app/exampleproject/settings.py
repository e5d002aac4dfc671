"""Settings of the example project; everything that differs per machine comes from the env.

The database is onceflow's (``ONCEFLOW_DATABASE_URL``): Django's writes and the
stage requests share one Postgres database, so they can share one transaction.
"""

import os

from onceflow.integrations.django import database_settings

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure-example-key-for-local-use-only")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")

INSTALLED_APPS = [
    "onceflow.integrations.django",  # optional: onceflow's tables in `migrate`, ONCEFLOW, a check
    "orders",
]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "exampleproject.urls"

DATABASES = {"default": database_settings()}  # reads ONCEFLOW_DATABASE_URL
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
