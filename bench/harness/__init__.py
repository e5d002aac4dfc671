"""What every benchmark in ``bench/`` shares: servers, rounds, ratios and the report.

* Servers: a fresh database on the admin server (:func:`bench_database`, created, migrated
  and dropped ``WITH (FORCE)`` on the way out, whatever happens), a private Redis
  (:func:`private_redis`), onceflow's embedded PostgreSQL (:class:`PrivatePostgres`), and a
  worker subprocess in a process group of its own (:class:`Proc`: a Celery worker, an
  ``onceflow`` command).
* Rounds: a candidate and its baseline measured in the same run, in turns
  (:func:`rotated`, :func:`interleaved`), so that a burst of outside load on a shared
  machine hits both sides alike; the figure is the median of the per-round ratios
  (:func:`per_round_ratios`), not the ratio of pooled rates.
* The report: the machine and date header (:func:`machine_info`), Markdown tables
  (:func:`table`), and the raw numbers as JSON instead (:func:`emit`).

Progress goes to stderr (:func:`log`), the report to stdout. A script imports this package
as ``bench.harness``, after putting the repository's root first on ``sys.path`` (so that a
run from another worktree measures that tree's onceflow, not the editable install's).
"""

from __future__ import annotations

from bench.harness.postgres import (
    ADMIN_DEFAULT,
    HARNESS_APP,
    PrivatePostgres,
    admin_url,
    bench_database,
    database_machine,
    database_url,
    fresh_databases,
    libpq,
    postgres_settings,
    raw_connect,
)
from bench.harness.processes import (
    CLK_TCK,
    ROOT,
    Proc,
    ProcessPool,
    cpu_seconds,
    run_until,
    stack_samples,
    stop_group,
    wait_for,
    wait_until,
)
from bench.harness.redis_server import (
    bench_redis_url,
    free_port,
    private_redis,
    process_redis,
    redis_answers,
    redis_binary,
    redis_version,
    start_redis,
)
from bench.harness.report import (
    command_header,
    command_line,
    cpu_model,
    emit,
    finish,
    header,
    loadavg,
    log,
    machine_info,
    ok,
    psycopg_version,
    row,
    table,
)
from bench.harness.rounds import (
    interleaved,
    latency_ms,
    median_or_none,
    pct,
    per_round_ratios,
    rotated,
)

__all__ = [
    "ADMIN_DEFAULT",
    "CLK_TCK",
    "HARNESS_APP",
    "ROOT",
    "PrivatePostgres",
    "Proc",
    "ProcessPool",
    "admin_url",
    "bench_database",
    "bench_redis_url",
    "command_header",
    "command_line",
    "cpu_model",
    "cpu_seconds",
    "database_machine",
    "database_url",
    "emit",
    "finish",
    "free_port",
    "fresh_databases",
    "header",
    "interleaved",
    "latency_ms",
    "libpq",
    "loadavg",
    "log",
    "machine_info",
    "median_or_none",
    "ok",
    "pct",
    "per_round_ratios",
    "postgres_settings",
    "private_redis",
    "process_redis",
    "psycopg_version",
    "raw_connect",
    "redis_answers",
    "redis_binary",
    "redis_version",
    "rotated",
    "row",
    "run_until",
    "stack_samples",
    "start_redis",
    "stop_group",
    "table",
    "wait_for",
    "wait_until",
]
