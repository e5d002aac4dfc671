"""Runs its process with a wall clock ``ONCEFLOW_TEST_CLOCK_SKEW_SECONDS`` ahead (tests only).

Put this directory first on ``PYTHONPATH`` of one process: Python imports
``sitecustomize`` at start-up, before Celery, so ``time.time()``, ``time.time_ns()``
and ``datetime.now()`` / ``utcnow()`` / ``today()`` all read the skewed clock there —
what Celery consults for a message's ``expires`` and ``eta``. Monotonic clocks are
left alone (a skewed wall clock does not make time pass faster).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time as _time

_SKEW = float(os.environ.get("ONCEFLOW_TEST_CLOCK_SKEW_SECONDS", "0") or 0)

if _SKEW:
    _real_time = _time.time
    _real_time_ns = _time.time_ns
    _DELTA = _dt.timedelta(seconds=_SKEW)

    def _time_skewed() -> float:
        return _real_time() + _SKEW

    def _time_ns_skewed() -> int:
        return _real_time_ns() + int(_SKEW * 1e9)

    class _SkewedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> _dt.datetime:  # type: ignore[override]
            return _dt.datetime.fromtimestamp(_time_skewed(), tz)

        @classmethod
        def utcnow(cls) -> _dt.datetime:  # type: ignore[override]
            return _dt.datetime.fromtimestamp(_time_skewed(), _dt.UTC).replace(tzinfo=None)

        @classmethod
        def today(cls) -> _dt.datetime:  # type: ignore[override]
            return cls.now()

    _time.time = _time_skewed
    _time.time_ns = _time_ns_skewed
    _dt.datetime = _SkewedDatetime  # type: ignore[misc]
    print(f"onceflow-test: wall clock skewed by {_SKEW:+.0f}s", file=sys.stderr, flush=True)
