"""One seam between onceflow's layers and a database: named statements, sync or async.

Each layer writes an operation once, as a generator of *steps* (Procrastinate's
named queries, River's driver seam, the sans-I/O pattern)::

    @operation
    def get(self, request_id: str) -> Steps[Request]:
        row = yield FetchOne(sql.GET, {"request_id": request_id})
        ...

and a *connector* runs the steps: :class:`PsycopgConnector` on the process's
pooled connections, :class:`AsyncPsycopgConnector` on a psycopg async pool,
:class:`SQLAlchemyConnector` and the Django integration's connector on the
caller's own connection, inside the caller's transaction. :class:`operation`
turns the one generator into a plain method on a sync object
(:class:`SyncSide`, e.g. :class:`~onceflow.Queue`) and a coroutine method on an
async one (:class:`AsyncSide`, e.g. :class:`~onceflow.AsyncQueue`): one
signature, one body, the same semantics on both.

A step's answer is sent back into the generator; a step's error is thrown into
it at the ``yield``, so ``try``/``except`` around a ``yield`` handles a failed
statement as it would a direct call. Every error is onceflow's own
(:func:`onceflow.db.translate_errors`): :class:`~onceflow.errors.ConnectionLost`
for a connection lost under a statement, :class:`~onceflow.errors.DatabaseUnavailable`
for a server that cannot be reached.
"""

from onceflow.connector.aio import AsyncPsycopgConnector, conninfo
from onceflow.connector.run import AsyncSide, SyncSide, arun, operation, run

# The step types again (alike by shape with other imports of them): re-exported here.
from onceflow.connector.steps import (
    AfterCommit,
    AsyncConnector,
    Connector,
    Execute,
    FetchAll,
    FetchOne,
    OnShard,
    Pooled,
    Query,
    ShardCount,
    ShardGroups,
    Step,
    Steps,
    Transaction,
    Using,
    all_rows,
    on_every_shard,
    one_row,
    retrying,
)
from onceflow.connector.sync import (
    ExecutorConnector,
    PsycopgConnector,
    SQLAlchemyConnector,
    on_connection,
)
from onceflow.connector.trampoline import Call, Sleep, adrive, drive

__all__ = [
    "AfterCommit",
    "AsyncConnector",
    "AsyncPsycopgConnector",
    "AsyncSide",
    "Call",
    "Connector",
    "Execute",
    "ExecutorConnector",
    "FetchAll",
    "FetchOne",
    "OnShard",
    "Pooled",
    "PsycopgConnector",
    "Query",
    "SQLAlchemyConnector",
    "ShardCount",
    "ShardGroups",
    "Sleep",
    "Step",
    "Steps",
    "SyncSide",
    "Transaction",
    "Using",
    "adrive",
    "all_rows",
    "arun",
    "conninfo",
    "drive",
    "on_connection",
    "on_every_shard",
    "one_row",
    "operation",
    "retrying",
    "run",
]
