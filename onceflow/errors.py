"""The one exception tree of onceflow.

Every error onceflow raises derives from :class:`OnceflowError`; driver errors
(psycopg, SQLAlchemy, redis-py) are translated at the boundary and never reach
stage code. Control-flow signals (retry later) are kept apart from errors.

::

    OnceflowError
    ├── InvalidRequest            bad input: nothing was written
    │   ├── PayloadTooLarge       input or result over the payload limit
    │   ├── InputMismatch         same request_id, different input (strict mode)
    │   └── UnknownStage          no stage of that name is registered
    ├── NotFound                  no such request
    ├── InvalidTransition         e.g. requeue of a running request
    ├── LeaseLost                 the claim token no longer holds a live lease
    ├── Cancelled                 cancel was requested for the running request
    ├── PermanentError            raised by a stage: fail now, no retry
    ├── DatabaseUnavailable       Postgres did not answer
    └── StoreError                any other database failure, translated

    RetryLater (not an error)     a stage asks to run again after a delay

Exceptions with a custom ``__init__`` define ``__reduce__`` because Celery
serializes exceptions across processes.
"""

from __future__ import annotations

from typing import Any


class OnceflowError(Exception):
    """Root of every error onceflow raises."""


class InvalidRequest(OnceflowError, ValueError):
    """The caller's input was rejected; nothing was written."""


class PayloadTooLarge(InvalidRequest):
    """A JSON payload is larger than the configured limit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"{what} is {size} bytes, over the payload limit of {limit} bytes")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.size, self.limit))


class InputMismatch(InvalidRequest):
    """A request with this id exists with a different input (never silently merged)."""

    def __init__(self, request_id: str, existing_hash: str, given_hash: str) -> None:
        self.request_id = request_id
        self.existing_hash = existing_hash
        self.given_hash = given_hash
        super().__init__(
            f"request {request_id} already exists with a different input "
            f"(stored input_hash {existing_hash[:12]}…, given {given_hash[:12]}…)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.existing_hash, self.given_hash))


class NotFound(OnceflowError, LookupError):
    """No request with this id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"no request {request_id}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id,))


class InvalidTransition(OnceflowError):
    """The request's current status does not allow this operation."""

    def __init__(self, request_id: str, status: str, operation: str) -> None:
        self.request_id = request_id
        self.status = status
        self.operation = operation
        super().__init__(f"cannot {operation} request {request_id}: it is {status}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.status, self.operation))


class LeaseLost(OnceflowError):
    """The claim token no longer holds a live lease; the fenced write was rejected."""

    def __init__(self, request_id: str, detail: str = "") -> None:
        self.request_id = request_id
        self.detail = detail
        message = f"lease lost on request {request_id}"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.detail))


class Cancelled(OnceflowError):
    """Cancel was requested for the request this stage runs; its next fenced step stops."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id} was cancelled")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id,))


class PermanentError(OnceflowError):
    """Raise from a stage to fail the request at once, without retries (e.g. bad data)."""


class UnknownStage(InvalidRequest):
    """No stage of this name is registered with the flow."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        super().__init__(f"no stage named {stage!r} is registered")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage,))


class DatabaseUnavailable(OnceflowError):
    """Postgres could not be reached or dropped the connection."""


class StoreError(OnceflowError):
    """A database error that is not one of the above, translated from the driver."""


class RetryLater(Exception):
    """Raised by a stage to be run again after ``delay`` seconds (not counted as a crash)."""

    def __init__(self, delay: float = 0.0, reason: str = "") -> None:
        self.delay = delay
        self.reason = reason
        super().__init__(reason or f"retry in {delay}s")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.delay, self.reason))
