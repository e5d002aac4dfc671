"""The two drivers of the compute-lock protocol's steps (onceflow.locks.steps), side by side.

A step's exception must reach the protocol at its ``yield`` (where a direct call would
raise it), its ``finally`` must still run its steps, and what leaves the driver must be
what a direct call would have raised.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from onceflow.locks.steps import Call, Sleep, Steps, run_async, run_sync


def both(make: Callable[[], Steps[Any]]) -> list[Any]:
    """The result (or the exception) of ``make()`` under each driver."""
    out: list[Any] = []
    for run in (run_sync, lambda steps: asyncio.run(run_async(steps))):
        try:
            out.append(run(make()))
        except BaseException as exc:
            out.append(exc)
    return out


def test_results_errors_and_finally_steps_are_the_same_on_both_drivers() -> None:
    log: list[str] = []

    def twice(x: int) -> int:
        return 2 * x

    def fail() -> None:
        raise KeyError("boom")

    def protocol() -> Steps[int]:
        a = yield Call(lambda: 20)  # a plain callable
        b = yield Call(twice, a)
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

    sync, aio = both(protocol)
    assert type(sync) is KeyError and type(aio) is KeyError
    assert log == ["caught at the yield", "finally step ran"] * 2


def test_the_async_driver_awaits_what_a_step_returns_awaitable() -> None:
    async def twice(x: int) -> int:
        return 2 * x

    def protocol() -> Steps[int]:
        a = yield Call(lambda: 20)
        b = yield Call(twice, a)
        return a + b

    assert asyncio.run(run_async(protocol())) == 60


def test_a_callbacks_stop_iteration_leaves_as_itself() -> None:
    def stop() -> None:
        raise StopIteration("mine")

    def protocol() -> Steps[None]:
        yield Call(stop)

    sync, aio = both(protocol)
    assert type(sync) is StopIteration and sync.args == ("mine",)
    # Out of a coroutine, as out of any ``async def`` that called it, it is a RuntimeError.
    assert type(aio) is RuntimeError and type(aio.__cause__) is StopIteration


def test_cancellation_still_runs_the_finally_steps() -> None:
    log: list[str] = []

    async def forever() -> None:
        await asyncio.Event().wait()

    def protocol() -> Steps[None]:
        try:
            yield Call(forever)
        finally:
            yield Call(asyncio.sleep, 0)  # an awaited step after the cancellation
            log.append("released")

    async def main() -> None:
        task = asyncio.create_task(run_async(protocol()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["released"]


def test_a_cancellation_a_step_swallowed_is_thrown_in_after_it() -> None:
    """redis-py 8.1 can swallow a task's cancellation mid-command and return the reply;
    the protocol must not go on (to acquire, to pay) as if nothing had been asked."""
    log: list[str] = []
    started = asyncio.Event()

    async def swallowing() -> str:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as a library might
            await asyncio.Event().wait()
        return "reply"

    def protocol() -> Steps[None]:
        try:
            yield Call(swallowing)
            log.append("went on to the next step")
            yield Call(asyncio.sleep, 0)
        finally:
            yield Call(asyncio.sleep, 0)  # the release still runs, once
            log.append("released")

    async def main() -> None:
        task = asyncio.create_task(run_async(protocol()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["released"]


def test_a_timeout_around_the_call_still_ends_as_a_timeout() -> None:
    async def swallowing() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    def protocol() -> Steps[None]:
        yield Call(swallowing)
        yield Call(asyncio.Event().wait)  # never reached: would wait forever

    async def main() -> None:
        async with asyncio.timeout(0.05):
            await run_async(protocol())

    with pytest.raises(TimeoutError):
        asyncio.run(main())
