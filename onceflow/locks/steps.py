"""The seam between the compute-lock protocol and its two APIs: steps, and their runners.

The protocol (:mod:`onceflow.locks.protocol`) is written once, as a generator
that does no I/O itself: it yields a :class:`Call` for every backend call, lock
handle call, subscription call and user callback (``check``, ``compute``,
``store``, ``on_wait``), and a :class:`Sleep` for a store retry's backoff. The
runners are the trampoline's (:mod:`onceflow.connector.trampoline`), which
performs each step and sends its result back in (or throws its exception in, at
the ``yield``, where the direct code would have raised it):

- :func:`run_sync` calls the step's function — the sync backend's methods and
  plain callables — and sleeps with :func:`time.sleep`;
- :func:`run_async` calls it and awaits the result when it is awaitable — the
  async backend's coroutine methods and user callbacks that are coroutine
  functions; plain callables are called in place — and sleeps with
  :func:`asyncio.sleep`.

A cancellation (``asyncio.CancelledError``) or ``KeyboardInterrupt`` met by a
runner is thrown into the generator like any other exception, so the protocol's
``finally`` — release, then announce — still runs its steps; a cancellation that
a step swallowed is thrown in too (:func:`run_async`).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

from onceflow.connector.trampoline import Call, Sleep, ado_step, adrive, do_step, drive

R = TypeVar("R")

Step = Call | Sleep

__all__ = ["Call", "Sleep", "Step", "Steps", "run_async", "run_sync"]
#: A protocol run: yields steps, is sent each step's result, returns the run's result.
Steps = Generator[Step, Any, R]


def run_sync(steps: Steps[R]) -> R:
    """Drive ``steps`` with plain calls and :func:`time.sleep`; its return value."""
    return drive(steps, do_step)


async def run_async(steps: Steps[R]) -> R:
    """Drive ``steps`` awaiting awaitable results and :func:`asyncio.sleep`; its return value."""
    return await adrive(steps, ado_step)
