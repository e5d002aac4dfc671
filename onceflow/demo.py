"""``onceflow demo``: layer 1 end to end against real Postgres.

Several clients enqueue the same stage work at once (duplicates collapse at the
primary key), workers claim and complete it with a transactional hand-off to
the next stage, and the report checks that every request ran exactly once.
When the configured Postgres does not answer, the embedded server of the
``embedded`` extra is started in a temporary directory and stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import make_url

from onceflow.settings import get_settings


@dataclass
class DemoReport:
    """What the demo measured; ``invariants_ok`` is the verdict."""

    database: str
    embedded: bool
    clients: int
    jobs: int
    requests_enqueued: int
    requests_created: int
    stage_runs: int
    succeeded: int
    runs_per_request_max: int
    hand_offs: int
    wall_seconds: float
    invariants_ok: bool


@contextlib.contextmanager
def _database(url: str) -> Iterator[tuple[str, bool]]:
    """A database URL that answers: the configured one, or an embedded server's."""
    from onceflow.embedded import embedded_services, service_answers

    db_ok, _ = service_answers(url, None)
    if db_ok:
        yield url, False
        return
    print(
        f"onceflow demo: no Postgres answering at {make_url(url).render_as_string()}; "
        "starting the embedded PostgreSQL 16 (pgserver wheel)",
        file=sys.stderr,
    )
    with embedded_services(redis=False) as services:
        yield services.database_url, True


def _ensure_database(url: str, name: str) -> str:
    """Create database ``name`` on the server of ``url`` if missing; return its URL."""
    import psycopg

    admin = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _reachable_admin_url(url: str) -> str:
    """The server's maintenance database, to create the demo's own database from."""
    return make_url(url).set(database="postgres").render_as_string(hide_password=False)


def run_demo(*, clients: int = 8, jobs: int = 20, workers: int = 4) -> DemoReport:
    """Run the layer-1 scenario and return its report."""
    from onceflow.migrate import migrate
    from onceflow.models.requests import NewRequest
    from onceflow.queue import Queue

    configured = get_settings().database_url
    started = time.monotonic()
    with _database(_reachable_admin_url(configured)) as (server_url, embedded):
        target = make_url(configured).database or "onceflow"
        url = _ensure_database(server_url, target)
        migrate(url)
        queue = Queue(url)
        workspace = f"demo-{int(time.time())}"
        results: list[Any] = []
        lock = threading.Lock()
        barrier = threading.Barrier(clients)

        def client(n: int) -> None:
            barrier.wait()
            items = [
                NewRequest(workspace, f"job-{j}", "evaluate", "main", {"columns": ["fit", "pay"]})
                for j in range(jobs)
            ]
            got = queue.enqueue_many(items)
            with lock:
                results.extend(got)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        runs: dict[str, int] = {}
        hand_offs = 0

        def worker(n: int) -> None:
            nonlocal hand_offs
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 1.0:
                claims = queue.claim_next("default", f"demo-worker-{n}", limit=4)
                if not claims:
                    time.sleep(0.02)
                    continue
                idle_since = time.monotonic()
                for claim in claims:
                    req = claim.request
                    with lock:
                        runs[req.request_id] = runs.get(req.request_id, 0) + 1
                    then = []
                    if req.stage == "evaluate":
                        then = [NewRequest(req.workspace_id, req.job_id, "tailor", req.branch_path)]
                    queue.complete(claim, {"stage": req.stage, "by": n}, then=then)
                    if then:
                        with lock:
                            hand_offs += 1

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        for t in threads + pool:
            t.start()
        for t in threads + pool:
            t.join()
        mine = queue.list(workspace_id=workspace, limit=1000)
        succeeded = sum(1 for r in mine if r.status.value == "succeeded")
        ok = (
            len(mine) == 2 * jobs
            and succeeded == 2 * jobs
            and all(r.attempts == 1 for r in mine)
            and max(runs.values(), default=0) == 1
            and sum(r.created for r in results) == jobs
        )
        return DemoReport(
            database=make_url(url).render_as_string(),
            embedded=embedded,
            clients=clients,
            jobs=jobs,
            requests_enqueued=len(results),
            requests_created=sum(r.created for r in results),
            stage_runs=sum(runs.values()),
            succeeded=succeeded,
            runs_per_request_max=max(runs.values(), default=0),
            hand_offs=hand_offs,
            wall_seconds=round(time.monotonic() - started, 2),
            invariants_ok=ok,
        )


def print_report(report: DemoReport, *, as_json: bool) -> None:
    """Print the report as a table, or as one JSON object."""
    if as_json:
        print(json.dumps(asdict(report), sort_keys=True))
        return
    print("onceflow demo — layer 1: the durable stage queue")
    for key, value in asdict(report).items():
        print(f"  {key:<22} {value}")
    print("invariants: " + ("OK" if report.invariants_ok else "BROKEN"))
