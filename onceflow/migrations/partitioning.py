"""Hash partitioning by workspace (``ONCEFLOW_PARTITIONS``): the layout the migrations create.

A new database migrated with ``partitions=N`` gets each workspace table created
``PARTITION BY HASH (workspace_id)`` with N partitions ``<table>_p<i> FOR VALUES WITH
(MODULUS N, REMAINDER i)``; its indexes are created on the parent (partitioned indexes, one
local index per partition). ``onceflow_sweeps`` and the version table stay plain.

The layout is chosen once, when the tables are created: :func:`resolve` keeps a later run on
the database's own layout and refuses (:class:`~onceflow.errors.PartitionLayoutMismatch`,
before anything is written) a setting that asks for another one. No migration converts
existing tables (docs/sharding.md 5.2).

Rules for a revision touching a workspace table, so it works on both layouts:

- ``CREATE INDEX CONCURRENTLY`` is refused on a partitioned parent: use
  :func:`create_index_concurrently`, which builds one index per partition ``CONCURRENTLY``
  and attaches them to an index made ``ON ONLY`` the parent.
- Storage parameters (``autovacuum_*``) are refused on a partitioned parent: use
  :func:`set_storage`, which sets them on every partition.
- A unique index or key must contain ``workspace_id``.
"""

from __future__ import annotations

from typing import Any

from alembic import context, op
from sqlalchemy import Connection, text

from onceflow.errors import PartitionLayoutMismatch
from onceflow.settings import get_settings

#: The tables that hold a workspace's rows, in the order the migrations create them.
WORKSPACE_TABLES = (
    "workspace_process_requests",
    "compute_locks",
    "workspace_sub_docs",
    "workspace_sub_doc_ops",
    "spend_ledger",
    "spend_budgets",
    "spend_reservations",
    "result_cache",
    "workspace_request_attempts",
)
#: The config attribute :func:`onceflow.migrate.migrate` passes the resolved layout in.
ATTRIBUTE = "onceflow_partitions"

_LAYOUT = text("""
SELECT c.relname,
       CASE WHEN c.relkind = 'p'
            THEN (SELECT count(*) FROM pg_inherits i WHERE i.inhparent = c.oid) ELSE 0 END
FROM unnest(CAST(:tables AS text[])) WITH ORDINALITY AS t(name, ord)
JOIN pg_class c ON c.oid = to_regclass(t.name)
ORDER BY t.ord
""")


def layout(conn: Connection) -> dict[str, int]:
    """The workspace tables that exist: name → partition count (0: a plain table)."""
    rows = conn.execute(_LAYOUT, {"tables": list(WORKSPACE_TABLES)})
    return {name: int(n) for name, n in rows}


def resolve(conn: Connection, requested: int | None) -> int | None:
    """The partition count to create missing workspace tables with (None: plain tables).

    ``requested`` None follows the tables that exist (plain on a new database); a number
    must match every existing table, else :class:`PartitionLayoutMismatch`.
    """
    found = layout(conn)
    if requested is not None:
        if any(n != requested for n in found.values()):
            raise PartitionLayoutMismatch(requested, found)
        return requested
    counts = set(found.values())
    if len(counts) > 1:  # some partitioned, some not, or counts that differ
        raise PartitionLayoutMismatch(None, found)
    return (counts.pop() or None) if counts else None


def target() -> int | None:
    """The layout of this migration run: as ``onceflow migrate`` resolved it, or (a bare
    ``alembic upgrade``) resolved here from the settings and the database."""
    attributes = context.config.attributes
    if ATTRIBUTE in attributes:
        value = attributes[ATTRIBUTE]
        return None if value is None else int(value)
    return resolve(op.get_bind(), get_settings().partitions)


def partitions_of(table: str) -> list[str]:
    """The partitions of ``table`` in order of creation; [] for a plain table."""
    rows = op.get_bind().execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:t) ORDER BY c.oid"
        ),
        {"t": table},
    )
    return [r[0] for r in rows]


def is_partitioned(table: str) -> bool:
    kind = op.get_bind().scalar(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"), {"t": table}
    )
    return bool(kind == "p")


def partition_by(partitions: int | None) -> dict[str, Any]:
    """``create_table`` keyword arguments: hash-partitioned by workspace, or none."""
    return {} if partitions is None else {"postgresql_partition_by": "HASH (workspace_id)"}


def create_partitions(table: str, partitions: int | None) -> None:
    """Create the ``partitions`` hash partitions of ``table`` (nothing for a plain table)."""
    for i in range(partitions or 0):
        op.execute(
            f"CREATE TABLE {table}_p{i} PARTITION OF {table} "
            f"FOR VALUES WITH (MODULUS {partitions}, REMAINDER {i})"
        )


def set_storage(table: str, options: str) -> None:
    """``ALTER TABLE … SET (options)`` on a plain table, or on each partition of one."""
    for name in partitions_of(table) or [table]:
        op.execute(f"ALTER TABLE {name} SET ({options})")


def _index_valid(name: str) -> bool | None:
    """True: a valid index; False: one an interrupted build left INVALID; None: none."""
    valid = op.get_bind().scalar(
        text("SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(:n)"),
        {"n": name},
    )
    return None if valid is None else bool(valid)


def _attached(parent_index: str, child_index: str) -> bool:
    return bool(
        op.get_bind().scalar(
            text(
                "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = to_regclass(:p) "
                "AND inhrelid = to_regclass(:c))"
            ),
            {"p": parent_index, "c": child_index},
        )
    )


def create_index_concurrently(
    name: str, table: str, columns: str, unique: bool = False, where: str = ""
) -> None:
    """Build index ``name`` on ``table (columns)`` without blocking writes, on either layout
    (``where``: a partial index's condition, "" for none).

    Plain table: ``CREATE INDEX CONCURRENTLY``. Partitioned table: the index ``ON ONLY``
    the parent (catalog only, invalid until complete), then per partition a
    ``CONCURRENTLY`` build attached to it; the parent index turns valid with the last one.
    An index an interrupted build left ``INVALID`` is dropped and built again; a finished
    one is kept, so the call can simply be repeated. Run it inside ``autocommit_block()``.
    """
    kind = "UNIQUE INDEX" if unique else "INDEX"
    cond = f" WHERE {where}" if where else ""
    parts = partitions_of(table) if is_partitioned(table) else []
    if not parts:
        state = _index_valid(name)
        if state:
            return
        if state is False:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        op.execute(f"CREATE {kind} CONCURRENTLY {name} ON {table} ({columns}){cond}")
        return
    op.execute(f"CREATE {kind} IF NOT EXISTS {name} ON ONLY {table} ({columns}){cond}")
    for part in parts:
        child = f"{part}_{name}"[:63]
        if _attached(name, child):
            continue
        state = _index_valid(child)
        if state is False:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {child}")
        if not state:
            op.execute(f"CREATE {kind} CONCURRENTLY {child} ON {part} ({columns}){cond}")
        op.execute(f"ALTER INDEX {name} ATTACH PARTITION {child}")


def drop_index(name: str) -> None:
    """Drop index ``name``: ``CONCURRENTLY`` unless it is a partitioned index (which it
    refuses; a plain ``DROP`` takes the partitions' indexes with it)."""
    kind = op.get_bind().scalar(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:n)"), {"n": name}
    )
    if kind is None:
        return
    concurrently = "" if kind == "I" else "CONCURRENTLY "
    op.execute(f"DROP INDEX {concurrently}IF EXISTS {name}")
