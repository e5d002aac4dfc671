"""bench/bench_stages.py's apps, with onceflow's tracing set up from the ``OTEL_*`` variables
when the worker imports them (bench/tracing_bench.py's workers run ``celery -A
bench.tracing_stages:app``, which does not go through ``onceflow worker``'s set-up).

Without ``OTEL_*`` (or with an onceflow from before tracing, which has no
``onceflow.tracing``) nothing is set up: the worker is bench_stages' own.
"""

from __future__ import annotations

import importlib
from typing import Any

from bench.bench_stages import app, bare, flow

_tracing: Any
try:
    _tracing = importlib.import_module("onceflow.tracing")
except ImportError:  # an onceflow from before tracing (the baseline side)
    _tracing = None
if _tracing is not None:
    # Before Celery forks its pool: the SDK's batch processor restarts its thread in each child.
    _tracing.configure("onceflow-bench-worker")

__all__ = ["app", "bare", "flow"]
