"""A Hypothesis state machine of apply / retry / replay / crash against the real database."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import Engine

from onceflow.errors import OpRejected
from onceflow.models.ops import NodeDelete, NodeInsert, NodeMove, OpModel, apply, parse_op
from onceflow.oplog import ApplyResult, InProcessTransport, OpLog, WorkspaceClient
from tests.integration.test_oplog import DropResponses

NODES = st.sampled_from(["a", "b", "c", "d", "e"])
ANCHORS = st.none() | NODES
_ids = itertools.count()


class OpLogMachine(RuleBasedStateMachine):
    def __init__(self, oplog: OpLog, tmp: Path) -> None:
        super().__init__()
        self.oplog = oplog
        self.ws = f"hyp-{next(_ids)}"
        self.outbox = tmp / f"{self.ws}.sqlite"
        self.flaky = DropResponses(InProcessTransport(oplog), drops=0)
        self.client = WorkspaceClient(self.flaky, self.ws, outbox=self.outbox, backoff_base=1e-4)
        self.expected: dict[str, Any] = {}  # the model: a sequential application
        self.applied = 0
        self.last: ApplyResult | None = None
        self.last_op: OpModel | None = None

    def _model(self, op: OpModel) -> None:
        try:
            self.expected, _ = apply(self.expected, op)
            self.applied += 1
        except OpRejected:
            pass

    def _send(self, op: OpModel, drops: int) -> None:
        self.flaky.drops = drops
        result = self.client.apply("doc", op)
        assert result is not None
        assert result.applied == (result.clock is not None)
        if result.duplicate:  # only when an earlier attempt of this very op committed
            assert any(r.op_id == result.op_id and not r.duplicate for r in self.flaky.seen)
        self._model(op)
        self.last, self.last_op = result, op

    @rule(node=NODES, after=ANCHORS, drops=st.integers(0, 3))
    def insert(self, node: str, after: str | None, drops: int) -> None:
        self._send(NodeInsert(node=node, after=after), drops)

    @rule(node=NODES, after=ANCHORS, drops=st.integers(0, 3))
    def move(self, node: str, after: str | None, drops: int) -> None:
        self._send(NodeMove(node=node, after=after), drops)

    @rule(node=NODES, drops=st.integers(0, 2))
    def delete(self, node: str, drops: int) -> None:
        self._send(NodeDelete(node=node), drops)

    @rule()
    def retry_last(self) -> None:
        """A late duplicate of the last op (a reconnect replay): same answer, nothing applied."""
        if self.last is None or self.last_op is None:
            return
        again = self.oplog.apply_op(self.ws, "doc", self.last_op, self.last.op_id)
        assert again.duplicate
        assert (again.clock, again.error) == (self.last.clock, self.last.error)

    @rule(node=NODES, after=ANCHORS)
    def crash_with_pending_op(self, node: str, after: str | None) -> None:
        """Queue an op offline, lose the process, reopen the outbox and replay it."""
        op = NodeMove(node=node, after=after)
        self.client.apply("doc", op, send=False)
        self.client.close()
        self.client = WorkspaceClient(self.flaky, self.ws, outbox=self.outbox, backoff_base=1e-4)
        [result] = self.client.replay()
        self._model(op)
        self.last, self.last_op = result, op

    @invariant()
    def log_and_state_agree(self) -> None:
        doc = self.oplog.get_sub_doc(self.ws, "doc")
        assert doc.clock == self.applied
        assert doc.state == self.expected
        ops = self.oplog.ops_since(self.ws, "doc")
        assert [o.clock for o in ops] == list(range(1, doc.clock + 1))
        assert len({o.op_id for o in ops}) == len(ops)
        replayed: dict[str, Any] = {}
        for o in ops:
            replayed, _ = apply(replayed, parse_op(o.payload))
        assert replayed == doc.state

    def teardown(self) -> None:
        self.client.close()


def test_apply_retry_replay_crash_state_machine(
    clean_db: Engine, redis_url: str, tmp_path: Path
) -> None:
    from onceflow.settings import get_settings

    oplog = OpLog(clean_db, get_settings())
    run_state_machine_as_test(
        lambda: OpLogMachine(oplog, tmp_path),
        settings=settings(max_examples=25, stateful_step_count=15, deadline=None),
    )
