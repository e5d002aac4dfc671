"""The one exception tree of onceflow.

Every error onceflow raises derives from :class:`OnceflowError`; driver errors
(psycopg, SQLAlchemy, redis-py) are translated at the boundary and never reach
stage code. Control-flow signals (retry later) are kept apart from errors.

::

    OnceflowError
    ├── InvalidRequest            bad input: nothing was written
    │   ├── PayloadTooLarge       input or result over the payload limit
    │   ├── PayloadTooDeep        a payload nested deeper than the payload depth limit
    │   ├── InputMismatch         same request_id, different input (strict mode)
    │   ├── UnknownStage          no stage of that name is registered
    │   ├── UnknownWorkspace      a budget for a workspace the database has no trace of
    │   ├── OpIdConflict          same op id, different payload
    │   ├── ReplayTooOld          a replay older than the op log's retention
    │   └── PartitionLayoutMismatch  migrate asked for a partitioning the tables do not have
    ├── NotFound                  no such request
    ├── WaitTimeout               a request did not end within the wait's timeout
    ├── InvalidTransition         e.g. requeue of a running request
    ├── LeaseLost                 the claim token no longer holds a live lease
    ├── Cancelled                 cancel was requested for the running request
    ├── MaxRuntimeExceeded        a run went past its stage's max_runtime (retryable)
    ├── PermanentError            raised by a stage: fail now, no retry
    ├── BudgetExceeded            a workspace's spend budget refuses a provider call
    ├── BudgetBusy                a budget's room is held by calls in flight: ask again (retryable)
    ├── OpRejected                an op cannot apply to the current state (recorded)
    ├── DatabaseUnavailable       Postgres did not answer (retryable)
    │   ├── ConnectionLost        an established connection died (restart, killed backend)
    │   └── NotMigrated           onceflow's tables are missing: run `onceflow migrate`
    ├── InvalidDatabaseUrl        the database URL is malformed or not PostgreSQL/psycopg 3
    ├── InvalidShardMap           the shard map (ONCEFLOW_DATABASE_URLS / _SHARD_MAP) is unusable
    ├── InvalidRedisUrl           a Redis URL is malformed, or a cluster where one server is needed
    ├── StoreError                any other database failure, translated
    ├── LockLost                  a compute lock expired or was taken while held
    ├── LockUnavailable           the compute lock's backend did not answer (retryable)
    ├── PermitTimeout             a provider permit was not granted within its timeout (retryable)
    ├── PermitCancelled           the wait for a provider permit was cancelled
    ├── LimitsUnavailable         the provider limits' Redis did not answer (retryable)
    ├── ProviderError             a provider call failed: 429, 5xx, a timeout (the cascade moves on)
    │   └── CascadeExhausted      every provider of a cascade failed or had no room in time
    └── AccessDenied              the HTTP API refused the key (401) or its scope (403)

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


# Alike by shape to every error with fields on purpose: own __init__, and __reduce__ for Celery.
class PayloadTooLarge(InvalidRequest):
    """A JSON payload is larger than the configured limit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"{what} is {size} bytes, over the payload limit of {limit} bytes")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.size, self.limit))


class PayloadTooDeep(InvalidRequest):
    """A JSON payload nests arrays/objects deeper than the configured depth limit."""

    def __init__(self, what: str, limit: int | None) -> None:
        self.what = what
        self.limit = limit
        if limit is None:
            message = f"{what} is nested too deeply to encode"
        else:
            message = (
                f"{what} is nested more than {limit} levels deep, over the payload depth "
                f"limit (ONCEFLOW_MAX_PAYLOAD_DEPTH={limit})"
            )
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.limit))


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


class WaitTimeout(OnceflowError, TimeoutError):
    """The request did not reach a terminal status (succeeded, dead, cancelled) within the
    wait's timeout. ``request`` is the request as last read (None if it was not read)."""

    def __init__(self, request_id: str, timeout: float, request: Any = None) -> None:
        self.request_id = request_id
        self.timeout = timeout
        self.request = request
        super().__init__(f"request {request_id} did not finish within {timeout:g} s")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.timeout, self.request))


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


class MaxRuntimeExceeded(OnceflowError):
    """A run went past its stage's ``max_runtime`` (claim time + ``max_runtime``, database
    clock) without an outcome.

    Recorded as a failed attempt, retried after the backoff whatever the stage's
    ``retry_on`` says, dead at ``max_attempts`` (:func:`onceflow.lifecycle.decide`). The
    Celery stage task raises it in place of Celery's ``SoftTimeLimitExceeded``; for every
    runner, a run whose lease ended at its run deadline is recorded so by the sweeper.
    """

    #: An overrun is retried, never failed for good on its own.
    retryable = True

    def __init__(self, detail: str = "ran past the stage's max_runtime") -> None:
        self.detail = detail
        super().__init__(detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.detail,))


class PermanentError(OnceflowError):
    """Raise from a stage to fail the request at once, without retries (e.g. bad data)."""


class BudgetExceeded(OnceflowError):
    """A workspace's budget for the period has no room for a provider call's estimate.

    Raised when a permit is asked for (before any rate limit is taken): nothing was called
    or reserved. ``on_exceeded`` is the budget's: ``fail`` — the stage fails at once, without
    retries; ``wait`` — the stage is retried when the next period starts, ``retry_at`` (UTC,
    database clock, ISO 8601), ``retry_in`` seconds after the refusal (capped by the backoff
    maximum: a longer wait checks the budget again, refused again until the period turns).
    """

    # A constructor keeping its arguments (alike by shape with others): fields for __reduce__.
    def __init__(
        self,
        workspace_id: str,
        period: str,
        detail: str,
        on_exceeded: str = "fail",
        retry_at: str | None = None,
        retry_in: float | None = None,
    ) -> None:
        self.workspace_id = workspace_id
        self.period = period
        self.detail = detail
        self.on_exceeded = on_exceeded
        self.retry_at = retry_at
        self.retry_in = retry_in
        message = f"workspace {workspace_id}'s {period} budget is exceeded: {detail}"
        if on_exceeded == "wait" and retry_at is not None:
            message += f"; retried when the next period starts ({retry_at})"
        super().__init__(message)

    @property
    def waits(self) -> bool:
        """Whether the stage waits for the next period (else it fails at once)."""
        return self.on_exceeded == "wait" and self.retry_in is not None

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (
                self.workspace_id,
                self.period,
                self.detail,
                self.on_exceeded,
                self.retry_at,
                self.retry_in,
            ),
        )


class BudgetBusy(OnceflowError):
    """A workspace's budget has room for a call's estimate once the calls in flight settle,
    not now: the period's spend plus the estimate fits, the reservations of the calls in
    flight make it not fit. Temporary (those calls usually settle below their estimates, or
    their reservations expire): a permit that meets it waits and asks again, so it is seen
    only by code that calls the spend hooks' ``admit`` itself. ``retry_in``: seconds worth
    waiting before asking again. Retryable.
    """

    #: A stage that raises this should be retried, not failed for good.
    retryable = True

    def __init__(self, workspace_id: str, period: str, detail: str, retry_in: float) -> None:
        self.workspace_id = workspace_id
        self.period = period
        self.detail = detail
        self.retry_in = retry_in
        super().__init__(
            f"workspace {workspace_id}'s {period} budget is held by calls in flight: {detail}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.workspace_id, self.period, self.detail, self.retry_in))


class UnknownStage(InvalidRequest):
    """No stage of this name is registered with the flow."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        super().__init__(f"no stage named {stage!r} is registered")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stage,))


class UnknownWorkspace(InvalidRequest):
    """onceflow keeps no list of workspaces: a workspace exists in a database once it has a
    request, a sub-doc, a ledger row or a budget there. A budget for any other is refused
    (a typo would otherwise set a limit nobody is held to); nothing was written."""

    def __init__(self, workspace_id: str) -> None:
        self.workspace_id = workspace_id
        super().__init__(
            f"no workspace {workspace_id!r}: it has no request, sub-doc, spend or budget yet "
            "(pass allow_new=True, or --new on the command line, to set a budget before "
            "its first request)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.workspace_id,))


class OpRejected(OnceflowError):
    """An op is well-formed but cannot apply to the sub-doc's state (recorded; retries get it)."""

    def __init__(self, op_type: str, reason: str) -> None:
        self.op_type = op_type
        self.reason = reason
        super().__init__(f"{op_type} rejected: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.op_type, self.reason))


class OpIdConflict(InvalidRequest):
    """The same op id was used with a different payload (never a silent success)."""

    def __init__(self, op_id: str, sub_doc: str) -> None:
        self.op_id = op_id
        self.sub_doc = sub_doc
        super().__init__(f"op id {op_id} was already used in {sub_doc} with a different payload")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.op_id, self.sub_doc))


class ReplayTooOld(InvalidRequest):
    """A replayed op is older than the op log keeps: it is refused, never re-applied."""

    def __init__(self, op_id: str, base_clock: int | None, horizon: int) -> None:
        self.op_id = op_id
        self.base_clock = base_clock
        self.horizon = horizon
        super().__init__(
            f"op {op_id} is based on clock {base_clock}, older than the op log's horizon "
            f"{horizon}: it may have been applied already; re-read the sub-doc and mint a new op"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.op_id, self.base_clock, self.horizon))


class PartitionLayoutMismatch(InvalidRequest):
    """``onceflow migrate`` was asked for a table layout the existing tables do not have.

    ``ONCEFLOW_PARTITIONS`` (or ``migrate(partitions=…)``) shapes new tables only: tables
    that exist plain, or hash-partitioned another number of ways, are never converted by a
    migration (docs/sharding.md 5.2). Raised before anything is written. ``found`` maps each
    existing workspace table to its partition count (0: not partitioned).
    """

    def __init__(self, requested: int | None, found: dict[str, int]) -> None:
        self.requested = requested
        self.found = dict(found)

        def shape(n: int) -> str:
            return f"in {n} hash partitions by workspace" if n else "not partitioned"

        groups: dict[int, list[str]] = {}
        for table, n in found.items():
            groups.setdefault(n, []).append(table)
        have = "; ".join(f"{', '.join(tables)} {shape(n)}" for n, tables in groups.items())
        if requested is None:
            ask = "the workspace tables must share one layout"
        else:
            ask = f"partitions={requested} (ONCEFLOW_PARTITIONS) asks for tables {shape(requested)}"
        super().__init__(
            f"{ask}, but the database has {have}. Migrations shape new tables only and never "
            "convert existing ones: unset ONCEFLOW_PARTITIONS (later migrations follow the "
            "database's own layout), or convert the tables as docs/sharding.md 5.2 describes"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.requested, self.found))


class DatabaseUnavailable(OnceflowError):
    """Postgres could not be reached or dropped the connection.

    Retryable: raised in a stage it fails the run as retryable (even with ``retry_on``
    set), and ``compute_once`` retries a ``store()`` that raised it.
    """

    #: A stage that raises this should be retried, not failed for good.
    retryable = True


class ConnectionLost(DatabaseUnavailable):
    """A connection that had been established died under a call (server restart, killed backend).

    The whole connection pool was invalidated when it was raised, so the next
    call gets a fresh connection: calls that are safe to repeat are retried once
    (:func:`onceflow.db.retry_disconnect`). A connection that cannot be opened
    raises the plain :class:`DatabaseUnavailable` instead.
    """


class NotMigrated(DatabaseUnavailable):
    """The database answers but lacks onceflow's tables: ``onceflow migrate`` was not run.

    Retryable like its base: a deploy may start workers before it migrates. The
    message names the database (never its password) and the fix.
    """

    def __init__(self, where: str, detail: str = "") -> None:
        self.where = where
        self.detail = detail
        message = f"the database at {where} is not migrated: run `onceflow migrate`"
        super().__init__(f"{message} ({detail})" if detail else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.detail))


class InvalidDatabaseUrl(OnceflowError, ValueError):
    """The database URL cannot be used: malformed, not PostgreSQL, or a bad port.

    A configuration error, not retryable. The message shows the URL without its
    password and the expected form.
    """

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        self.problem = problem
        super().__init__(
            f"cannot use the database URL {url!r}: {problem}; expected the form "
            "postgresql+psycopg://user@host:5432/db (set ONCEFLOW_DATABASE_URL)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.problem))


class InvalidShardMap(OnceflowError, ValueError):
    """The shard map cannot be used: no shard, a bad or repeated URL, buckets not covered
    exactly once, an override to no shard, or a map file that does not parse.

    A configuration error, not retryable. ``source`` says where the map came from
    (``ONCEFLOW_SHARD_MAP=<path>``, ``ONCEFLOW_DATABASE_URLS``), empty when it was built
    in code. The message never shows a password.
    """

    def __init__(self, problem: str, source: str = "") -> None:
        self.problem = problem
        self.source = source
        where = f" ({source})" if source else ""
        super().__init__(f"cannot use the shard map{where}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problem, self.source))


class ShardMismatch(InvalidShardMap):
    """A database is not the shard this process's map names: it is registered (by
    ``onceflow migrate``, table ``onceflow_shard``) as another index, under another map, or
    not at all. A configuration error (URLs in another order, a map changed on one host):
    nothing is routed to it. The message shows the URL without its password."""


class InvalidRedisUrl(OnceflowError, ValueError):
    """A Redis URL cannot be used: malformed, or a Redis Cluster where one server is needed.

    A configuration error, not retryable: the Celery broker (kombu has no Redis Cluster
    transport) must be one Redis server or RabbitMQ. The message shows the URL without
    its password.
    """

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        self.problem = problem
        super().__init__(f"cannot use the Redis URL {url!r}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.problem))


class StoreError(OnceflowError):
    """A database error that is not one of the above, translated from the driver."""


class LockLost(OnceflowError):
    """A compute lock expired or was taken by another caller while its holder still worked.

    The compute lock is an efficiency lock: losing it means a call may be paid
    for twice, never that a result is corrupted (layer 3 keeps writes idempotent).
    """

    def __init__(self, key: str, detail: str = "") -> None:
        self.key = key
        self.detail = detail
        message = f"compute lock {key} lost"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.detail))


class LockUnavailable(OnceflowError):
    """The compute lock's backend (Redis, or Postgres for the SQL backend) did not answer.

    Raised in a stage it fails the run as retryable (the default ``retry_on``);
    the ``lock_unavailable = "compute"`` setting computes without the lock instead.
    """

    #: A stage that raises this should be retried, not failed for good.
    retryable = True


class PermitTimeout(OnceflowError, TimeoutError):
    """A provider permit was not granted within the wait's timeout: the provider's requests,
    tokens or concurrency stayed taken, or it was cooling after a 429. Retryable."""

    #: A stage that raises this should be retried, not failed for good.
    retryable = True

    def __init__(self, provider: str, timeout: float, reason: str = "") -> None:
        self.provider = provider
        self.timeout = timeout
        self.reason = reason
        why = f" (last refused by: {reason})" if reason else ""
        super().__init__(f"no permit from provider {provider} within {timeout:g} s{why}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.provider, self.timeout, self.reason))


# Alike by shape to Cancelled on purpose: its own error and field, and __reduce__ for Celery.
class PermitCancelled(OnceflowError):
    """The wait for a provider permit was cancelled (its cancel event was set)."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        super().__init__(f"the wait for a permit from provider {provider} was cancelled")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.provider,))


class LimitsUnavailable(OnceflowError):
    """The Redis that holds the provider limits did not answer. Retryable."""

    #: A stage that raises this should be retried, not failed for good.
    retryable = True


class ProviderError(OnceflowError):
    """A provider call failed in a way another provider may not: a 429 (``status=429``,
    with the provider's ``Retry-After`` in seconds when it sent one), a 5xx, or a timeout
    (``status=None``). Raised by the caller's function in a cascade, which moves on."""

    #: A stage that raises this should be retried, not failed for good.
    retryable = True

    def __init__(
        self, provider: str, status: int | None, detail: str = "", retry_after: float | None = None
    ) -> None:
        self.provider = provider
        self.status = status
        self.detail = detail
        self.retry_after = retry_after
        what = f"answered {status}" if status is not None else "timed out"
        message = f"provider {provider} {what}"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.provider, self.status, self.detail, self.retry_after))


class CascadeExhausted(ProviderError):
    """No provider of a cascade served the call: each failed, or none had room in time.
    ``errors`` holds each provider's error, in the cascade's order."""

    def __init__(self, providers: list[str], errors: list[str]) -> None:
        self.providers = list(providers)
        self.errors = list(errors)
        self.provider = ", ".join(providers)
        self.status = None
        self.detail = "; ".join(errors) if errors else "none had room in time"
        self.retry_after = None
        OnceflowError.__init__(
            self, f"no provider of the cascade [{self.provider}] served the call: {self.detail}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.providers, self.errors))


class RetryLater(Exception):
    """Raised by a stage to be run again after ``delay`` seconds (not counted as a crash)."""

    def __init__(self, delay: float = 0.0, reason: str = "") -> None:
        self.delay = delay
        self.reason = reason
        super().__init__(reason or f"retry in {delay}s")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.delay, self.reason))


class AccessDenied(OnceflowError):
    """The HTTP API refused the request's key: missing or unknown (401), or out of scope (403)."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"access denied ({status}){': ' + detail if detail else ''}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.detail))


class OutOfScope(AccessDenied, PermanentError):
    """A claim reached past what its stage declares: a sub-doc outside its ``sub_docs``, a
    hand-off to a stage not in its ``hands_off_to``. Nothing was read or written (403 over
    HTTP; in a stage body, the request fails at once, without retries)."""

    def __init__(self, detail: str) -> None:
        AccessDenied.__init__(self, 403, detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.detail,))


def validation_summary(exc: Any, *, limit: int = 5) -> str:
    """A pydantic ``ValidationError`` on one line: ``value: Input should be …; …``."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:limit]:
        where = ".".join(str(p) for p in error.get("loc", ()))
        msg = " ".join(str(error.get("msg", "")).split())
        parts.append(f"{where}: {msg}" if where else msg)
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts)
