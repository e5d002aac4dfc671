"""Settings from the environment (prefix ``ONCEFLOW_``); nothing connects at import.

A framework's own configuration may add values beneath the environment
(:func:`use_defaults`; Django's ``ONCEFLOW = {...}``): a variable that is set wins over
them, so one image configured in code still takes its deployment's environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)


class WorkerKeyScopes(BaseModel):
    """A worker key's scopes in ``ONCEFLOW_WORKER_KEYS``: the worker classes it may claim
    and the workspaces it may claim in (ids, ``"prefix*"`` patterns, or ``"*"``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_classes: list[str]
    workspaces: list[str]


# Fields alike by shape on purpose: each setting's own default, bounds and documented text.
class Settings(BaseSettings):
    """onceflow's configuration; every field can be set as ``ONCEFLOW_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="ONCEFLOW_", extra="ignore")

    database_url: str = Field(
        default="postgresql+psycopg://127.0.0.1:5432/onceflow",
        description="SQLAlchemy URL of the Postgres database (psycopg 3 driver).",
    )
    database_urls: str | None = Field(
        default=None,
        description="Postgres shards: comma-separated SQLAlchemy URLs, shard k the k-th; the "
        "1024 workspace buckets are split into equal ranges over them. Unset: one shard, "
        "database_url. Not with shard_map.",
    )
    shard_map: str | None = Field(
        default=None,
        description="Path of a JSON shard map (shard URLs, bucket ranges, per-workspace "
        "overrides; the format is in onceflow/shards.py). Not with database_urls.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL: compute locks, broadcasts and (unless broker_url) the Celery "
        "broker. A Redis Cluster: redis+cluster://[user:password@]host:port[,host:port…] "
        "(rediss+cluster:// with TLS).",
    )
    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="Default lease a claim holds without a heartbeat.",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=1000, description="Default number of runs before a request is dead."
    )
    max_crash_attempts: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Lapsed leases (crashed or paused workers) before a request is quarantined.",
    )
    backoff_base_seconds: float = Field(
        default=2.0, ge=0, description="First retry delay; doubles per attempt."
    )
    backoff_max_seconds: float = Field(default=600.0, ge=0, description="Cap on a retry delay.")
    payload_limit_bytes: int = Field(
        default=256 * 1024, ge=1024, description="Largest input or result, as canonical JSON."
    )
    max_payload_depth: int = Field(
        default=64,
        ge=1,
        le=128,
        description="Deepest nesting of arrays/objects in an input, result, error, op or "
        "sub-doc state; deeper is refused (422 invalid_request), and an HTTP body nested "
        "deeper than this plus 4 is refused before it is parsed.",
    )
    lazy_claim_commits: bool = Field(
        default=True,
        description="Claims and heartbeats commit without waiting for the WAL flush "
        "(synchronous_commit off for their own transaction only); completions, failures, "
        "enqueues and op writes stay durable. A claim lost in a Postgres crash is claimed "
        "again and the first run is fenced off (docs/reliability.md). Off: every commit waits.",
    )
    pool_size: int = Field(default=5, ge=1, description="SQLAlchemy pool size per process.")
    partitions: int | None = Field(
        default=None,
        ge=2,
        le=256,
        description="Read by `onceflow migrate` on a new database only: create the workspace "
        "tables (requests, compute locks, sub-docs, ops) PARTITION BY HASH (workspace_id) "
        "in this many partitions; unset: plain tables. Later runs follow the database's "
        "layout; asking for another one on existing tables is refused (no conversion: "
        "docs/sharding.md 5.2).",
    )
    broker_url: str | None = Field(
        default=None,
        description="Celery broker URL (redis://, or amqp:// for RabbitMQ); the Redis URL when "
        "unset. Required when redis_url is a Redis Cluster (kombu has no cluster transport): "
        "one Redis server or RabbitMQ.",
    )
    sweep_interval_seconds: float = Field(
        default=5.0, gt=0, description="How often beat runs the sweeper."
    )
    sweep_watchdog: bool = Field(
        default=True,
        description="Workers sweep when no sweep began for 1.5 sweep intervals (beat down).",
    )
    notify: bool = Field(
        default=True,
        description="Statements that make work claimable send a NOTIFY on channel "
        "onceflow_work (payload: the worker class), which Queue.wait_for_work listens for. "
        "Turn off behind PgBouncer in transaction mode (no LISTEN there): waiters then wake "
        "on their timeout or the next known due time only.",
    )
    max_runtime_seconds: float = Field(
        default=1500.0,
        gt=0,
        le=86_400,
        description="Default bound on one run of a stage: heartbeats stop extending its lease "
        "past it (the sweeper then rescues the request) and Celery's soft/hard time limits "
        "interrupt the body. The hard limit must stay below the broker's visibility timeout "
        "(Redis) or RabbitMQ's consumer_timeout (AMQP).",
    )
    legacy_queues: bool = Field(
        default=False,
        description="Workers also consume each worker class's queue under its old, unprefixed "
        "name (before queues became onceflow.wc.<class>): set it on the workers during an "
        "upgrade, until those queues are empty (docs/security.md, 'Upgrading').",
    )
    broker_visibility_timeout_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Redis/SQS broker visibility timeout: an unacknowledged wake-up is "
        "redelivered after it. Every stage's hard time limit must stay below it. Not used "
        "with RabbitMQ (see broker_consumer_timeout_seconds).",
    )
    broker_consumer_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="RabbitMQ's consumer_timeout as your server has it (a server setting, "
        "30 min by default): a delivery left unacknowledged this long closes the worker's "
        "channel. With an AMQP broker every stage's hard time limit must stay below it.",
    )
    redispatch_after_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A queued, due request unclaimed this long after its wake-up gets another.",
    )
    retention_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Delete finished rows this long after they finished (the dedup window); "
        "unset keeps them forever.",
    )
    payload_retention_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Drop input and result of succeeded rows this long after they finished, "
        "keeping the row (and its key) as a tombstone; unset keeps payloads.",
    )
    op_retention_seconds: float | None = Field(
        default=7 * 86_400,
        gt=0,
        description="Keep op-log rows this long (longer than the SDK's longest offline replay); "
        "older replays are refused with ReplayTooOld. Unset keeps them forever.",
    )
    app: str = Field(
        default="onceflow.tasks.default:flow",
        description="`module:attribute` of the Flow (or Celery app) workers and beat load.",
    )
    # Layer 2: the compute lock (onceflow.locks).
    lock_ttl_seconds: float = Field(
        default=60.0, gt=0, le=86_400, description="Default TTL of a compute lock."
    )
    lock_backend: Literal["redis", "sql"] = Field(
        default="redis",
        description="Where compute locks live: Redis (SET NX PX), or the compute_locks table.",
    )
    lock_unavailable: Literal["fail", "compute"] = Field(
        default="fail",
        description="When the lock backend is down: raise LockUnavailable (retryable), or "
        "compute without the lock (paying for duplicate calls).",
    )
    lock_watchdog: bool = Field(
        default=True, description="Extend a held compute lock every ttl/3 while compute runs."
    )
    lock_timeout_seconds: float = Field(
        default=5.0, gt=0, le=300, description="Socket timeout of the lock's Redis client."
    )
    providers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Providers with shared limits as JSON {"<name>": {"rpm": 500, "tpm": '
        '200000, "concurrency": 20, "input_per_million": "2.50", "output_per_million": '
        '"10.00"}, …} (onceflow.spend; docs/spend.md).',
    )
    spend_ledger: bool = Field(
        default=True,
        description="A process that uses a Flow (its Celery workers, onceflow.testing, the "
        "API, an app that enqueues) or runs the standalone worker gives every declared "
        "provider without hooks of its own the spend ledger on its database: budgets checked "
        "at each permit, each settled call a ledger row (docs/spend-budgets.md). False: "
        "providers record nothing unless given hooks in code.",
    )
    # The HTTP API (onceflow.integrations.fastapi). Keys are stored hashed: sha256 hex.
    api_keys: dict[str, list[str]] = Field(
        default_factory=dict,
        description='API keys as JSON {"<sha256 hex of the key>": ["<workspace>", …]} '
        '("*" = every workspace): enqueue, ops and reads in those workspaces.',
    )
    worker_keys: dict[str, WorkerKeyScopes | list[str]] = Field(
        default_factory=dict,
        description='Worker keys as JSON {"<sha256 hex of the key>": {"worker_classes": '
        '["<worker class>", …], "workspaces": ["<workspace>", "<prefix>*", …]}} ("*" = every '
        "class / every workspace): claims of those worker classes, in those workspaces only, "
        'over HTTP. The older form {"<sha256 hex>": ["<worker class>", …]} still works and '
        "means every workspace (a trusted back end's key; logged at start-up).",
    )
    worker_token_secrets: SecretStr | None = Field(
        default=None,
        description="Secrets (comma-separated, each at least 32 characters) that worker tokens "
        "are signed with (HS256 JWTs, onceflow.mint_worker_token): the first one mints, every "
        "one verifies, so a new secret goes first and the old one stays until its tokens "
        "expire. Unset: worker tokens are refused (401).",
    )
    worker_token_max_lifetime_seconds: float = Field(
        default=86_400.0,
        gt=0,
        le=30 * 86_400,
        description="Longest lifetime (exp - iat) of a worker token; a token minted for "
        "longer is refused (401) and onceflow.mint_worker_token refuses to mint it.",
    )
    operator_keys: dict[str, list[str] | dict[str, list[str]]] = Field(
        default_factory=dict,
        description='Operator keys as JSON {"<sha256 hex of the key>": ["viewer"] or ["admin"]}: '
        "the dashboard and /metrics (viewer), and requeue/cancel from the dashboard (admin). "
        'A key limited to some workspaces: {"roles": [...], "workspaces": ["acme-*"]}; the '
        "dashboard withholds other workspaces' inputs, results and errors from it.",
    )
    trace_workspace_ids: bool = Field(
        default=False,
        description="Put the workspace id on onceflow's spans (onceflow.workspace_id). Off by "
        "default: a workspace id may name a customer, and a trace backend is often read by more "
        "people than the database. Request ids, stages and worker classes are always set.",
    )
    otel_setup: bool = Field(
        default=True,
        description="Let `onceflow worker`, `work`, `api` and `beat` install OpenTelemetry's "
        "SDK when the OTEL_* variables ask for an exporter. Set false when the application "
        "installs its own tracer provider after start-up (e.g. in Celery's "
        "worker_process_init): one installed before is kept either way.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines of `onceflow worker`, `work`, `api` and `beat`: text, or one JSON "
        "object per line with the request id, workspace, stage, attempt and the current trace "
        "and span ids.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve Prometheus metrics (every process of the multiprocess directory, and "
        "the database's live counts) on this port from a Celery worker's main process; unset: "
        "not served. Unauthenticated: bind it to an internal network only.",
    )
    metrics_bind: str = Field(
        default="127.0.0.1",
        description="Address the worker's metrics port (ONCEFLOW_METRICS_PORT) binds.",
    )
    metrics_database: bool = Field(
        default=True,
        description="Include the database collector (live counts, oldest due age, "
        "onceflow_database_up) in the worker's metrics port and the API's /metrics. Set false "
        "on all but one scrape target (e.g. keep it in `onceflow metrics` only) so one place "
        "runs the counts.",
    )
    metrics_count_cap: int = Field(
        default=100_000,
        ge=1,
        le=100_000_000,
        description="Index entries the live counts read per status at most (/metrics and the "
        "dashboard): past it a status's counts are lower bounds "
        "(onceflow_requests_lower_bound 1; the dashboard's depth_lower_bound).",
    )
    api_metrics_prune_dead_pids: bool = Field(
        default=False,
        description="Let the API's /metrics drop the live-gauge files of pids it cannot see "
        "(PROMETHEUS_MULTIPROC_DIR). Off by default: in another pid namespace (a container "
        "sharing the directory) every worker looks dead. `onceflow metrics` prunes unless "
        "--keep-dead-pids.",
    )
    dashboard_query_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="Longest a dashboard read's statement may run (search, series, request "
        "page; SET LOCAL statement_timeout): past it the statement is stopped and the route "
        "answers 503, so a broad search cannot walk a large table for ever.",
    )
    probe_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        le=30,
        description="Deadline of each readiness check (/readyz: database, migrations, "
        "Redis); a server that does not answer within it fails its check.",
    )
    api_max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest HTTP request body; larger ones get 413 before anything parses them.",
    )
    api_body_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Time a client has to send a whole request body (from its first read); "
        "a slower one gets 408 and the connection is closed (slow-body clients cannot hold "
        "the server's connections).",
    )
    api_sse_keepalive_seconds: float = Field(
        default=15.0, gt=0, le=3600, description="Keep-alive comment interval of event streams."
    )
    api_sse_max_per_key: int = Field(
        default=100,
        ge=1,
        description="Open event streams per key per API process; past it a new one gets 429.",
    )
    api_sse_max_streams: int = Field(
        default=1000,
        ge=1,
        description="Open event streams per API process (all keys); past it a new one gets 429.",
    )
    api_sse_queue_size: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Messages queued for one event stream; a client that falls this far behind "
        "is disconnected (it reconnects and catches up with GET …/ops?since=).",
    )
    api_rate_limit: str = Field(
        default="100/second;3000/minute",
        description="Requests per key (the `limits` library's syntax, `;` between limits); "
        'empty ("") turns the limit off.',
    )
    api_auth_failure_limit: str = Field(
        default="30/minute",
        description="Failed authentications (401) per client address before it gets 429 "
        'for every request; empty ("") turns the limit off.',
    )
    api_rate_limit_storage: str = Field(
        default="memory://",
        description="Where rate-limit counters live: memory:// (per API process) or a "
        "redis:// or redis+cluster:// URL (shared by every API process).",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then the environment, then :func:`use_defaults`' values, then the
        fields' defaults."""
        above = (init_settings, env_settings, dotenv_settings, file_secret_settings)
        return (*above, _DefaultsSource(settings_cls, above))

    @property
    def worker_token_secret_list(self) -> list[str]:
        """The worker-token secrets, in order (the first mints); [] when unset."""
        if self.worker_token_secrets is None:
            return []
        raw = self.worker_token_secrets.get_secret_value()
        return [part.strip() for part in raw.split(",") if part.strip()]

    @property
    def celery_broker_url(self) -> str:
        """The broker Celery connects to (unchecked: a Flow uses
        :func:`onceflow.tasks.config.broker_url`, which refuses a Redis Cluster)."""
        return self.broker_url or self.redis_url


#: The values of :func:`use_defaults`, beneath the environment.
_defaults: dict[str, Any] = {}


class _DefaultsSource(PydanticBaseSettingsSource):
    """The values given to :func:`use_defaults`, for the fields no source ``above`` sets.

    pydantic-settings merges dict values across sources; a setting the environment (or an
    argument) gives wins whole: its ``api_keys`` replace those of the defaults.
    """

    def __init__(
        self, settings_cls: type[BaseSettings], above: tuple[PydanticBaseSettingsSource, ...]
    ) -> None:
        super().__init__(settings_cls)
        self._above = above

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _defaults.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        if not _defaults:
            return {}
        given: set[str] = set()
        for source in self._above:
            given.update(source())
        return {name: value for name, value in _defaults.items() if name not in given}


def use_defaults(values: Mapping[str, Any]) -> None:
    """Use ``values`` (field names, e.g. ``{"lease_seconds": 30}``) where the environment
    sets nothing, in every :class:`Settings` made from now on (:func:`get_settings`
    included). They replace the previous call's; an unknown name raises ``ValueError``
    and a value the field refuses raises pydantic's ``ValidationError`` (a ``ValueError``);
    either way nothing changes. ``use_defaults({})`` drops them.
    """
    names = {str(name).lower() for name in values}
    unknown = sorted(names - set(Settings.model_fields))
    if unknown:
        raise ValueError(f"unknown onceflow setting(s): {', '.join(unknown)}")
    given = {str(name).lower(): value for name, value in values.items()}
    Settings.model_validate(given)  # a bad value raises here (pydantic's ValidationError)
    _defaults.clear()
    _defaults.update(given)
    get_settings.cache_clear()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment (and :func:`use_defaults`) once."""
    return Settings()
