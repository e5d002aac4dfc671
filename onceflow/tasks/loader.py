"""Finding the project's Flow (or Celery app) from ``module:attribute``."""

from __future__ import annotations

import importlib
from typing import Any

from celery import Celery

from onceflow.errors import InvalidRequest
from onceflow.tasks.flow import Flow


def load_app(spec: str) -> tuple[Celery, Flow | None]:
    """Import ``module:attribute``; return its Celery app and the Flow, if it is one."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise InvalidRequest(f"app must look like 'module:attribute', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidRequest(f"cannot import {module_name!r}: {exc}") from None
    target: Any = getattr(module, attr or "flow", None)
    if target is None and not attr:
        target = getattr(module, "app", None)
    if isinstance(target, Flow):
        return target.app, target
    if isinstance(target, Celery):
        return target, None
    raise InvalidRequest(f"{spec!r} is neither an onceflow Flow nor a Celery app")
