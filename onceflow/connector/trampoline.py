"""The trampoline: the one loop that runs every generator of steps, sync or async.

The queue's and the op log's operations (:mod:`onceflow.connector`), the op-log client's
rules (:mod:`onceflow.oplog.outbox`) and the compute-lock protocol
(:mod:`onceflow.locks.protocol`) are each written once, as a generator that does no I/O
of its own: it yields a *step*, and a runner performs the step and resumes the generator
with its answer. :func:`drive` is that loop for sync callers and :func:`adrive` for
asyncio; each family of steps brings only its ``do``, which performs one step. Two steps
are common to every family: :class:`Call` (call a function) and :class:`Sleep` (wait),
performed by :func:`do_step` and :func:`ado_step`.

The rules, the same in both loops:

- a step's answer is sent in; its exception, whatever it is (``BaseException``
  included), is thrown in at the ``yield``, where a direct call would have raised it, so
  ``try``/``except``/``finally`` around a ``yield`` behave as around the call itself: the
  ``finally`` of a cancelled or interrupted run still runs its steps (a lock's release);
- a step's own ``StopIteration`` that leaves the generator (as a ``RuntimeError``: PEP
  479) leaves the runner as itself, as the direct call would have raised it;
- (:func:`adrive`) a cancellation of the running task that a step swallowed (a library
  that answers a task cancelled during the call, as redis-py 8.1 can) is thrown in after
  that step all the same, so a cancelled caller does not go on to its next step.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar

from onceflow.errors import InvalidRequest

R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")


class Call:
    """Call ``fn(*args, **kwargs)``, a backend's or a caller's function that may do I/O;
    answers its return value, and its exception is thrown in like any step's.

    A sync runner calls it and refuses an awaitable answer (:class:`AwaitableRefused`; a
    coroutine is closed, never run). An async runner awaits an awaitable answer (a
    coroutine function's) and calls a plain function in place, on the event loop; a call
    made with :meth:`in_thread` runs a plain function in a worker thread instead
    (``asyncio.to_thread``), so that a blocking callback (a broker publish) never stalls
    the loop. Either way the run goes on only once the call has returned.
    """

    __slots__ = ("args", "fn", "kwargs", "thread")

    def __init__(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.thread = False

    @classmethod
    def in_thread(cls, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Call:
        """The call, run by an async runner in a worker thread when ``fn`` is a plain
        function (a coroutine function is awaited on the loop all the same)."""
        call = cls(fn, *args, **kwargs)
        call.thread = True
        return call

    def __repr__(self) -> str:
        where = ", in a thread" if self.thread else ""
        return f"Call({self.fn!r}, args={self.args!r}, kwargs={self.kwargs!r}{where})"


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` (``time.sleep`` or ``asyncio.sleep``); answers None."""

    seconds: float


# ------------------------------------------------------------------ the loops


def _advance(
    steps: Generator[Any, Any, Any], answer: Any, error: BaseException | None
) -> tuple[bool, Any]:
    """Resume ``steps`` at its ``yield``: ``error`` thrown in when there is one, else
    ``answer`` sent in. Answers ``(False, its next step)`` or ``(True, its return value)``."""
    try:
        return False, (steps.send(answer) if error is None else steps.throw(error))
    except StopIteration as done:
        return True, done.value
    except RuntimeError as exc:
        _raise_own_stop(exc, error)
        raise


def _raise_own_stop(exc: RuntimeError, error: BaseException | None) -> None:
    """``exc`` left a generator into which ``error`` was thrown: when it is that step's
    own ``StopIteration`` turned into a ``RuntimeError`` (PEP 479), raise it as itself,
    as the direct call raised it."""
    if isinstance(error, StopIteration) and exc.__cause__ is error:
        raise error.with_traceback(error.__traceback__) from None


def drive(steps: Generator[Any, Any, R], do: Callable[[Any], Any]) -> R:
    """Run ``steps`` to their return value, performing each step with ``do(step)``."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:  # _advance, written out: this loop runs every statement of the sync API
            step = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: R = done.value
            return result
        except RuntimeError as exc:
            _raise_own_stop(exc, error)
            raise
        answer, error = None, None
        try:
            answer = do(step)
        except BaseException as exc:
            error = exc


async def adrive(
    steps: Generator[Any, Any, R],
    ado: Callable[[Any], Awaitable[Any]],
    *,
    off_loop: AbstractContextManager[Any] | None = None,
) -> R:
    """Run ``steps`` to their return value, performing each step with ``await ado(step)``.

    ``off_loop``: a lock (a ``threading.Lock``) for a generator whose own code between
    steps blocks (the op-log client's rules read and write a file): it is then resumed in
    a worker thread, holding the lock, so the event loop never waits on that code. A
    cancellation that comes while it is being resumed is raised at once; the thread
    finishes its part, and the generator is not resumed again.
    """
    task = asyncio.current_task()
    cancelling = task.cancelling if task is not None else _never_cancelled
    cancels = cancelling()
    answer: Any = None
    error: BaseException | None = None
    while True:
        if off_loop is None:
            done, step = _advance(steps, answer, error)
        else:
            done, step = await _advance_off_loop(off_loop, steps, answer, error)
        if done:
            result: R = step
            return result
        answer, error = None, None
        try:
            answer = await ado(step)
        except _Stopped as box:
            error = box.stop  # a step's own StopIteration, thrown in as itself
        except BaseException as exc:
            error = exc
        if (now := cancelling()) != cancels:
            if now > cancels and not isinstance(error, asyncio.CancelledError):
                answer, error = None, asyncio.CancelledError()  # the step swallowed it
            cancels = now  # one CancelledError per request to cancel


def _never_cancelled() -> int:
    return 0  # outside a task: nothing to cancel


async def _advance_off_loop(
    lock: AbstractContextManager[Any],
    steps: Generator[Any, Any, Any],
    answer: Any,
    error: BaseException | None,
) -> tuple[bool, Any]:
    def holding() -> tuple[bool, Any]:
        with lock:
            return _boxed(_advance, steps, answer, error)

    try:
        return await asyncio.to_thread(holding)
    except _Stopped as box:
        raise box.stop from None


class _Stopped(Exception):
    """A ``StopIteration`` carried out of the coroutine or the worker thread it was raised
    in: neither lets one through as itself (PEP 479; a future refuses it)."""

    def __init__(self, stop: StopIteration) -> None:
        super().__init__(stop)
        self.stop = stop


def _boxed(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, its ``StopIteration`` raised as :class:`_Stopped`."""
    try:
        return fn(*args, **kwargs)
    except StopIteration as stop:
        raise _Stopped(stop) from None


# ------------------------------------------------------------------ the common steps


def do_step(step: Call | Sleep) -> Any:
    """Perform a :class:`Call` or a :class:`Sleep` in a sync run."""
    if isinstance(step, Call):
        answer = step.fn(*step.args, **step.kwargs)
        if inspect.isawaitable(answer):
            _refuse_awaitable(step.fn, answer)
        return answer
    if isinstance(step, Sleep):
        time.sleep(step.seconds)
        return None
    raise TypeError(f"not a step: {step!r}")


async def ado_step(step: Call | Sleep) -> Any:
    """Perform a :class:`Call` or a :class:`Sleep` in an async run."""
    if isinstance(step, Call):
        if step.thread and not inspect.iscoroutinefunction(step.fn):
            answer = await asyncio.to_thread(_boxed, step.fn, *step.args, **step.kwargs)
        else:
            answer = _boxed(step.fn, *step.args, **step.kwargs)
        return (await answer) if inspect.isawaitable(answer) else answer
    if isinstance(step, Sleep):
        await asyncio.sleep(step.seconds)
        return None
    raise TypeError(f"not a step: {step!r}")


class AwaitableRefused(InvalidRequest, TypeError):
    """A sync run met a function that answered an awaitable (an ``async def`` passed to
    the sync API): its value would be a coroutine object — a cell "stored" that never ran,
    a message "published" that never was. A caller's mistake (:class:`InvalidRequest`)
    and the wrong kind of function (``TypeError``)."""


def _refuse_awaitable(fn: Callable[..., Any], answer: Any) -> NoReturn:
    """Refuse ``fn``'s awaitable answer, the coroutine closed (never run)."""
    if inspect.iscoroutine(answer):
        answer.close()
    name = getattr(fn, "__qualname__", repr(fn))
    raise AwaitableRefused(
        f"{name} returned an awaitable: the sync API calls plain functions"
        " (pass async functions to the asyncio API: acompute_once, AsyncQueue)"
    )


__all__ = ["AwaitableRefused", "Call", "Sleep", "ado_step", "adrive", "do_step", "drive"]
