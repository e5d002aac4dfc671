"""The database collector: live request counts and the oldest due age, read at scrape time,
and the request table's vacuum health (dead rows, the last vacuum, the oldest transaction
holding a snapshot) from the statistics views.

Index-only scans of the partial indexes (``onceflow.metrics.sql``), on one
connection of its own with a short connect and statement timeout: a database that is
down or slow costs the scrape at most a couple of seconds and answers
``onceflow_database_up 0``, while every process-recorded metric still answers.

A database that stops answering without closing anything (a paused server, a black-holed
network) is bounded on the client side too, since ``statement_timeout`` is the server's:
the connection has ``tcp_user_timeout`` and keepalives, a watchdog shuts its socket down
when a read outlives the timeout, and a scrape waits for another scrape's read at most
the timeout (then it answers ``onceflow_database_up 0``).

A database split by workspace (several URLs: ``ONCEFLOW_DATABASE_URLS`` /
``ONCEFLOW_SHARD_MAP``): each shard is read on a connection of its own, the shards at
once (a scrape still costs at most about the timeout), and the answers merge as in
docs/sharding.md 2.4 — counts summed, ``lower_bound`` OR-ed, the oldest age the largest,
the estimated and dead rows summed, the vacuum and transaction ages the largest.
``onceflow_database_up`` then has a ``shard`` label, one sample per shard; the counts are
those of the shards that answered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from psycopg.rows import dict_row
from sqlalchemy import make_url

from onceflow.db import redact_url
from onceflow.metrics import sql as metrics_sql

log = logging.getLogger("onceflow.metrics")

#: Seconds the collector waits to connect and for its statements.
DB_TIMEOUT_SECONDS = 2.0
#: Extra seconds past the timeout before the watchdog shuts a stuck read's socket down.
WATCHDOG_GRACE_SECONDS = 1.0


def libpq_url(url: str) -> str:
    """A SQLAlchemy database URL as a libpq connection string."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class _Database:
    """One database's reads: a connection of its own, bounded on both sides."""

    def __init__(self, database_url: str, query: str, timeout: float) -> None:
        self.url = database_url
        self._query = query
        self._conninfo = libpq_url(database_url)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self.warned = False

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            ms = int(self._timeout * 1000)
            self._conn = psycopg.connect(
                self._conninfo,
                connect_timeout=max(2, int(self._timeout)),
                options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
                autocommit=True,
                row_factory=dict_row,
                application_name="onceflow-metrics",
                # Client-side bounds (statement_timeout needs a server that answers).
                tcp_user_timeout=ms,
                keepalives=1,
                keepalives_idle=max(1, int(self._timeout)),
                keepalives_interval=1,
                keepalives_count=3,
            )
        return self._conn

    def read(self) -> Answer:
        """The live count rows, the estimated table rows and the table's vacuum health;
        raises if the database does not answer."""
        if not self._lock.acquire(timeout=self._timeout):
            raise TimeoutError("another scrape's database read has not answered")
        try:
            conn = self._connection()
            watchdog = threading.Timer(self._timeout + WATCHDOG_GRACE_SECONDS, _abort, (conn,))
            watchdog.daemon = True
            watchdog.start()
            try:
                rows = conn.execute(self._query).fetchall()
                est = conn.execute(metrics_sql.ESTIMATED_ROWS.sql).fetchone()
                health = conn.execute(metrics_sql.TABLE_HEALTH.sql).fetchone()
            finally:
                watchdog.cancel()
        except Exception:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            raise
        finally:
            self._lock.release()
        return Answer(rows, float(est["estimate"]) if est else 0.0, dict(health or {}))

    def close(self) -> None:
        """Close this database's connection (a later read opens a new one)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None

    def answer(self) -> Answer | None:
        """:meth:`read`, or None (logged once per outage) when the database does not answer."""
        try:
            answer = self.read()
        except Exception as exc:
            if not self.warned:
                self.warned = True
                log.warning("metrics: database %s not answering: %s", redact_url(self.url), exc)
            return None
        self.warned = False
        return answer


class Answer(NamedTuple):
    """One database's answer at a scrape."""

    #: The live count rows (``metrics_sql.live_counts``).
    rows: list[dict[str, Any]]
    #: The table's estimated rows (``metrics_sql.ESTIMATED_ROWS``; -1 before an ANALYZE).
    estimate: float
    #: ``dead_rows``, ``vacuum_age`` (None while a part holding dead rows was never
    #: vacuumed), ``oldest_xact_age`` (``metrics_sql.TABLE_HEALTH``).
    health: dict[str, Any]


class DatabaseCollector(Collector):
    """``onceflow_requests``, ``onceflow_oldest_queued_age_seconds``, the table's estimated
    rows, its vacuum health and ``onceflow_database_up``, from the database at each scrape.

    ``database_url``: one database, or the URLs of the shards of a database split by
    workspace (in shard order), read at once and merged (see the module).
    """

    def __init__(
        self,
        database_url: str | Sequence[str],
        *,
        timeout: float = DB_TIMEOUT_SECONDS,
        count_cap: int = metrics_sql.COUNT_CAP_DEFAULT,
    ) -> None:
        urls = [database_url] if isinstance(database_url, str) else list(database_url)
        if not urls:
            raise ValueError("the database collector needs at least one database URL")
        query = metrics_sql.live_counts(count_cap)
        self._databases = [_Database(url, query, timeout) for url in urls]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []  # nothing is read at registration

    def close(self) -> None:
        """Close the collector's connections and threads (a later scrape reopens them)."""
        for db in self._databases:
            db.close()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = None

    def read(self) -> Answer:
        """The first database's :class:`Answer`; raises if it does not answer."""
        return self._databases[0].read()

    def _answers(self) -> list[Answer | None]:
        if len(self._databases) == 1:
            return [self._databases[0].answer()]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    len(self._databases), thread_name_prefix="onceflow-metrics"
                )
            pool = self._pool
        return list(pool.map(lambda db: db.answer(), self._databases))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        answers = self._answers()
        sharded = len(self._databases) > 1
        up = GaugeMetricFamily(
            "onceflow_database_up",
            "1 if the metrics' database query answered at this scrape, else 0"
            + (" (per shard of a database split by workspace)." if sharded else "."),
            labels=["shard"] if sharded else None,
        )
        for index, answer in enumerate(answers):
            up.add_metric([str(index)] if sharded else [], 0.0 if answer is None else 1.0)
        yield up
        got = [a for a in answers if a is not None]
        if not got:
            return
        rows = [r for a in got for r in a.rows]
        estimates = [a.estimate for a in got if a.estimate >= 0]
        yield from _families(rows, sum(estimates) if estimates else -1.0)
        yield from _health_families([a.health for a in got])


def _abort(conn: psycopg.Connection[Any]) -> None:
    """Shut down the socket of a read that outlived its timeout: the blocked read fails at once.

    ``conn.cancel()`` would need the server to answer; a shutdown needs nothing from it.
    """
    try:
        fd = os.dup(conn.fileno())
    except Exception:
        return  # closed meanwhile
    with socket.socket(fileno=fd) as sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    log.warning("metrics: database read outlived its timeout; connection dropped")


def _families(rows: list[dict[str, Any]], estimate: float) -> Iterator[GaugeMetricFamily]:
    counts: dict[tuple[str, str, str], int] = {}
    oldest: dict[str, float] = {}
    for r in rows:
        wc, stage = r["worker_class"], r["stage"]
        for status in ("queued", "scheduled", "running", "dead"):
            key = (wc, stage, status)
            counts[key] = counts.get(key, 0) + int(r[status])
        age = r["oldest_due_age"]
        if age is not None:
            oldest[wc] = max(oldest.get(wc, 0.0), max(0.0, float(age)))
        else:
            oldest.setdefault(wc, 0.0)
    requests = GaugeMetricFamily(
        "onceflow_requests",
        "Live requests by status (queued = due now, scheduled = run_after in the future, "
        "running, dead): exact counts from the partial indexes. Succeeded and cancelled are "
        "not counted here (see the counters). Lower bounds where "
        "onceflow_requests_lower_bound{status} is 1.",
        labels=["worker_class", "stage", "status"],
    )
    for (wc, stage, status), n in sorted(counts.items()):
        requests.add_metric([wc, stage, status], float(n))
    yield requests
    capped = set(metrics_sql.capped_statuses(rows))
    bound = GaugeMetricFamily(
        "onceflow_requests_lower_bound",
        "1 if this status's counts (for queued, also the oldest due age) are LOWER BOUNDS: "
        "its index held more entries than the count cap (ONCEFLOW_METRICS_COUNT_CAP); "
        "0 if exact.",
        labels=["status"],
    )
    for status in ("queued", "scheduled", "running", "dead"):
        bound.add_metric([status], 1.0 if status in capped else 0.0)
    yield bound
    age_family = GaugeMetricFamily(
        "onceflow_oldest_queued_age_seconds",
        "How long the oldest due queued request of the class has been due (database clock); "
        "0 when none is due.",
        labels=["worker_class"],
    )
    for wc, age in sorted(oldest.items()):
        age_family.add_metric([wc], age)
    yield age_family
    yield GaugeMetricFamily(
        "onceflow_requests_estimated_rows",
        "ESTIMATE of the rows of workspace_process_requests (every status, history "
        "included) from pg_class.reltuples, as of the last VACUUM/ANALYZE; 0 before the first.",
        value=max(0.0, estimate),
    )


def _health_families(health: list[dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """The table's vacuum health: dead rows summed over the shards, the ages the largest."""
    yield GaugeMetricFamily(
        "onceflow_requests_dead_rows",
        "ESTIMATE of the dead row versions in workspace_process_requests "
        "(pg_stat_user_tables.n_dead_tup) that no vacuum has removed yet.",
        value=sum(float(h.get("dead_rows") or 0.0) for h in health),
    )
    ages = [float(h["vacuum_age"]) for h in health if h.get("vacuum_age") is not None]
    vacuum = GaugeMetricFamily(
        "onceflow_requests_vacuum_age_seconds",
        "Seconds since the last vacuum (by hand or by autovacuum) of the least recently "
        "vacuumed part of workspace_process_requests that holds dead rows; 0 when none "
        "does; no sample while one that does was never vacuumed.",
    )
    if ages and len(ages) == len(health):
        vacuum.add_metric([], max(0.0, max(ages)))
    yield vacuum
    yield GaugeMetricFamily(
        "onceflow_database_oldest_transaction_age_seconds",
        "Age of the oldest open transaction holding a snapshot in onceflow's database "
        "(pg_stat_activity; another role's only with pg_read_all_stats); 0 if none. "
        "While it runs, no vacuum removes what it might see.",
        value=max([0.0, *(float(h.get("oldest_xact_age") or 0.0) for h in health)]),
    )
