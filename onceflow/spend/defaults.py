"""The spend ledger that processes running stages give their providers by default.

A Celery worker of a :class:`~onceflow.tasks.Flow`, the standalone
:class:`~onceflow.worker.Worker`, :mod:`onceflow.testing` and the HTTP API call
:func:`install_ledger` as they start (``ONCEFLOW_SPEND_LEDGER``, on by default): every
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
from datetime import datetime
from decimal import Decimal

from onceflow.settings import Settings, get_settings
from onceflow.shards import configured_map
from onceflow.spend.hooks import NO_HOOKS, Grant
from onceflow.spend.ledger import LedgerHooks
from onceflow.spend.registry import default_hooks, use_hooks
from onceflow.spend.usage import Usage


class ProcessLedger:
    """:class:`~onceflow.spend.ledger.LedgerHooks` on ``settings``' database (every shard
    of a split one), built once per process on first use."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._built: tuple[int, LedgerHooks] | None = None

    def hooks(self) -> LedgerHooks:
        """This process's ledger hooks (built at the first call in each process)."""
        built = self._built
        pid = os.getpid()
        if built is None or built[0] != pid:
            with self._lock:
                built = self._built
                if built is None or built[0] != pid:
                    settings = self.settings or get_settings()
                    built = (pid, LedgerHooks(configured_map(settings)))
                    self._built = built
        return built[1]

    # The SpendHooks methods, each handed to this process's LedgerHooks.
    def admit(self, grant: Grant) -> None:
        self.hooks().admit(grant)

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


def install_ledger(settings: Settings | None = None) -> bool:
    """Give every declared provider without hooks a :class:`ProcessLedger` on ``settings``'
    database, unless ``settings.spend_ledger`` is off or other hooks were given already
    (:func:`~onceflow.spend.registry.use_hooks`). Whether the default hooks record to a
    ledger now. Connects to nothing."""
    settings = settings or get_settings()
    if not settings.spend_ledger:
        return False
    if default_hooks() is NO_HOOKS:
        use_hooks(ProcessLedger(settings))
    return default_hooks() is not NO_HOOKS


__all__ = ["ProcessLedger", "install_ledger"]
