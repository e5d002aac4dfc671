"""The trampoline (onceflow.connector.trampoline) through every runner built on it.

Every generator of steps runs on the same loop: the queue's and the op log's operations
(``onceflow.connector.run`` / ``arun``), the compute-lock protocol (``onceflow.locks.steps``)
and the op-log client's rules (``WorkspaceClient`` / ``AsyncWorkspaceClient``). Each test
drives one generator through each runner, sync and async: a step's exception reaches the
generator at its ``yield`` (where a direct call would raise it), a ``finally`` still runs
its steps, a step's own ``StopIteration`` leaves as itself (PEP 479), and a cancellation a
step swallowed is thrown in after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from onceflow.connector import arun, run
from onceflow.connector.trampoline import Call, Sleep, ado_step, adrive, do_step, drive
from onceflow.errors import InvalidRequest
from onceflow.locks.steps import Steps, run_async, run_sync
from onceflow.models.ops import CellSet
from onceflow.oplog import AsyncWorkspaceClient, WorkspaceClient
from onceflow.oplog.records import ApplyResult

OP = CellSet(column="c1", value=1)
NO_CONNECTOR = cast(Any, None)  # Call and Sleep steps never reach the connector

SYNC_RUNNERS: dict[str, Callable[[Steps[Any]], Any]] = {
    "drive": lambda steps: drive(steps, do_step),
    "connector.run": lambda steps: run(NO_CONNECTOR, steps),
    "locks.run_sync": run_sync,
}
ASYNC_RUNNERS: dict[str, Callable[[Steps[Any]], Awaitable[Any]]] = {
    "adrive": lambda steps: adrive(steps, ado_step),
    "adrive off the loop": lambda steps: adrive(steps, ado_step, off_loop=threading.Lock()),
    "connector.arun": lambda steps: arun(NO_CONNECTOR, steps),
    "locks.run_async": run_async,
}
sync_runners = pytest.mark.parametrize("runner", SYNC_RUNNERS.values(), ids=SYNC_RUNNERS.keys())
async_runners = pytest.mark.parametrize("runner", ASYNC_RUNNERS.values(), ids=ASYNC_RUNNERS.keys())


def outcome(call: Callable[[], Any]) -> Any:
    """What ``call()`` returned, or the exception it raised."""
    try:
        return call()
    except BaseException as exc:
        return exc


# ------------------------------------------------------------------ answers and errors


def protocol(log: list[str], fail: Callable[[], None]) -> Steps[int]:
    a = yield Call(lambda: 20)
    b = yield Call(lambda x, *, times: x * times, a, times=2)
    yield Sleep(0)
    try:
        yield Call(fail)
    except KeyError:
        log.append("caught at the yield")
    try:
        yield Call(fail)
    finally:
        yield Call(log.append, "finally step ran")
    return a + b  # never reached


def raise_key_error() -> None:
    raise KeyError("boom")


@sync_runners
def test_a_steps_error_reaches_the_yield_and_finally_steps_run_sync(runner: Any) -> None:
    log: list[str] = []
    assert type(outcome(lambda: runner(protocol(log, raise_key_error)))) is KeyError
    assert log == ["caught at the yield", "finally step ran"]


@async_runners
def test_a_steps_error_reaches_the_yield_and_finally_steps_run_async(runner: Any) -> None:
    log: list[str] = []

    async def fail() -> None:
        raise KeyError("boom")

    got = outcome(lambda: asyncio.run(runner(protocol(log, cast(Any, fail)))))
    assert type(got) is KeyError
    assert log == ["caught at the yield", "finally step ran"]


@sync_runners
def test_any_exception_is_thrown_in_sync(runner: Any) -> None:
    """A ``KeyboardInterrupt`` in a step still lets the ``finally`` run its steps."""
    log: list[str] = []

    def interrupted() -> None:
        raise KeyboardInterrupt

    def steps() -> Steps[None]:
        try:
            yield Call(interrupted)
        finally:
            yield Call(log.append, "released")

    assert type(outcome(lambda: runner(steps()))) is KeyboardInterrupt
    assert log == ["released"]


# ------------------------------------------------------------------ PEP 479


def stop() -> None:
    raise StopIteration("mine")


def uncaught() -> Steps[None]:
    yield Call(stop)


def caught() -> Steps[str]:
    try:
        yield Call(stop)
    except StopIteration as exc:
        return f"caught {exc.args[0]}"
    return "not reached"


@sync_runners
def test_a_steps_own_stop_iteration_leaves_as_itself_sync(runner: Any) -> None:
    got = outcome(lambda: runner(uncaught()))
    assert type(got) is StopIteration and got.args == ("mine",)
    assert got.__cause__ is None
    assert runner(caught()) == "caught mine"


@async_runners
def test_a_steps_own_stop_iteration_leaves_as_itself_async(runner: Any) -> None:
    got = outcome(lambda: asyncio.run(runner(uncaught())))
    # Out of a coroutine, as out of any ``async def`` that called it, it is a RuntimeError
    # (PEP 479) caused by the step's own StopIteration, never "generator raised StopIteration".
    assert type(got) is RuntimeError
    assert type(got.__cause__) is StopIteration and got.__cause__.args == ("mine",)
    assert asyncio.run(runner(caught())) == "caught mine"


def test_a_stop_iteration_raised_in_a_worker_thread_is_thrown_in_as_itself() -> None:
    """(A future refuses a StopIteration: carried as itself, it cannot hang the run.)"""

    def steps() -> Steps[str]:
        try:
            yield Call.in_thread(stop)
        except StopIteration as exc:
            return f"caught {exc.args[0]}"
        return "not reached"

    async def main() -> str:
        async with asyncio.timeout(10):  # a failure, not a hung suite
            return await adrive(steps(), ado_step)

    assert asyncio.run(main()) == "caught mine"


def test_a_stop_iteration_that_was_not_thrown_in_stays_a_runtime_error() -> None:
    """A generator's own bug (``next()`` on an exhausted iterator) is not a step's error."""

    def buggy() -> Steps[None]:
        yield Sleep(0)
        next(iter(()))

    got = outcome(lambda: drive(buggy(), do_step))
    assert type(got) is RuntimeError and type(got.__cause__) is StopIteration


# ------------------------------------------------------------------ cancellation


async def forever() -> None:
    await asyncio.Event().wait()


@async_runners
def test_a_cancellation_still_runs_the_finally_steps(runner: Any) -> None:
    log: list[str] = []
    started = asyncio.Event()

    async def waiting() -> None:
        started.set()
        await forever()

    def steps() -> Steps[None]:
        try:
            yield Call(waiting)
        finally:
            yield Call(asyncio.sleep, 0)  # an awaited step after the cancellation
            log.append("released")

    async def main() -> None:
        task = asyncio.create_task(runner(steps()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["released"]


@async_runners
def test_a_cancellation_a_step_swallowed_is_thrown_in_after_it(runner: Any) -> None:
    """redis-py 8.1 can swallow a task's cancellation mid-command and return the reply;
    the run must not go on (to acquire, to pay) as if nothing had been asked."""
    log: list[str] = []
    started = asyncio.Event()

    async def swallowing() -> str:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as a library might
            await asyncio.Event().wait()
        return "reply"

    def steps() -> Steps[None]:
        try:
            yield Call(swallowing)
            log.append("went on to the next step")
            yield Call(asyncio.sleep, 0)
        finally:
            yield Call(asyncio.sleep, 0)  # the release still runs, once
            log.append("released")

    async def main() -> None:
        task = asyncio.create_task(runner(steps()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["released"]


@async_runners
def test_a_timeout_around_a_swallowing_step_still_ends_as_a_timeout(runner: Any) -> None:
    async def swallowing() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    def steps() -> Steps[None]:
        yield Call(swallowing)
        yield Call(forever)  # never reached: would wait forever

    async def main() -> None:
        async with asyncio.timeout(0.05):
            await runner(steps())

    with pytest.raises(TimeoutError):
        asyncio.run(main())


def test_a_timeout_inside_a_step_is_not_taken_for_a_cancellation() -> None:
    """A step's own ``asyncio.timeout`` cancels and uncancels the task: the run goes on."""

    async def timing_out() -> str:
        try:
            async with asyncio.timeout(0.01):
                await forever()
        except TimeoutError:
            return "timed out"
        return "not reached"

    def steps() -> Steps[list[str]]:
        first = yield Call(timing_out)
        second = yield Call(timing_out)
        return [first, second]

    assert asyncio.run(adrive(steps(), ado_step)) == ["timed out", "timed out"]


# ------------------------------------------------------------------ Call


def test_a_call_runs_in_place_or_in_a_thread() -> None:
    def steps() -> Steps[tuple[int, int]]:
        here = yield Call(threading.get_ident)
        there = yield Call.in_thread(threading.get_ident)
        return here, there

    assert drive(steps(), do_step) == (threading.get_ident(),) * 2  # sync: always in place
    here, there = asyncio.run(adrive(steps(), ado_step))
    assert here == threading.get_ident() and there != threading.get_ident()


def test_a_sync_run_refuses_an_awaitable_answer_and_closes_it() -> None:
    async def compute() -> int:
        return 1

    def steps() -> Steps[Any]:
        return (yield Call(compute))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail here
        with pytest.raises(InvalidRequest, match="returned an awaitable") as refused:
            drive(steps(), do_step)
    assert isinstance(refused.value, TypeError)  # the wrong kind of function, too


def test_what_is_not_a_step_is_refused() -> None:
    def steps() -> Steps[Any]:
        yield cast(Any, "SELECT 1")

    with pytest.raises(TypeError, match="not a step"):
        drive(steps(), do_step)
    with pytest.raises(TypeError, match="not a step"):
        asyncio.run(adrive(steps(), ado_step))


# ------------------------------------------------------------------ the op-log client


class StopTransport:
    """A transport whose ``apply`` raises its own ``StopIteration``."""

    def apply(self, *args: Any) -> ApplyResult:
        raise StopIteration("transport")


class AsyncStopTransport:
    async def apply(self, *args: Any) -> ApplyResult:
        raise StopIteration("transport")


@contextlib.contextmanager
def clients(transport: Any, async_transport: Any) -> Iterator[tuple[Any, Any]]:
    sync = WorkspaceClient(transport, "ws_1")
    aio = AsyncWorkspaceClient(async_transport, "ws_1")
    try:
        yield sync, aio
    finally:
        sync.close()
        aio.close()


def test_the_op_log_clients_let_a_transports_stop_iteration_out_as_itself() -> None:
    with clients(StopTransport(), AsyncStopTransport()) as (sync, aio):
        got = outcome(lambda: sync.apply("doc", OP))
        assert type(got) is StopIteration and got.args == ("transport",)
        # The async client resumes its rules in a worker thread: a StopIteration cannot
        # cross that thread's future, yet it comes out as it would from any coroutine.
        got = outcome(lambda: asyncio.run(aio.apply("doc", OP)))
        assert type(got) is RuntimeError and type(got.__cause__) is StopIteration
        assert len(sync.pending()) == 1 and len(aio.outbox.pending()) == 1  # kept to resend


def test_the_async_op_log_client_does_not_ack_an_op_whose_send_was_cancelled() -> None:
    """A transport that swallowed the cancellation and answered: the cancelled caller
    gets its CancelledError, and the op stays pending (sent again with the same op id)."""
    started = asyncio.Event()

    class Swallowing:
        async def apply(self, ws: str, sub_doc: str, op: Any, op_id: str, *_: Any) -> ApplyResult:
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await forever()
            return ApplyResult(ws, sub_doc, op_id, 1, False, None, None, datetime.now(UTC))

    async def main(client: AsyncWorkspaceClient) -> None:
        task = asyncio.create_task(client.apply("doc", OP))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(await client.pending()) == 1

    with clients(StopTransport(), Swallowing()) as (_, aio):
        asyncio.run(main(aio))
