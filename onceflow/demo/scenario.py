# Over ~400 lines on purpose: one scripted run of the demo's flow, read top to bottom as
# the demo's story (start, load, faults, checks); not on the runtime path.
"""The demo's flow, where each of the three layers applies, run for real, with figures.

Real Postgres and Redis (configured, or embedded ones), real Celery worker processes
for two worker classes, beat with the sweeper, stand-in LLM and Maps servers that
count every request, and K concurrent clients enqueueing overlapping work and
writing ops with retries. Faults (on by default): one worker is killed with
``kill -9`` mid-stage, and some write responses are dropped after commit. With
``browser`` (``--browser``), one more client is a real headless Chromium tab (see
:mod:`onceflow.demo.browser`) talking to a real ``onceflow api``.

A run is a good neighbour on a shared Redis database: its broker keys carry a per-run
prefix (:func:`onceflow.demo.stages.broker_prefix`), its own keys a per-run workspace,
and at the end it deletes exactly those two namespaces and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import make_url

from onceflow.demo.plan import COLUMNS, SECTIONS, Options, Run
from onceflow.demo.procs import Proc, start_worker, wait_for
from onceflow.demo.progress import ProgressBar
from onceflow.demo.standins import StandIn
from onceflow.demo.trace_view import enqueue_span, named

if TYPE_CHECKING:
    from onceflow.demo.browser import BrowserTab
    from onceflow.demo.traces import TraceReceiver

log = logging.getLogger(__name__)
APP = "onceflow.demo.stages:flow"
LLM_LATENCY = 0.08
MAPS_LATENCY = 0.05


@contextlib.contextmanager
def services(announce: Any) -> Iterator[tuple[str, str, bool]]:
    """(server database URL, Redis URL, embedded?): the configured ones, or embedded ones."""
    from onceflow.embedded import embedded_services, service_answers
    from onceflow.redis_clients import require_one_server
    from onceflow.settings import get_settings

    settings = get_settings()
    # The demo's Redis is also its Celery broker, which cannot be a Redis Cluster.
    require_one_server(settings.redis_url, "the demo's Redis (also its Celery broker)")
    admin = make_url(settings.database_url).set(database="postgres")
    admin_url = admin.render_as_string(hide_password=False)
    db_ok, redis_ok = service_answers(admin_url, settings.redis_url)
    if db_ok and redis_ok:
        yield admin_url, settings.redis_url, False
        return
    missing = " and ".join(n for n, ok in (("Postgres", db_ok), ("Redis", redis_ok)) if not ok)
    announce(f"no {missing} answering at the configured URLs; starting the embedded servers")
    with embedded_services(postgres=not db_ok, redis=not redis_ok) as emb:
        yield (
            (admin_url if db_ok else emb.database_url),
            (settings.redis_url if redis_ok else emb.redis_url),
            True,
        )


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new database on the server, migrated; dropped at the end."""
    import psycopg

    from onceflow.migrate import migrate

    name = f"onceflow_demo_{secrets.token_hex(4)}"
    libpq = make_url(server_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        yield url
    finally:
        from onceflow.db import dispose_engines

        dispose_engines()
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class DroppingTransport:
    """A flaky network: every third op's response is lost once, after its commit."""

    def __init__(self, inner: Any, run: Run, enabled: bool) -> None:
        self.inner = inner
        self.run = run
        self.enabled = enabled
        self.sent = 0
        self.dropped: set[str] = set()

    def apply(self, *args: Any) -> Any:
        from onceflow.oplog import TransportError

        result = self.inner.apply(*args)
        self.sent += 1
        if self.enabled and self.sent % 3 == 0 and result.op_id not in self.dropped:
            self.dropped.add(result.op_id)
            with self.run.lock:
                self.run.dropped_at.append(self.run.elapsed())
            raise TransportError("response lost after the server committed")
        return result


def client(n: int, opts: Options, run: Run, env: dict[str, str]) -> None:
    """One simulated client enqueueing overlapping work (and, for tabs, writing ops)."""
    from onceflow.demo.stages import flow
    from onceflow.oplog import InProcessTransport, OpLog, WorkspaceClient

    kind = ["tab", "agent", "webapp", "cli"][n % 4]
    rng = random.Random(n)
    jobs = list(range(opts.jobs))
    rng.shuffle(jobs)
    columns = COLUMNS[: opts.columns]
    writer = None
    if kind == "tab":
        transport = DroppingTransport(InProcessTransport(OpLog()), run, opts.faults)
        writer = WorkspaceClient(transport, run.workspace, backoff_base=0.01)
    for j in jobs:
        job = f"job-{j}"
        requests: list[tuple[str, str, dict[str, Any]]] = [
            ("evaluate", "main", {"columns": columns}),
            ("enrich", "", {"origin": f"home-{n % 2}", "destination": f"office-{j}"}),
            ("tailor", "main", {"sections": SECTIONS}),
            ("radar", "", {"page": f"radar-{j % 8}"}),
        ]
        if kind == "agent":  # an agent re-evaluates on its own branch: same cells, new row
            requests.append(("evaluate", "agent", {"columns": columns}))
        rng.shuffle(requests)
        for stage, branch, data in requests:
            if kind == "cli" and stage == "radar" and j == jobs[0]:  # a script, once
                created = _cli_enqueue(stage, run.workspace, job, branch, data, env)
            else:
                with enqueue_span(kind, stage):  # the request's root span (--trace)
                    created = flow.enqueue(stage, run.workspace, job, branch, data).created
            with run.lock:
                run.enqueued += 1
                run.created += int(created)
        if writer is not None:
            card = f"card-{n}-{job}"
            writer.apply("board", {"type": "node.insert", "node": card})
            with run.lock:
                run.cards.add(card)
                run.ops_sent += 1
    if writer is not None:
        with run.lock:
            run.op_retries += writer.retries


def _cli_enqueue(
    stage: str, workspace: str, job: str, branch: str, data: dict[str, Any],
    env: dict[str, str],
) -> bool:  # fmt: skip
    """Enqueue through the `onceflow enqueue` command, as a script would."""
    args = ["enqueue", "--stage", stage, "--workspace", workspace, "--job", job,
            "--branch-path", branch, "--input", json.dumps(data)]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args], capture_output=True, text=True,
        timeout=60, env={**os.environ, **named(env, "onceflow-cli")}, check=True,
    )  # fmt: skip
    return bool(json.loads(out.stdout)["created"])


def inject_kill(opts: Options, run: Run, llm: StandIn, worker: Proc, log_dir: Path,
                env: dict[str, str]) -> Proc | None:  # fmt: skip
    """kill -9 the llm worker while it runs a stage; start a replacement. Returns it."""
    from onceflow.demo.stages import flow

    def llm_stage_running() -> bool:
        rows = flow.queue.list(workspace_id=run.workspace, status="running", worker_class="llm")
        return any(r.stage == "tailor" for r in rows) and llm.inflight() > 0

    try:
        wait_for(llm_stage_running, timeout=30, interval=0.02, what="an llm stage mid-way")
    except AssertionError:
        return None
    # A call in flight at the kill: answered by nobody, or received by the stand-in a moment
    # after the kill (sent just before it). Until the replacement starts, only the killed
    # worker calls the LLM (with --workers 2; more llm workers make this an upper bound).
    in_flight = {key for key in llm.inflight_keys() if "/eval:" in key}
    before = llm.stats()["per_key"]
    run.killed_at = run.elapsed()
    worker.signal_group(9)
    worker.popen.wait(timeout=10)
    # What the killed worker sent before it died is counted before the count is taken.
    if not llm.quiesce():
        log.warning("the LLM stand-in did not settle: the kill's late calls may be undercounted")
    after = llm.stats()["per_key"]
    late = sum(n - before.get(k, 0) for k, n in after.items() if "/eval:" in k)
    # A call already answered whose value was not stored yet died with the worker too: its
    # cell is paid again once the lock's TTL frees it (the chaos suite counts it the same way).
    answered = {k for k in after if "/eval:" in k and k not in in_flight and k in before}
    run.eval_inflight_at_kill = len(in_flight) + late + _unstored(run.workspace, answered)
    run.killed_worker = True
    return start_worker(log_dir, APP, "llm", concurrency=2, name="llm-replacement",
                        env=named(env, "onceflow-worker-llm"))  # fmt: skip


def _unstored(workspace: str, keys: set[str]) -> int:
    """How many of the ``<job>/eval:<column>`` cells have no stored value now."""
    from onceflow.context import oplog_for
    from onceflow.demo.stages import flow, job_doc

    oplog = oplog_for(flow.queue)
    missing = 0
    for key in keys:
        job, column = key.split("/eval:", 1)
        cells = oplog.get_sub_doc(workspace, job_doc(job)).state.get("cells", {})
        missing += column not in cells
    return missing


def run_scenario(opts: Options, announce: Any, present: Any = None) -> tuple[dict[str, Any], Run]:
    """Run the whole flow and return the report (see :mod:`onceflow.demo.report`).

    ``present(report)`` is called while everything still runs (to print it); with
    ``opts.keep_open`` the run then waits for Ctrl-C or SIGTERM before it cleans up.
    """
    with _sigterm_exits():
        return _run(opts, announce, present)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so a terminated demo still stops and removes all it made."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(opts: Options, announce: Any, present: Any) -> tuple[dict[str, Any], Run]:
    from onceflow.demo.report import build_report
    from onceflow.demo.stages import RUN_ENV
    from onceflow.settings import get_settings

    run = Run()
    api_key = os.environ.get("ONCEFLOW_LLM_API_KEY") or secrets.token_urlsafe(24)
    if opts.browser:  # the page gets the stand-in's key: a throwaway one, never a real secret
        api_key = secrets.token_urlsafe(24)
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        server_url, redis_url, embedded = stack.enter_context(services(announce))
        db_url = stack.enter_context(fresh_database(server_url))
        log_dir = opts.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        llm = StandIn("llm", latency=LLM_LATENCY, api_key=api_key).start()
        maps = StandIn("maps", latency=MAPS_LATENCY).start()
        stack.callback(llm.stop)
        stack.callback(maps.stop)
        env = {
            "ONCEFLOW_DATABASE_URL": db_url,
            "ONCEFLOW_REDIS_URL": redis_url,
            "ONCEFLOW_BROKER_URL": redis_url,  # the broker whose run-prefixed keys we remove
            RUN_ENV: run.run_id,
            "ONCEFLOW_APP": APP,
            "ONCEFLOW_DEMO_LLM_URLS": llm.url,
            "ONCEFLOW_DEMO_MAPS_URL": maps.url,
            "ONCEFLOW_LLM_API_KEY": api_key,  # to the workers by environment, never in a task
            "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
            "ONCEFLOW_REDISPATCH_AFTER_SECONDS": "10",
            "ONCEFLOW_LOCK_TTL_SECONDS": "5",
            "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
        }
        receiver = _start_receiver(opts, env, stack, announce)
        os.environ.update(env)
        get_settings.cache_clear()
        if receiver is not None:
            from onceflow.demo.trace_view import configure_demo, shutdown_demo

            configure_demo()
            stack.callback(shutdown_demo)  # before the receiver stops

        @stack.callback  # runs after every process below has stopped
        def _clean_redis() -> None:
            removed = remove_namespace(redis_url, run)
            announce(f"removed this run's {removed} Redis keys; nothing else was touched")

        @stack.callback
        def _stop_all() -> None:
            for proc in procs:
                proc.stop()

        announce(f"database {make_url(db_url).render_as_string()}; starting workers and beat")
        classes = ["llm", "fallback"]
        for i in range(max(2, opts.workers)):  # started together, then waited for
            wc = classes[i % 2]
            args = ["worker", "--app", APP, "--worker-class", wc, "--concurrency", "2",
                    "-n", f"{wc}-{i}-{os.getpid()}@%h"]  # fmt: skip
            procs.append(Proc(args, log_dir / f"worker-{wc}-{i}.log",
                              env=named(env, f"onceflow-worker-{wc}")))  # fmt: skip
        procs.append(Proc(["beat", "--app", APP], log_dir / "beat.log",
                          env=named(env, "onceflow-beat")))  # fmt: skip
        starting = list(procs)
        # With --browser, the api and Chromium start while the workers do.
        tab = _start_tab(opts, run, env, llm, api_key, log_dir, procs, stack)
        for proc in starting[:-1]:
            proc.wait_log(" ready.")
        starting[-1].wait_log("beat: Starting")
        if tab is not None:
            _tab_ready(tab, procs[len(starting)], announce)
        flower_url = None
        if opts.flower:
            flower, flower_url = _start_flower(log_dir, env, announce)
            procs.append(flower)
        announce(f"{opts.clients} clients enqueue {opts.jobs} jobs x {opts.columns} columns")
        threads = [threading.Thread(target=client, args=(n, opts, run, env), daemon=True)
                   for n in range(opts.clients)]  # fmt: skip
        for t in threads:
            t.start()
        if tab is not None:
            tab.go()
        bar = ProgressBar(sys.stderr, opts.expected_requests(), enabled=opts.progress)
        sampling = threading.Event()
        sampler = threading.Thread(target=_sample, args=(run, llm, bar, sampling), daemon=True)
        sampler.start()
        stack.callback(sampling.set)
        if opts.faults:
            replacement = inject_kill(opts, run, llm, procs[0], log_dir, env)
            if replacement is not None:
                procs.append(replacement)
                bar.clear()
                announce("fault: kill -9 of an llm worker mid-stage; a replacement started")
        for t in threads:
            t.join(timeout=opts.timeout)
        if tab is not None:
            _join_tab(tab, run, opts)
        _wait_drained(opts, run)
        sampling.set()
        sampler.join(timeout=5)
        bar.close()
        announce("every request finished; checking the invariants")
        report = build_report(opts, run, llm, maps, embedded=embedded)
        if receiver is not None:  # while the workers run: their last spans still arrive
            from onceflow.demo.trace_view import slowest_trace

            announce("waiting for the workers' spans")
            report["trace"] = slowest_trace(receiver)
        if present is not None:
            present(report)
        if opts.keep_open:
            _hold_open(announce, flower_url)
        return report, run
    raise AssertionError("unreachable")  # pragma: no cover


def _start_receiver(
    opts: Options, env: dict[str, str], stack: contextlib.ExitStack, announce: Any
) -> TraceReceiver | None:
    """With ``--trace``: a local OTLP receiver, and its ``OTEL_*`` variables in ``env`` (for
    this process and every process the run starts)."""
    if not opts.trace:
        return None
    from onceflow.demo.trace_view import otel_env
    from onceflow.demo.traces import TraceReceiver

    receiver = stack.enter_context(TraceReceiver())
    env.update(otel_env(receiver))
    announce(f"tracing: every process exports its spans to {receiver.endpoint}")
    return receiver


def _start_tab(
    opts: Options, run: Run, env: dict[str, str], llm: StandIn, llm_key: str, log_dir: Path,
    procs: list[Proc], stack: contextlib.ExitStack,
) -> BrowserTab | None:  # fmt: skip
    """With ``--browser``: start an ``onceflow api`` with this run's keys (appended to
    ``procs``) and the tab's thread (Chromium starts; the page loads once the api is up)."""
    if not opts.browser:
        return None
    from onceflow.demo.browser import BrowserTab, TabKeys, start_api, tab_config
    from onceflow.demo.stages import TAB_CLASS

    keys = TabKeys()
    api_env = named({**env, **keys.env(run.workspace, TAB_CLASS)}, "onceflow-api")
    api, api_url = start_api(APP, log_dir, api_env)
    procs.append(api)
    config = tab_config(
        api_url=api_url, keys=keys, workspace=run.workspace, worker_class=TAB_CLASS,
        llm_url=llm.url, llm_key=llm_key, jobs=[f"job-{j}" for j in range(opts.jobs)],
        columns=COLUMNS[: opts.columns],
    )  # fmt: skip
    tab = BrowserTab(api_url, config, log_dir, timeout=opts.timeout)
    tab.keys = keys  # to check the logs for them at the end
    tab.start()  # Chromium starts, then waits for api_up to load the page

    @stack.callback  # before the api and the workers stop (callbacks run last-in first)
    def _stop_tab() -> None:
        if tab.is_alive():
            tab.stop()
            tab.join(timeout=30)

    return tab


def _tab_ready(tab: BrowserTab, api: Proc, announce: Any) -> None:
    """Wait for the api, let the tab load its page, and wait for the page to be ready."""
    api.wait_log("Application startup complete", timeout=60)
    tab.api_up.set()
    if not tab.ready.wait(timeout=90) or not tab.is_alive():
        raise RuntimeError(f"the browser tab did not start: {tab.outcome.error or 'timed out'}")
    announce(f"onceflow api at {tab.api_url}; a headless Chromium tab joins the clients")


def _join_tab(tab: BrowserTab, run: Run, opts: Options) -> None:
    """Wait for the tab to finish its work; count its enqueues, rows and cards."""
    tab.join(timeout=opts.timeout + 30)
    if tab.is_alive():
        tab.stop()
        tab.join(timeout=30)
    status = tab.outcome.status
    if tab.keys is not None:  # the api's and the page's logs so far: no key of the run
        from onceflow.demo.browser import keys_in

        logs = [tab.log_path.parent / "api.log", tab.log_path]
        tab.outcome.keys_logged = keys_in(logs, tab.keys)
    if tab.outcome.error is not None:  # what the tab left open would never finish: cancel it
        from onceflow.demo.stages import TAB_CLASS, flow

        for state in ("queued", "running"):
            for row in flow.queue.list(workspace_id=run.workspace, worker_class=TAB_CLASS,
                                       status=state, limit=1000):  # fmt: skip
                with contextlib.suppress(Exception):
                    flow.queue.cancel(row.request_id)
    with run.lock:
        run.tab = tab.outcome
        run.enqueued += int(status.get("enqueued", 0))
        run.created += int(status.get("created", 0))
        run.cards.update(status.get("cards", []))


def _hold_open(announce: Any, flower_url: str | None) -> None:
    """Keep every process running until Ctrl-C or SIGTERM (then the caller cleans up)."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    on_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if on_main:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        what = f"Flower at {flower_url}" if flower_url else "the workers and beat"
        announce(f"keeping {what} open; press Ctrl-C to stop and clean up")
        while not stop.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    announce("stopping and cleaning up")


def namespace_patterns(run: Run) -> list[str]:
    """Redis SCAN patterns of every key this run may create: broker keys, workspace keys."""
    from onceflow.demo.stages import broker_prefix
    from onceflow.keys import PREFIX, escape

    def glob_escape(text: str) -> str:
        return "".join("\\" + c if c in "*?[]\\" else c for c in text)

    prefixes = [broker_prefix(run.run_id), f"{PREFIX}:{{{escape(run.workspace)}}}:"]
    return [glob_escape(p) + "*" for p in prefixes]


def remove_namespace(redis_url: str, run: Run) -> int:
    """Delete every key of this run's namespaces (and nothing else); returns how many."""
    from onceflow.keys import counters_workspaces_key
    from onceflow.redis_clients import require_one_server, sync_client

    # The demo's Redis is also its Celery broker: one server (services() refused a cluster).
    client = sync_client(require_one_server(redis_url, "the demo's Redis (also its broker)"))
    removed = 0
    try:
        for pattern in namespace_patterns(run):
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    removed += int(client.delete(*batch))
                    batch = []
            if batch:
                removed += int(client.delete(*batch))
        # The run's workspace in the set of workspaces with counters (the dashboard's list).
        client.srem(counters_workspaces_key(), run.workspace)
    finally:
        client.close()
    return removed


def _start_flower(log_dir: Path, env: dict[str, str], announce: Any) -> tuple[Proc, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = secrets.token_urlsafe(12)
    flower_env = {**env, "ONCEFLOW_FLOWER_BASIC_AUTH": f"demo:{password}",
                  "ONCEFLOW_FLOWER_PORT": str(port)}  # fmt: skip
    conf = log_dir / "flower.cfg"
    conf.write_text(
        "import os\naddress = '127.0.0.1'\nport = int(os.environ['ONCEFLOW_FLOWER_PORT'])\n"
        "basic_auth = [os.environ['ONCEFLOW_FLOWER_BASIC_AUTH']]\n"
    )
    proc = Proc(["flower", "--app", APP, "--conf", str(conf)], log_dir / "flower.log",
                env=flower_env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    announce(f"Flower: {url}  user demo, password {password}")
    return proc, url


def _counts(queue: Any) -> tuple[int, int]:
    counts = queue.counts()
    in_flight = sum(c["queued"] + c["running"] for c in counts.values())
    done = sum(c["succeeded"] + c["dead"] + c["cancelled"] for c in counts.values())
    return in_flight, done


def _sample(run: Run, llm: StandIn, bar: ProgressBar, stop: threading.Event) -> None:
    """Record (seconds, requests finished, LLM calls) every 0.2 s, for the plot and the bar."""
    from onceflow.demo.stages import flow

    while not stop.wait(0.2):
        try:
            in_flight, done = _counts(flow.queue)
        except Exception:  # noqa: S112 - sampling is best effort; the run goes on
            continue
        stats = llm.stats()
        eval_calls = sum(n for k, n in stats["per_key"].items() if "/eval:" in k)
        run.progress.append((run.elapsed(), done, eval_calls))
        bar.update(done, done + in_flight, f"LLM calls {stats['total']}")


def _wait_drained(opts: Options, run: Run) -> None:
    """Wait until no request is queued or running."""
    from onceflow.demo.stages import flow

    def drained() -> bool:
        queued, done = _counts(flow.queue)
        return queued == 0 and done > 0

    wait_for(drained, timeout=opts.timeout, interval=0.2, what="every request finished")
