"""The spend ledger that processes running stages give their providers by default.

A :class:`~onceflow.tasks.Flow` calls :func:`install_ledger` when it builds its process's
queue (its Celery workers, :mod:`onceflow.testing`, the HTTP API, an app that enqueues), and
so does the standalone :class:`~onceflow.worker.Worker`, on the databases it claims from
(``ONCEFLOW_SPEND_LEDGER``, on by default): every
declared provider without hooks of its own then checks budgets and writes ledger rows in
the settings' database, with no wiring in user code. Hooks given with
:func:`~onceflow.spend.registry.use_hooks` first are kept.

:class:`ProcessLedger` builds its :class:`~onceflow.spend.ledger.LedgerHooks` on first use
in each process, on that process's engines: installed in a Celery worker's main process
before the pool forks, each child still writes over its own connections, never its
parent's sockets.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal

from onceflow.settings import Settings, get_settings
from onceflow.shards import configured_map
from onceflow.spend.databases import Databases
from onceflow.spend.hooks import NO_HOOKS, Grant
from onceflow.spend.ledger import LedgerHooks
from onceflow.spend.registry import default_hooks, use_hooks
from onceflow.spend.usage import Usage


class ProcessLedger:
    """:class:`~onceflow.spend.ledger.LedgerHooks` built once per process on first use: on
    ``databases()`` when given (say, a worker's own queue's engines), else on ``settings``'
    database (every shard of a split one)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        databases: Callable[[], Databases] | None = None,
    ) -> None:
        self.settings = settings
        self.databases = databases
        # pid -> the lock that builds that process's hooks: a forked child never waits on
        # a lock some thread of its parent held at the fork.
        self._locks: dict[int, threading.Lock] = {}
        self._built: tuple[int, Settings | None, LedgerHooks] | None = None

    def hooks(self) -> LedgerHooks:
        """This process's ledger hooks, built at the first call in each process. Without
        settings or databases of its own, they follow the environment's settings: built
        again when those were read anew (another database or shard map)."""
        built = self._built
        pid = os.getpid()
        settings = self.settings
        if settings is None and self.databases is None:
            settings = get_settings()
        if built is None or built[0] != pid or built[1] is not settings:
            with self._locks.setdefault(pid, threading.Lock()):
                built = self._built
                if built is None or built[0] != pid or built[1] is not settings:
                    built = (pid, settings, LedgerHooks(self._databases(settings)))
                    self._built = built
        return built[2]

    def _databases(self, settings: Settings | None) -> Databases:
        if self.databases is not None:
            return self.databases()
        return Databases(configured_map(settings or get_settings()))

    # The SpendHooks methods, each handed to this process's LedgerHooks.
    def admit(self, grant: Grant) -> None:
        self.hooks().admit(grant)

    # SpendHooks.settle's signature (alike by shape): the protocol method, spelled out.
    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime,
        ended_at: datetime,
    ) -> None:
        self.hooks().settle(grant, usage, outcome, provider, model, cost, started_at, ended_at)

    def release(self, grant: Grant) -> None:
        self.hooks().release(grant)


def install_ledger(
    settings: Settings | None = None, *, databases: Callable[[], Databases] | None = None
) -> bool:
    """Give every declared provider without hooks a :class:`ProcessLedger` (on
    ``databases()``, else ``settings``' database), unless ``settings.spend_ledger`` is off
    or other hooks were given already (:func:`~onceflow.spend.registry.use_hooks`, or an
    earlier install: the first one stays). Whether the default hooks record to a ledger
    now. Connects to nothing."""
    if not (settings or get_settings()).spend_ledger:
        return False
    if default_hooks() is NO_HOOKS:
        use_hooks(ProcessLedger(settings, databases=databases))
    return default_hooks() is not NO_HOOKS


__all__ = ["ProcessLedger", "install_ledger"]
