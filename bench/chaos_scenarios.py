"""The chaos scenarios: what breaks, when, and for how long.

Each fault runs in its own thread ``Sizes.fault_at`` seconds into the drain, marks the fault's
start and end on the :class:`~bench.chaos_run.Run`, and records the instants (a kill, a Redis
loss) or windows (a partition) that may explain a provider call paid twice.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg

from bench import chaos_stages
from bench.chaos_run import Run, Scenario, lose_wakeups
from bench.harness import ROOT, libpq

#: One sitecustomize shifts a process's wall clock, for the tests and for the chaos suite.
SKEW_DIR = ROOT / "tests" / "acceptance" / "skewed_clock"
#: How long the timed faults last (seconds): quick runs, full runs.
FAULT_SECONDS = {True: 6.0, False: 20.0}


def _fault_seconds(run: Run) -> float:
    return FAULT_SECONDS[run.sizes.requests <= 1000]


def pg_restart(run: Run) -> None:
    """Crash-restart PostgreSQL (immediate shutdown) on the same port."""
    run.begin_fault()
    down = run.cluster.restart_postgres()
    run.end_fault()
    run.note(f"PostgreSQL crash-restarted; answering again after {down:.1f}s")


def backend_kills(run: Run) -> None:
    """``pg_terminate_backend`` of every client backend of the database, every 2 s."""
    run.begin_fault()
    start = time.monotonic()
    kills = total = 0
    while time.monotonic() - start <= _fault_seconds(run) and not run.stop.is_set():
        with contextlib.suppress(psycopg.Error), run.admin() as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend' AND application_name <> 'chaos-harness'"
            ).fetchone()
            total += int(row[0]) if row else 0
            kills += 1
        run.sleep(start + 2.0 * kills - time.monotonic())
    run.end_fault()
    run.note(f"{kills} rounds of pg_terminate_backend, {total} backends terminated")


def redis_restart(run: Run) -> None:
    """``kill -9`` of Valkey: wake-ups queued in the broker and the compute locks are lost."""
    run.begin_fault()
    t = time.monotonic()
    inflight = run.llm.inflight()
    run.explaining.append((t, t))
    down = run.cluster.restart_redis(1.0)
    run.end_fault()
    run.note(f"Valkey killed -9 and restarted empty after {down:.1f}s "
             f"({inflight} provider calls in flight)")  # fmt: skip


def partition(run: Run) -> None:
    """Blackhole every worker and client connection to PostgreSQL for two leases and more."""
    seconds = 2 * run.scenario.lease + 1
    run.begin_fault()
    run.cluster.proxy.blackhole(True)
    run.note(f"partition: PostgreSQL unreachable through the proxy for {seconds:.0f}s")
    run.sleep(seconds)
    run.cluster.proxy.blackhole(False)
    run.end_fault()
    assert run.fault_start is not None and run.fault_end is not None
    run.explaining.append((run.fault_start, run.fault_end))


def latency(run: Run) -> None:
    """+200 ms on every round trip to PostgreSQL, with leases of one second."""
    run.begin_fault()
    run.cluster.proxy.latency(0.2)
    run.note(f"+200 ms latency to PostgreSQL for {_fault_seconds(run):.0f}s "
             f"(lease {run.scenario.lease}s)")  # fmt: skip
    run.sleep(_fault_seconds(run))
    run.cluster.proxy.latency(0.0)
    run.end_fault()
    assert run.fault_start is not None and run.fault_end is not None
    run.explaining.append((run.fault_start, run.fault_end))


def conn_exhaustion(run: Run) -> None:
    """Hold every connection slot of the server but two."""
    run.begin_fault()
    held: list[psycopg.Connection[Any]] = []
    url = libpq(run.cluster.direct_url(run.db))
    try:
        with run.admin() as conn:
            row = conn.execute("SHOW max_connections").fetchone()
        limit = int(row[0]) if row else 100
        while len(held) < limit:
            try:
                held.append(psycopg.connect(url, connect_timeout=3, application_name="chaos-hog"))
            except psycopg.OperationalError:
                break
        for conn in held[-2:]:
            conn.close()
        del held[-2:]
        run.note(f"holding {len(held)} of max_connections={limit} for {_fault_seconds(run):.0f}s")
        run.sleep(_fault_seconds(run))
    finally:
        for conn in held:
            with contextlib.suppress(Exception):
                conn.close()
        run.end_fault()


def idle_in_tx(run: Run) -> None:
    """A session locks rows (running requests first, then queued ones, and op sub-docs), idles."""
    run.begin_fault()
    url = libpq(run.cluster.direct_url(run.db))
    with psycopg.connect(url, application_name="chaos-harness", connect_timeout=5) as conn:
        rows: list[Any] = []
        for _ in range(30):  # a few tries until some request is queued or running
            rows = conn.execute(
                "SELECT request_id FROM workspace_process_requests "
                "WHERE status IN ('queued', 'running') "
                "ORDER BY (status = 'running') DESC, random() LIMIT 20 FOR UPDATE"
            ).fetchall()
            if rows:
                break
            conn.rollback()
            run.sleep(0.1)
        docs = conn.execute(
            "SELECT sub_doc FROM workspace_sub_docs WHERE sub_doc LIKE 'ops:%%' "
            "ORDER BY random() LIMIT 3 FOR UPDATE"
        ).fetchall()
        run.note(f"idle in transaction holding {len(rows)} request rows and {len(docs)} "
                 f"sub-docs for {_fault_seconds(run):.0f}s")  # fmt: skip
        run.sleep(_fault_seconds(run))
        conn.rollback()
    run.end_fault()


def beat_stopped_kill(run: Run) -> None:
    """Stop beat for good, then ``kill -9`` the llm worker mid provider call."""
    run.begin_fault()
    assert run.beat is not None
    run.beat_stopped = True
    run.beat.stop()
    run.note("beat stopped (for the rest of the run)")
    run.kill_worker(chaos_stages.LLM)


def kill_llm_worker(run: Run) -> None:
    """``kill -9`` the llm worker mid provider call (a replacement starts)."""
    run.begin_fault()
    run.kill_worker(chaos_stages.LLM)


def _second_sweepers(run: Run) -> None:
    """A second beat, and the harness sweeping with the same Flow every 0.2 s."""
    run.start_beat("beat2")
    sweeps = 0
    while not run.stop.wait(0.2):
        with contextlib.suppress(Exception):
            run.flow.sweep_once()
            sweeps += 1
    run.note(f"the extra sweeper ran {sweeps} sweeps")


def _foreign_sweeper(run: Run) -> None:
    """Another application's Flow (other stages, same table) sweeping every 0.2 s."""
    foreign = chaos_stages.build_foreign(run.settings)
    sweeps = 0
    try:
        while not run.stop.wait(0.2):
            with contextlib.suppress(Exception):
                foreign.sweep_once()
                sweeps += 1
    finally:
        foreign.app.close()
    run.note(f"the foreign sweeper ran {sweeps} sweeps")


def lost_wakeups_and_kill(run: Run) -> None:
    """Wake-ups lost (broker queues purged), then ``kill -9`` of the llm worker."""
    run.begin_fault()
    lose_wakeups(run)
    run.kill_worker(chaos_stages.LLM)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("baseline", "baseline (no fault)"),
        Scenario("pg_restart", "PostgreSQL crash restart", pg_restart),
        Scenario("backend_kills", "pg_terminate_backend of all clients every 2 s", backend_kills),
        Scenario("redis_restart", "Redis kill -9 + restart (queue and locks lost)", redis_restart),
        Scenario(
            "partition",
            "partition to PostgreSQL, 2 leases + 1 s",
            partition,
            lease_loss_expected=True,
        ),
        Scenario(
            "latency",
            "+200 ms to PostgreSQL, lease 1 s",
            latency,
            lease=1.0,
            lease_loss_expected=True,
        ),
        Scenario("conn_exhaustion", "max_connections held but 2", conn_exhaustion),
        # The session holds running requests' own rows longer than a lease: their heartbeats
        # wait on the lock, the leases lapse by the database clock, and the completions are
        # fenced out; the re-run is the lease doing its job.
        Scenario(
            "idle_in_tx",
            "idle in transaction holding row locks",
            idle_in_tx,
            lease_loss_expected=True,
        ),
        Scenario("beat_stopped_kill", "beat stopped + llm worker kill -9", beat_stopped_kill),
        Scenario(
            "clock_ahead",
            "every worker's clock +1 h, llm worker kill -9",
            kill_llm_worker,
            worker_env={
                "PYTHONPATH": f"{SKEW_DIR}:{ROOT}",
                "ONCEFLOW_TEST_CLOCK_SKEW_SECONDS": "3600",
            },
        ),
        Scenario(
            "two_sweepers",
            "two beats + a third sweeper, llm worker kill -9",
            kill_llm_worker,
            during=_second_sweepers,
        ),
        Scenario(
            "foreign_sweeper",
            "foreign Flow sweeping, wake-ups lost + kill -9",
            lost_wakeups_and_kill,
            during=_foreign_sweeper,
        ),
    ]
}
