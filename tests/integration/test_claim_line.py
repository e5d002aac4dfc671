"""Long-poll claims of one worker class in one API process: a claimable row wakes one waiter.

The app runs in this test's event loop (httpx's ASGI transport, the app's own lifespan) on
the real database and its LISTEN/NOTIFY. The claim statements the server sends are counted
at the service layer (the async queue's ``claim_next``): with N waiters asleep, one enqueue
must cost one claim, not N (every waiter woken by the notify, each claiming).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.integrations.fastapi.services import OnceflowServices
from onceflow.models import Claim, WorkspaceScope
from onceflow.queue import AsyncQueue
from onceflow.queue.claim_line import ClaimLines
from onceflow.settings import Settings, get_settings
from onceflow.tasks import Flow, StageContext

WORKER_KEY = "of_test_claim_line_worker_0123456789abcd"
PULL = "t-line-pull"  # a pull-worker class: no Celery wake-up to send
WAITERS = 40
ClaimNow = Callable[[], Awaitable[list[Claim]]]
# How long a condition may take before the test gives up: a deadline, not a speed bound.
DEADLINE = 30.0


class In(BaseModel):
    value: int = 0


def _settings() -> Settings:
    return get_settings().model_copy(update={"api_rate_limit": "", "notify": True})


@pytest.fixture()
def flow(clean_db: Engine) -> Flow:
    flow = Flow(settings=_settings(), pull_worker_classes=(PULL,))

    @flow.stage("line-noop", input=In, worker_class=PULL)
    def noop(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": data.value}

    return flow


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not check():
        assert loop.time() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


class ClaimSpy:
    """Counts the claim statements the server's async queue sends (and empty answers)."""

    def __init__(self, queue: AsyncQueue) -> None:
        self.sent = 0
        self.empty = 0
        real = queue.claim_next

        async def claim_next(*args: Any, **kwargs: Any) -> list[Claim]:
            self.sent += 1
            claims: list[Claim] = await real(*args, **kwargs)
            if not claims:
                self.empty += 1
            return claims

        queue.claim_next = claim_next  # type: ignore[method-assign]


def enqueue(flow: Flow, jobs: list[str]) -> None:
    """Enqueue one request per job in ONE transaction (one NOTIFY for them all)."""
    items = [flow.new_request("line-noop", "w1", job, "", {"value": 1}) for job in jobs]
    results = flow.queue.enqueue_many(items)
    assert all(r.created for r in results)


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT job_id, status FROM workspace_process_requests"))
        return {r[0]: r[1] for r in rows}


def test_an_enqueue_wakes_one_of_many_long_poll_claimers(flow: Flow, clean_db: Engine) -> None:
    """N waiters asleep: one enqueue → one claim statement; K enqueues (one at a time, then
    K in one transaction: one NOTIFY) → K claims, each row claimed, the rest still asleep."""
    app = create_app(flow, auth=KeyAuth(worker_keys={hash_key(WORKER_KEY): [PULL]}),
                     settings=flow.settings)  # fmt: skip
    headers = {"Authorization": f"Bearer {WORKER_KEY}"}

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=transport, base_url="http://t", headers=headers, timeout=120
            ) as http,
        ):
            svc: OnceflowServices = app.state.onceflow
            spy = ClaimSpy(svc.async_queue)

            async def long_poll(n: int) -> httpx.Response:
                body = {"worker_id": f"tab-{n}", "wait": 60}
                return await http.post(f"/v1/worker-classes/{PULL}/claims", json=body)

            line = await svc.claim_lines().line(PULL)
            polls = [asyncio.create_task(long_poll(n)) for n in range(WAITERS)]
            # Every waiter is asleep in the line (its first claim found nothing, or the line
            # knew there was nothing to claim).
            await until(lambda: len(line.sleeping) == WAITERS and not line.busy, "the waiters")
            got: list[httpx.Response] = []

            async def answers(count: int) -> None:
                await until(lambda: sum(p.done() for p in polls) >= count, f"{count} claims")
                got[:] = [p.result() for p in polls if p.done()]

            sent = spy.sent
            await asyncio.to_thread(enqueue, flow, ["one"])
            await answers(1)
            assert [r.status_code for r in got] == [201]
            assert got[0].json()["request"]["job_id"] == "one"
            await quiet(svc)
            assert spy.sent - sent == 1, f"{spy.sent - sent} claim statements for one row"

            # A new long poll on a line that knows nothing is claimable sends no claim.
            sent_before = spy.sent
            polls.append(asyncio.create_task(long_poll(WAITERS)))
            await until(lambda: len(line.sleeping) == WAITERS and not line.busy, "the new one")
            assert spy.sent == sent_before
            sent = spy.sent

            # K rows, each in its own transaction, then K in one transaction.
            for job in ("a", "b", "c"):
                await asyncio.to_thread(enqueue, flow, [job])
            await answers(4)
            await asyncio.to_thread(enqueue, flow, ["d", "e", "f", "g", "h"])
            await answers(9)
            await quiet(svc)
            jobs = sorted(r.json()["request"]["job_id"] for r in got)
            assert jobs == ["a", "b", "c", "d", "e", "f", "g", "h", "one"]
            assert all(r.status_code == 201 for r in got)
            assert set(statuses(clean_db).values()) == {"running"}
            # One claim per row: no waiter was woken for nothing.
            assert spy.sent - sent == 8, f"{spy.sent - sent} claim statements for 8 rows"
            assert len(line.sleeping) == WAITERS + 1 - 9 and not line.flying
            for p in polls:
                p.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    asyncio.run(scenario())


async def quiet(svc: OnceflowServices) -> None:
    """The line has nobody in flight and nothing left to look at."""
    line = await svc.claim_lines().line(PULL)
    await until(lambda: not line.flying, "the woken waiters to land")
    # A round may still follow up (it claims nothing); wait for the line to settle.
    await until(lambda: not line.busy, "the line's last look")


def test_a_woken_waiter_that_leaves_hands_the_row_to_the_next(flow: Flow, clean_db: Engine) -> None:
    """The only waiter woken for a row goes away before it claims (its client left): the
    next waiter in line is woken at once and claims the row — no poll interval."""

    async def scenario() -> None:
        queue = AsyncQueue.from_queue(flow.queue)
        lines = ClaimLines(queue)
        try:
            line = await lines.line(PULL)
            stuck = asyncio.Event()
            calls = itertools.count()

            def claimer(name: str, *, hang_when_woken: bool) -> ClaimNow:
                async def claim_now() -> list[Claim]:
                    if hang_when_woken and next(calls) > 0:
                        stuck.set()
                        await asyncio.Event().wait()  # until cancelled
                    return await queue.claim_next(PULL, name, 1)

                return claim_now

            never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            first = asyncio.create_task(
                line.claim(claimer("first", hang_when_woken=True), 60, None, never)
            )
            await until(lambda: len(line.sleeping) == 1, "the first waiter to sleep")
            second = asyncio.create_task(
                line.claim(claimer("second", hang_when_woken=False), 60, None, never)
            )
            await until(lambda: len(line.sleeping) == 2, "the second waiter to sleep")

            await asyncio.to_thread(enqueue, flow, ["left"])
            await until(stuck.is_set, "the head of the line to be woken")
            assert len(line.sleeping) == 1  # the second still asleep: one woken per row
            first.cancel()  # its client went away before it claimed
            claims = await asyncio.wait_for(second, DEADLINE)
            assert [c.request.job_id for c in claims] == ["left"]
            assert claims[0].request.claimed_by == "second"
            assert first.cancelled()
            never.cancel()
        finally:
            await lines.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def test_a_row_wakes_only_a_waiter_that_may_claim_it(flow: Flow, clean_db: Engine) -> None:
    """Waiters scoped to other workspaces stay asleep; the first one that may claim the
    row's workspace is woken and claims it, wherever it stands in the line."""

    async def scenario() -> None:
        queue = AsyncQueue.from_queue(flow.queue)
        lines = ClaimLines(queue)
        try:
            line = await lines.line(PULL)
            never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            sent: list[str] = []

            def claimer(name: str, scope: WorkspaceScope) -> ClaimNow:
                async def claim_now() -> list[Claim]:
                    sent.append(name)
                    return await queue.claim_next(PULL, name, 1, workspaces=scope)

                return claim_now

            tasks = []
            for n, ws in enumerate(["w2", "w3", "w1", "w1"]):
                scope = WorkspaceScope(exact=frozenset({ws}))
                tasks.append(
                    asyncio.create_task(line.claim(claimer(f"{ws}-{n}", scope), 60, scope, never))
                )
                await until(lambda n=n: len(line.sleeping) == n + 1, f"waiter {n} to sleep")
            sent.clear()
            await asyncio.to_thread(enqueue, flow, ["scoped"])
            claims = await asyncio.wait_for(tasks[2], DEADLINE)
            assert [c.request.claimed_by for c in claims] == ["w1-2"]
            await until(lambda: not line.flying and not line.busy, "the line to settle")
            assert sent == ["w1-2"]  # the w2 and w3 waiters ahead of it were not woken
            assert len(line.sleeping) == 3
            never.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await lines.aclose()
            await queue.aclose()

    asyncio.run(scenario())
