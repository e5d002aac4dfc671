"""The runners (sync and async) that drive an operation's steps on a connector, and
:class:`operation`, which makes one generator a plain method on a :class:`SyncSide` and a
coroutine method on an :class:`AsyncSide`. The loop itself, and the steps every generator of
steps shares (:class:`Call`, :class:`Sleep`), are :mod:`onceflow.connector.trampoline`'s."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from sqlalchemy import Connection

from onceflow.connector.steps import (
    AfterCommit,
    AsyncConnector,
    Connector,
    Execute,
    FetchAll,
    FetchOne,
    OnShard,
    Pooled,
    ShardCount,
    ShardGroups,
    Step,
    Steps,
    Transaction,
    Using,
)
from onceflow.connector.sync import SQLAlchemyConnector
from onceflow.connector.trampoline import ado_step, adrive, do_step, drive

P = ParamSpec("P")
R = TypeVar("R")


# ------------------------------------------------------------------ runners


def run(connector: Connector, steps: Steps[R]) -> R:
    """Drive ``steps`` to their result on a sync connector."""
    return drive(steps, functools.partial(_do, connector))


def _do(c: Connector, step: Step) -> Any:
    if isinstance(step, FetchOne):
        return c.fetch_one(step.query, step.params)
    if isinstance(step, FetchAll):
        return c.fetch_all(step.query, step.params)
    if isinstance(step, Execute):
        return c.execute(step.query, step.params)
    if isinstance(step, Transaction):
        with c.transaction() as tx:
            return run(tx, step.body)
    if isinstance(step, Pooled):
        return c.pooled
    if isinstance(step, AfterCommit):
        c.after_commit(step.fn)
        return None
    if isinstance(step, Using):
        other = step.connector
        if isinstance(other, Connection):
            other = SQLAlchemyConnector(other)
        return run(other, step.body)
    if isinstance(step, ShardCount | OnShard | ShardGroups):
        return _shard_step(c, step, run)
    return do_step(step)  # a Call, a Sleep


async def arun(connector: AsyncConnector, steps: Steps[R]) -> R:
    """Drive ``steps`` to their result on an async connector."""
    return await adrive(steps, functools.partial(_ado, connector))


async def _ado(c: AsyncConnector, step: Step) -> Any:
    if isinstance(step, FetchOne):
        return await c.fetch_one(step.query, step.params)
    if isinstance(step, FetchAll):
        return await c.fetch_all(step.query, step.params)
    if isinstance(step, Execute):
        return await c.execute(step.query, step.params)
    if isinstance(step, Transaction):
        async with c.transaction() as tx:
            return await arun(tx, step.body)
    # do_step's twin, awaited (alike by shape): the same steps answered on an AsyncConnector.
    if isinstance(step, Pooled):
        return c.pooled
    if isinstance(step, AfterCommit):
        c.after_commit(step.fn)
        return None
    if isinstance(step, Using):
        if not inspect.iscoroutinefunction(getattr(step.connector, "fetch_one", None)):
            raise TypeError(
                f"an async operation needs an async connector, not {type(step.connector).__name__}"
            )
        return await arun(step.connector, step.body)
    if isinstance(step, ShardCount | OnShard | ShardGroups):
        answer = _shard_step(c, step, arun)  # an OnShard body's run is a coroutine
        return (await answer) if inspect.isawaitable(answer) else answer
    return await ado_step(step)  # a Call, a Sleep


def _shard_step(c: Any, step: ShardCount | OnShard | ShardGroups, runner: Any) -> Any:
    """A shard step on ``c``: a sharded connector answers for its shards; any other
    connector is one database (one shard, index 0: itself)."""
    shards = getattr(c, "shard_connectors", None)
    if isinstance(step, ShardCount):
        return 1 if shards is None else len(shards)
    if isinstance(step, ShardGroups):
        if shards is None:
            return [0] * len(step.workspace_ids)
        return [c.shard_map.shard_of(ws) for ws in step.workspace_ids]
    if shards is None:
        if step.index != 0:
            step.body.close()
            raise IndexError(f"shard {step.index} of a connector of one database")
        return runner(c, step.body)
    return runner(shards[step.index], step.body)


# ------------------------------------------------------------------ one body, two APIs


class SyncSide:
    """An object whose :class:`operation` methods run at once on :attr:`connector`."""

    connector: Connector


class AsyncSide:
    """An object whose :class:`operation` methods are coroutines on :attr:`aconnector`."""

    aconnector: AsyncConnector


class operation(Generic[P, R]):
    """Turns a generator of steps into a method: plain on a :class:`SyncSide`, a coroutine on
    an :class:`AsyncSide`. ``steps`` is the generator function itself, for composing
    operations (``yield from Core.get.steps(self, ...)``)."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Steps[R]]) -> None:
        self.steps = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> operation[P, R]: ...

    @overload
    def __get__(self, obj: AsyncSide, owner: type) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, obj: SyncSide, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: object, owner: type) -> Any:
        if obj is None:
            return self
        fn = self.steps
        bound: Callable[..., Any]
        if isinstance(obj, AsyncSide):
            target = obj

            async def abound(*args: Any, **kwargs: Any) -> Any:
                return await arun(target.aconnector, fn(target, *args, **kwargs))

            bound = abound
        elif isinstance(obj, SyncSide):
            sync_target = obj

            def sbound(*args: Any, **kwargs: Any) -> Any:
                return run(sync_target.connector, fn(sync_target, *args, **kwargs))

            bound = sbound
        else:
            raise TypeError(f"{type(obj).__name__} is neither a SyncSide nor an AsyncSide")
        functools.update_wrapper(bound, fn)
        if getattr(type(obj), self.name, None) is self:
            # Once per instance: later lookups skip __get__. Never when a subclass overrides
            # the name (this is then a ``super()`` call): the override must keep winning.
            obj.__dict__[self.name] = bound
        return bound
