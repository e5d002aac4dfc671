"""Spend control inside stages: ``ctx.permit`` under every Python runner, the ledger hooks
each process installs by itself, the stage's ``on_budget``, and a permit's wait under a
lease.

The stages (``spend_stage_flow.py``) call a stand-in LLM server that counts requests. The
same stage runs under a real Celery worker process, the standalone
:class:`~onceflow.worker.Worker` and :func:`onceflow.testing.run_until_idle`; no test wires
hooks: every process records to the ledger because it runs stages
(``ONCEFLOW_SPEND_LEDGER``, on by default).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.context import StageContext
from onceflow.errors import Cancelled, InvalidRequest, LeaseLost
from onceflow.models import Request
from onceflow.queue import Failure
from onceflow.spend import Usage, set_budget
from onceflow.spend.registry import UnknownProvider
from onceflow.tasks import Flow
from onceflow.testing import run_until_idle
from onceflow.worker import Worker
from tests.acceptance.procs import started_together, wait_for, worker_args
from tests.integration import spend_stage_flow as stages
from tests.integration.spend_parts import fresh
from tests.integration.spend_standin import LimitedProvider

APP = "tests.integration.spend_stage_flow:flow"
#: Longer than a day: a budget wait is due at the next period's start, not cut to 600 s.
BACKOFF_MAX = 2 * 86_400
ENV = {"ONCEFLOW_BACKOFF_MAX_SECONDS": str(BACKOFF_MAX)}


@pytest.fixture(scope="module")
def settings_env(database_url: str, redis_url: str) -> Iterator[None]:
    """The module's settings in this process too (the Worker and run_until_idle read them)."""
    from onceflow.settings import get_settings

    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    get_settings.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()


@pytest.fixture(scope="module")
def llm() -> Iterator[LimitedProvider]:
    """The stand-in LLM provider: counts every request it answers."""
    server = LimitedProvider(limit=10_000, window=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def celery_worker(
    tmp_path_factory: pytest.TempPathFactory, settings_env: None, redis_url: str
) -> Iterator[None]:
    """A real Celery worker (prefork, one child) serving the stages' Celery class."""
    tmp = tmp_path_factory.mktemp("spend-stage")
    args = worker_args(stages.CELERY, app=APP, name="spend-stage")
    with started_together(tmp, ("worker.log", args, " ready."), env=ENV):
        yield


def _ws() -> str:
    return f"ws-{uuid.uuid4().hex[:10]}"


def _finished(rid: str, done: Callable[[Request], bool]) -> Callable[[], Request | None]:
    def check() -> Request | None:
        row = stages.flow.queue.get(rid)
        return row if row.lease_expires_at is None and done(row) else None

    return check


def _over(row: Request) -> bool:
    """Run and recorded: succeeded, dead, or queued again after a failure."""
    return row.status.value in ("succeeded", "dead") or (
        row.status.value == "queued" and row.error is not None
    )


def _run_celery(stage: str, ws: str, url: str, n: int) -> list[Request]:
    made = [_enqueue(stage, ws, url, stages.CELERY, i) for i in range(n)]
    return [_settled(rid) for rid in made]


def _run_worker(stage: str, ws: str, url: str, n: int) -> list[Request]:
    made = [_enqueue(stage, ws, url, stages.WORKER, i) for i in range(n)]
    spec = stages.flow.spec(stage)

    def handler(ctx: StageContext) -> Any:
        return spec.func(ctx, spec.input_model.model_validate(ctx.input))

    with Worker(None, stages.WORKER, handler, concurrency=1, sweep=False, max_wait=0.5,
                on_budget=spec.on_budget):  # fmt: skip
        return [_settled(rid) for rid in made]


def _run_inline(stage: str, ws: str, url: str, n: int) -> list[Request]:
    made = [_enqueue(stage, ws, url, stages.INLINE, i) for i in range(n)]
    run_until_idle(stages.flow, workspace_id=ws, worker_classes=[stages.INLINE])
    return [_settled(rid) for rid in made]


def _enqueue(stage: str, ws: str, url: str, worker_class: str, i: int) -> str:
    made = stages.flow.enqueue(stage, ws, f"job-{i}", "main", {"url": url},
                               worker_class=worker_class)  # fmt: skip
    return str(made.request_id)


def _settled(rid: str) -> Request:
    row = wait_for(_finished(rid, _over), timeout=60, what=f"request {rid}")
    assert row is not None
    return row


RUNNERS = {"celery": _run_celery, "worker": _run_worker, "testing": _run_inline}


def _ledger(engine: Engine, ws: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT stage, request_id, cell_key, provider, input_tokens, output_tokens,"
                " cost, outcome, fenced FROM spend_ledger WHERE workspace_id = :ws"
                " ORDER BY recorded_at"
            ),
            {"ws": ws},
        )
        return [dict(r._mapping) for r in rows]


@pytest.fixture()
def runner(
    request: pytest.FixtureRequest, clean_db: Engine, settings_env: None
) -> Callable[[str, str, str, int], list[Request]]:
    if request.param == "celery":
        request.getfixturevalue("celery_worker")
    stages.LLM.reset()
    run: Callable[[str, str, str, int], list[Request]] = RUNNERS[request.param]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_a_stages_call_is_a_ledger_row_of_its_run(
    runner: Callable[[str, str, str, int], list[Request]],
    llm: LimitedProvider,
    clean_db: Engine,
) -> None:
    ws = _ws()
    before = len(llm.seen)
    (row,) = runner("ask", ws, llm.url, 1)
    assert row.status.value == "succeeded" and row.result == {"text": "ok"}
    assert len(llm.seen) - before == 1  # one call to the provider
    (entry,) = _ledger(clean_db, ws)
    assert entry["stage"] == "ask" and entry["request_id"] == row.request_id
    assert entry["cell_key"] == f"cell:{row.request_id}"
    assert (entry["provider"], entry["outcome"]) == ("stage-llm", "ok")
    assert (entry["input_tokens"], entry["output_tokens"]) == (12, 8)
    assert entry["cost"] == stages.LLM.price.cost(stages.USAGE)  # type: ignore[union-attr]
    assert entry["fenced"] is True  # written in the statement that checked the claim's fence


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_a_result_cache_hit_in_a_stage_is_a_ledger_row_of_its_run(
    runner: Callable[[str, str, str, int], list[Request]],
    llm: LimitedProvider,
    clean_db: Engine,
) -> None:
    """``ctx.compute_once(…, cache=…)``: one run pays, the other is served from the entry;
    the ``cache_hit`` row names the stage and the request it was served to."""
    ws = _ws()
    rows = runner("ask_cached", ws, llm.url, 2)
    assert [r.status.value for r in rows] == ["succeeded", "succeeded"]
    served = [r for r in rows if r.result["path"] != "computed"]
    assert len(served) == 1
    ledger = _ledger(clean_db, ws)
    assert sorted(row["outcome"] for row in ledger) == ["cache_hit", "ok"]
    (hit,) = [row for row in ledger if row["outcome"] == "cache_hit"]
    assert (hit["stage"], hit["request_id"]) == ("ask_cached", served[0].request_id)
    assert hit["cell_key"] == f"job-{rows.index(served[0])}/answer"


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_the_call_past_a_budget_fails_the_stage_that_says_fail(
    runner: Callable[[str, str, str, int], list[Request]],
    llm: LimitedProvider,
    clean_db: Engine,
) -> None:
    ws = _ws()
    # Two calls' worth; the budget itself says wait: the stage's "fail" wins.
    set_budget(ws, "day", limit_tokens=2 * stages.ESTIMATE, on_exceeded="wait", allow_new=True)
    before = len(llm.seen)
    rows = runner("ask_fail", ws, llm.url, 3)
    assert sorted(r.status.value for r in rows) == ["dead", "succeeded", "succeeded"]
    (dead,) = [r for r in rows if r.status.value == "dead"]
    assert dead.error is not None and dead.error["type"] == "BudgetExceeded"
    assert dead.attempts == 1
    assert len(llm.seen) - before == 2  # the refused call never reached the provider
    assert [e["outcome"] for e in _ledger(clean_db, ws)] == ["ok", "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_the_call_past_a_budget_waits_for_the_next_period_without_using_an_attempt(
    runner: Callable[[str, str, str, int], list[Request]],
    llm: LimitedProvider,
    clean_db: Engine,
) -> None:
    ws = _ws()
    # The budget itself says fail: the stage's "wait" wins.
    set_budget(ws, "day", limit_tokens=2 * stages.ESTIMATE, allow_new=True)
    before = len(llm.seen)
    rows = runner("ask_wait", ws, llm.url, 3)
    assert sorted(r.status.value for r in rows) == ["queued", "succeeded", "succeeded"]
    (waiting,) = [r for r in rows if r.status.value == "queued"]
    assert waiting.error is not None and waiting.error["type"] == "BudgetExceeded"
    # max_attempts is 1: the wait gave its attempt back, so the request is not dead.
    assert (waiting.attempts, waiting.crash_attempts) == (0, 0)
    with clean_db.connect() as conn:
        next_day = conn.execute(
            text(
                "SELECT (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day')"
                " AT TIME ZONE 'UTC'"
            )
        ).scalar_one()
    # Due when the period turns, by the database clock (the admit's reading of it plus
    # the moments between the refusal and the failure's statement).
    assert next_day <= waiting.run_after <= next_day + timedelta(seconds=10)
    assert len(llm.seen) - before == 2


@pytest.mark.slow
def test_a_budget_wait_runs_again_once_there_is_room(
    llm: LimitedProvider, clean_db: Engine, settings_env: None
) -> None:
    ws = _ws()
    set_budget(ws, "day", limit_tokens=stages.ESTIMATE, allow_new=True)
    rows = _run_inline("ask_wait", ws, llm.url, 2)
    assert sorted(r.status.value for r in rows) == ["queued", "succeeded"]
    set_budget(ws, "day", limit_tokens=10 * stages.ESTIMATE)
    # The clock moved to the retry's due time: the waiting request runs its one attempt.
    report = run_until_idle(
        stages.flow, workspace_id=ws, worker_classes=[stages.INLINE], include_delayed=True
    )
    assert report.outcomes() == {"succeeded": 1}
    (again,) = [stages.flow.queue.get(r.request_id) for r in rows if r.status.value == "queued"]
    assert (again.status.value, again.attempts) == ("succeeded", 1)


# ---------------------------------------------------------------- a permit's wait under a lease


def _context(lease: float) -> tuple[StageContext, Request]:
    """A claim of an ``ask`` request, run by no runner: only the permit keeps its lease."""
    made = stages.flow.enqueue("ask", _ws(), "job", "main", {"url": "http://127.0.0.1:9"},
                               worker_class=stages.INLINE)  # fmt: skip
    claim = stages.flow.queue.claim(str(made.request_id), "w-spend-stage", lease_seconds=lease)
    assert claim is not None
    return StageContext(stages.flow.queue, claim, "w-spend-stage"), claim.request


@pytest.mark.slow
def test_a_permit_held_by_another_process_past_the_lease_keeps_the_stage_claimed(
    redis_url: str, clean_db: Engine, settings_env: None
) -> None:
    provider = fresh(redis_url, concurrency=1)
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.spend_callers", redis_url, provider.name,
         "1", "4.0"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip()  # it holds the only slot for 4 s
    finally:
        holder.kill()  # its permit stays held until its TTL
        holder.wait(timeout=10)
    ctx, request = _context(lease=1.5)
    queue = stages.flow.queue
    rescued: list[str] = []
    stop = threading.Event()

    def sweeper() -> None:  # what any sweeper would do meanwhile
        while not stop.is_set():
            rescued.extend(r.request_id for r in queue.rescue_expired().rescued)
            stop.wait(0.2)

    sweeping = threading.Thread(target=sweeper)
    sweeping.start()
    started = time.monotonic()
    try:
        with ctx.permit(provider, tokens=5, timeout=30) as permit:
            waited = time.monotonic() - started
            permit.settle(Usage(3, 2))
    finally:
        stop.set()
        sweeping.join(timeout=10)
    assert waited >= 2 * 1.5  # the wait outlived the lease twice over
    assert rescued == []
    row = queue.get(request.request_id)
    assert (row.status.value, row.attempts, row.crash_attempts) == ("running", 1, 0)
    assert row.lease_expires_at is not None and row.heartbeat_at is not None
    assert row.heartbeat_at > row.claimed_at + timedelta(seconds=1.5)
    ctx.heartbeat()  # the lease is still this claim's


@pytest.mark.slow
def test_a_lost_lease_or_a_cancel_stops_the_permits_wait(
    redis_url: str, clean_db: Engine, settings_env: None
) -> None:
    provider = fresh(redis_url, concurrency=1)
    with provider.permit("another", timeout=5):  # the only slot, taken for the whole test
        ctx, _ = _context(lease=30.0)
        threading.Timer(0.3, ctx.mark_lease_lost).start()  # as the runner's heartbeat does
        started = time.monotonic()
        with pytest.raises(LeaseLost), ctx.permit(provider, tokens=5, timeout=20):
            pytest.fail("granted while the slot is held")
        assert time.monotonic() - started < 5

        ctx, request = _context(lease=1.5)  # heartbeats every 0.5 s learn of the cancel
        threading.Timer(0.3, stages.flow.queue.cancel, [request.request_id]).start()
        started = time.monotonic()
        with pytest.raises(Cancelled), ctx.permit(provider, tokens=5, timeout=20):
            pytest.fail("granted while the slot is held")
        assert time.monotonic() - started < 5
        assert provider.stats()["in_flight"] == 1  # the stopped waits hold nothing
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM spend_reservations")).scalar_one() == 0


def test_ctx_permit_refuses_what_is_not_a_declared_provider(
    clean_db: Engine, settings_env: None
) -> None:
    ctx, _ = _context(lease=30.0)
    with pytest.raises(UnknownProvider, match="no-such-provider"):
        ctx.permit("no-such-provider")
    with pytest.raises(InvalidRequest, match="provider must be"):
        ctx.permit(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="tokens"):
        ctx.permit(stages.LLM, tokens=-1)


def test_on_budget_is_fail_wait_or_none(redis_url: str) -> None:
    flow = Flow(name="spend-stage-check")
    with pytest.raises(InvalidRequest, match="on_budget"):
        flow.stage("s", input=stages.Ask, on_budget="later")  # type: ignore[arg-type]
    assert "s" not in flow.stages
    with pytest.raises(InvalidRequest, match="on_budget"):
        Worker(None, "wc", lambda ctx: None, on_budget="never")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the failure statements


def test_a_failure_that_gives_its_attempt_back_is_queued_even_at_max_attempts(
    clean_db: Engine, settings_env: None
) -> None:
    queue = stages.flow.queue
    made = stages.flow.enqueue("ask_fail", _ws(), "job", "main", {"url": "http://x"},
                               worker_class=stages.INLINE)  # fmt: skip
    rid = str(made.request_id)
    error = {"type": "BudgetExceeded"}
    claim = queue.claim(rid, "w")
    assert claim is not None and claim.attempt == 1
    row = queue.fail(claim, error, retry_in=0, count_attempt=False)
    assert (row.status.value, row.attempts) == ("queued", 0)
    claim = queue.claim(rid, "w")
    assert claim is not None and claim.attempt == 1
    (row,) = queue.fail_many([Failure(claim, error, True, 0.0, False)])
    assert isinstance(row, Request) and (row.status.value, row.attempts) == ("queued", 0)
    claim = queue.claim(rid, "w")
    assert claim is not None
    with pytest.raises(InvalidRequest, match="count_attempt"):
        queue.fail(claim, error, count_attempt="no")  # type: ignore[arg-type]
    row = queue.fail(claim, error, retry_in=0)  # counted: its one attempt is used
    assert (row.status.value, row.attempts) == ("dead", 1)


def test_a_worker_process_records_to_the_ledger_unless_told_not_to(
    clean_db: Engine, settings_env: None
) -> None:
    from onceflow.settings import Settings
    from onceflow.spend.defaults import ProcessLedger, install_ledger
    from onceflow.spend.hooks import NO_HOOKS
    from onceflow.spend.registry import default_hooks, use_hooks

    stages.flow.queue  # noqa: B018 - a process that runs stages builds its queue
    assert isinstance(default_hooks(), ProcessLedger)
    assert isinstance(stages.LLM.hooks, ProcessLedger)
    assert stages.LLM.hooks.hooks() is stages.LLM.hooks.hooks()  # one per process
    installed = default_hooks()
    try:
        use_hooks(NO_HOOKS)
        assert not install_ledger(Settings(spend_ledger=False))
        assert default_hooks() is NO_HOOKS
        assert install_ledger(Settings())
        use_hooks(NO_HOOKS)
        # A standalone worker's ledger writes over the worker's own engines.
        worker = Worker(None, "sp-nothing", lambda ctx: None, concurrency=1, sweep=False)
        try:
            hooks = default_hooks()
            assert isinstance(hooks, ProcessLedger) and hooks.databases is not None
            assert hooks.databases().engines == (worker.queue.engine,)
        finally:
            worker.queue.engine.dispose()
    finally:
        use_hooks(installed)
