"""Finding the project's Flow (or Celery app) from ``module:attribute``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from celery import Celery

from onceflow.errors import InvalidRequest
from onceflow.tasks.flow import Flow


def cwd_on_path() -> str:
    """Put the current directory on ``sys.path`` (first), as ``celery -A`` and ``uvicorn`` do.

    So ``--app myproject.stages:flow`` finds ``./myproject`` without ``PYTHONPATH``.
    Returns the directory.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def load_app(spec: str) -> tuple[Celery, Flow | None]:
    """Import ``module:attribute``; return its Celery app and the Flow, if it is one.

    The module is looked up from the current directory first (see :func:`cwd_on_path`);
    a module that cannot be imported raises :class:`InvalidRequest` naming the module,
    the directory and the fix.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise InvalidRequest(f"app must look like 'module:attribute', got {spec!r}")
    cwd = cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        raise InvalidRequest(f"the app module {module_name!r} does not compile: {exc}") from None
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is None or not _is_parent_or_self(missing, module_name):
            # The module was found; something it imports was not.
            raise InvalidRequest(
                f"importing the app module {module_name!r} failed: {exc}"
            ) from None
        raise InvalidRequest(
            f"cannot import the app module {module_name!r} ({exc}) from the current directory "
            f"{cwd}: run from the directory that holds it, or add that directory to PYTHONPATH, "
            "and pass --app module:attribute (or set ONCEFLOW_APP)"
        ) from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise InvalidRequest(
            f"importing the app module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    target: Any = getattr(module, attr or "flow", None)
    if target is None and not attr:
        target = getattr(module, "app", None)
    if isinstance(target, Flow):
        return target.app, target
    if isinstance(target, Celery):
        return target, None
    raise InvalidRequest(f"{spec!r} is neither an onceflow Flow nor a Celery app")


def _is_parent_or_self(name: str, module_name: str) -> bool:
    return module_name == name or module_name.startswith(name + ".")
