# Frozen history: Alembic's revision header repeats in every migration by design.
"""A request someone waits for sends ``NOTIFY onceflow_done, '<request id>'`` when it ends.

``Queue.wait`` / ``AsyncQueue.wait`` (and what is built on them: ``Flow.wait``, ``onceflow
wait``, the HTTP ``?wait=``) are woken by it instead of polling. A trigger, so that every
statement that ends a request — a completion, a hand-off, a failure without retries left,
a cancel, the sweeper giving up on a lapsed lease, their batched forms — sends it in its own
transaction: delivered exactly when that commits, never when it rolls back. It fires only
on the transition into ``succeeded``, ``dead`` or ``cancelled`` of a row marked ``waited``
(a wait sets it before it reads the row): a request nobody waits for sends nothing, so a
completion's commit takes no notification lock, and every other update (claims,
heartbeats) tests the ``WHEN`` condition and nothing more. The column has a constant
default: adding it rewrites nothing. On a table partitioned by workspace the trigger is
made on the parent, and so on every partition.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE workspace_process_requests ADD COLUMN waited boolean NOT NULL DEFAULT false"
    )
    op.execute(
        """
        CREATE OR REPLACE FUNCTION onceflow_notify_done() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('onceflow_done', NEW.request_id);
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER onceflow_done AFTER UPDATE OF status ON workspace_process_requests
        FOR EACH ROW
        WHEN (NEW.waited AND NEW.status IN ('succeeded', 'dead', 'cancelled')
              AND OLD.status IS DISTINCT FROM NEW.status)
        EXECUTE FUNCTION onceflow_notify_done()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS onceflow_done ON workspace_process_requests")
    op.execute("DROP FUNCTION IF EXISTS onceflow_notify_done()")
    op.execute("ALTER TABLE workspace_process_requests DROP COLUMN IF EXISTS waited")
