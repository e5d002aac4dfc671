"""Request states, mirrored by the table's CHECK constraint.

::

    queued ──claim──► running ──complete──► succeeded
      ▲  │               ├─fail (retryable, attempts left)──► queued (after backoff)
      │  │               ├─fail (final / attempts spent)────► dead
      │  │               ├─lease lapsed (crash)─────────────► queued, or dead past the budget
      │  └─cancel──► cancelled ◄── fail / lapse after cancel requested
      └──────── requeue (explicit re-run of succeeded / dead / cancelled)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """The status of a request row."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True for the terminal states."""
        return self in (Status.SUCCEEDED, Status.DEAD, Status.CANCELLED)


_BY_VALUE = {s.value: s for s in Status}


def status_of(value: Any) -> Status:
    """A stored row's status: a dict lookup on the hot paths (``Status(value)`` is an enum
    call); an unknown value raises ``ValueError``, as ``Status(value)`` does."""
    found = _BY_VALUE.get(value)
    return found if found is not None else Status(value)


def parse_status(value: str) -> Status:
    """Parse a status name, with a clear error for an unknown one."""
    from onceflow.errors import InvalidRequest

    try:
        return Status(value)
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise InvalidRequest(f"unknown status {value!r}; expected one of {names}") from None
