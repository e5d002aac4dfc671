"""The seam between the compute-lock protocol and its two APIs: steps, and their drivers.

The protocol (:mod:`onceflow.locks.protocol`) is written once, as a generator
that does no I/O itself: it yields a :class:`Call` for every backend call, lock
handle call, subscription call and user callback (``check``, ``compute``,
``store``, ``on_wait``), and a :class:`Sleep` for a store retry's backoff. A
driver performs each step and sends its result back in (or throws its exception
in, at the ``yield``, where the direct code would have raised it):

- :func:`run_sync` calls the step's function — the sync backend's methods and
  plain callables — and sleeps with :func:`time.sleep`;
- :func:`run_async` calls it and awaits the result when it is awaitable — the
  async backend's coroutine methods and user callbacks that are coroutine
  functions; plain callables are called in place — and sleeps with
  :func:`asyncio.sleep`.

A cancellation (``asyncio.CancelledError``) or ``KeyboardInterrupt`` met by a
driver is thrown into the generator like any other exception, so the protocol's
``finally`` — release, then announce — still runs its steps; a cancellation that
a step swallowed is thrown in too (:func:`run_async`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Generator
from typing import Any, NoReturn, TypeVar

from onceflow.connector import Sleep  # a store retry's backoff, as the SQL layers' pause
from onceflow.errors import InvalidRequest

R = TypeVar("R")


class Call:
    """Call ``fn(*args, **kwargs)``; the async driver awaits an awaitable result."""

    __slots__ = ("args", "fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs


Step = Call | Sleep

__all__ = ["Call", "Sleep", "Step", "Steps", "run_async", "run_sync"]
#: A protocol run: yields steps, is sent each step's result, returns the run's result.
Steps = Generator[Step, Any, R]


def _reraise_stop_iteration(exc: RuntimeError, thrown: BaseException | None) -> NoReturn:
    """A callback's own ``StopIteration`` leaves the generator as a ``RuntimeError``
    (PEP 479): raise the callback's exception, as a direct call would have."""
    if thrown is not None and isinstance(thrown, StopIteration) and exc.__cause__ is thrown:
        raise thrown.with_traceback(thrown.__traceback__) from None
    raise exc


def run_sync(steps: Steps[R]) -> R:
    """Drive ``steps`` with plain calls and :func:`time.sleep`; its return value."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except RuntimeError as exc:
            _reraise_stop_iteration(exc, error)
        error = send = None
        try:
            if isinstance(step, Call):
                send = step.fn(*step.args, **step.kwargs)
                if inspect.isawaitable(send):
                    send = _refuse_awaitable(step.fn, send)
            else:
                time.sleep(step.seconds)
        except BaseException as exc:
            error = exc


def _refuse_awaitable(fn: Callable[..., Any], result: Any) -> NoReturn:
    """A sync run met a callback that returned an awaitable (an ``async def`` passed to
    ``compute_once``): its value would be a coroutine object — a cell "stored" that never
    ran, a pre-flight "hit" on nothing. Refused, the coroutine closed (never awaited)."""
    if inspect.iscoroutine(result):
        result.close()
    name = getattr(fn, "__qualname__", repr(fn))
    raise InvalidRequest(
        f"{name} returned an awaitable: compute_once calls plain functions"
        " (use acompute_once for coroutine functions)"
    )


async def run_async(steps: Steps[R]) -> R:
    """Drive ``steps`` awaiting awaitable results and :func:`asyncio.sleep`; its return value.

    A cancellation of the calling task that a step swallowed (redis-py 8.1 can return a
    command's reply to a task cancelled during it) is thrown in after that step all the
    same, so a cancelled caller does not go on to acquire or pay.
    """
    task = asyncio.current_task()
    cancels = task.cancelling() if task is not None else 0
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except RuntimeError as exc:
            _reraise_stop_iteration(exc, error)
        error = send = None
        try:
            if isinstance(step, Call):
                send = step.fn(*step.args, **step.kwargs)
                if inspect.isawaitable(send):
                    send = await send
            else:
                await asyncio.sleep(step.seconds)
        except BaseException as exc:
            error = exc
        if task is not None and task.cancelling() > cancels:
            cancels = task.cancelling()  # one CancelledError per request to cancel
            if not isinstance(error, asyncio.CancelledError):
                send = None
                error = asyncio.CancelledError()  # the step swallowed it: raise it here
