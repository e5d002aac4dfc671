"""Shift this process's wall clock by ``$CHAOS_CLOCK_OFFSET`` seconds (the chaos suite's skew).

Put this directory first on ``PYTHONPATH`` of one process: ``time.time``/``time.time_ns`` and
``datetime.datetime.now``/``utcnow``/``today`` (as imported by Celery, kombu and psycopg after
start-up) run that many seconds ahead. The monotonic clock is left alone, as a skewed NTP
clock would leave it. Without the variable nothing changes.
"""

from __future__ import annotations

import datetime as _dt
import os
import time as _time

_OFFSET = float(os.environ.get("CHAOS_CLOCK_OFFSET", "0") or 0)

if _OFFSET:
    _real_time = _time.time
    _real_time_ns = _time.time_ns
    _delta = _dt.timedelta(seconds=_OFFSET)

    def _time_shifted() -> float:
        return _real_time() + _OFFSET

    def _time_ns_shifted() -> int:
        return _real_time_ns() + int(_OFFSET * 1e9)

    _time.time = _time_shifted
    _time.time_ns = _time_ns_shifted

    class _ShiftedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> _ShiftedDatetime:
            return super().now(tz) + _delta

        @classmethod
        def utcnow(cls) -> _ShiftedDatetime:
            return super().utcnow() + _delta

        @classmethod
        def today(cls) -> _ShiftedDatetime:
            return super().today() + _delta

    _dt.datetime = _ShiftedDatetime  # type: ignore[misc]
