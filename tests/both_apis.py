"""Run the same layer tests on the sync API and on the asyncio API (parametrized, not copied).

``blocking(async_obj, loop)`` exposes an async object (``AsyncQueue``, ``AsyncOpLog`` …) with
the sync object's calling convention: each coroutine method runs on one event loop in a
background thread, so a test written against ``Queue`` drives ``AsyncQueue`` unchanged —
threads in a test submit their calls concurrently to that one loop, as an async server's
requests would.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread; ``call(coro)`` waits for a coroutine's result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(_wrap(coro), self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            # Closed here, not left to the garbage collector: an unclosed loop collected
            # later warns ("unclosed event loop") inside whichever test is running then.
            self.loop.close()


async def _wrap(coro: Awaitable[T]) -> T:
    return await coro


class Blocking:
    """``target``'s coroutine methods as blocking calls on ``loop``; anything else as it is."""

    def __init__(self, target: Any, loop: LoopThread) -> None:
        self._target = target
        self._loop = loop

    @property
    def target(self) -> Any:
        return self._target

    def beside(self, other: Any) -> Blocking:
        """Another async object (built on ``target``, e.g. a client of it), on the same loop."""
        return Blocking(other, self._loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.call(attr(*args, **kwargs))

        return call


def both(make_sync: Callable[[], T], make_async: Callable[[], Any], api: str) -> Iterator[T]:
    """A fixture body: the sync object, or the async one behind :class:`Blocking`, closed after."""
    if api == "sync":
        yield make_sync()
        return
    loop = LoopThread()
    target = make_async()
    try:
        yield Blocking(target, loop)  # type: ignore[misc]
    finally:
        close = getattr(target, "aclose", None)
        if close is not None:
            loop.call(close())
        loop.stop()
