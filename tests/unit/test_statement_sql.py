"""The SQL each named statement sends to Postgres, pinned by digest.

A statement is written once (its name, its text) and its psycopg forms are derived from
parts (``onceflow.connector.statement``). The text Postgres receives is what the
statements' plans and their measured cost were judged on (the claim, the enqueue, the
heartbeat, the completion above all): a change to it must be deliberate, and is made
here too, with the reason in its commit.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from onceflow.connector.steps import Query
from onceflow.metrics import sql as metrics_sql
from onceflow.models.scopes import WorkspaceScope
from onceflow.oplog import sql as oplog_sql
from onceflow.queue import detail
from onceflow.queue import search as queue_search
from onceflow.queue import series as queue_series
from onceflow.queue import sql as queue_sql
from onceflow.spend import sql as spend_sql

#: sha256 (first 16 hex digits) of each statement's SQL; ``#by_id``: its form for a caller
#: that names the request by id alone; ``[n]``: CLAIM_NEXT with the literal limit n.
PINNED = {
    "detail.handed_from": "6e702332b4f1d21d",
    "detail.history": "5dc5e11d53eb5adb",
    "detail.ops": "c94a51a627c7449f",
    "detail.row": "3e884a64db252227",
    "detail.spend": "8bbec39114b4e66d",
    "metrics.estimated_rows": "bee345ee8cab3c39",
    "metrics.live_counts": "ed1745a2bbb4ef54",
    "metrics.table_health": "c55a1c571b800836",
    "oplog.create_sub_doc": "908a8e04ac588e6f",
    "oplog.find_fenced_op": "a9caadcb68951e28",
    "oplog.find_op": "0acfa27fd60b846f",
    "oplog.get_sub_doc": "64029200a139a373",
    "oplog.lock_sub_doc": "1e24fc1b8b42b603",
    "oplog.ops_since": "cfccabaf2bc782ee",
    "oplog.prune": "19ec90a2eb7b8340",
    "oplog.record_applied": "25eccd5c129d1187",
    "oplog.record_rejected": "8f7c889044a08482",
    "queue.begin_sweep": "e7ac0cdf7819cd60",
    "queue.cancel": "406d888cf46e96c6",
    "queue.cancel#by_id": "80165b6eb220b62d",
    "queue.claim": "c159b4522914942f",
    "queue.claim#by_id": "886d44307de93a51",
    "queue.claim_next[10]": "6ef8b083495ed751",
    "queue.claim_next[1]": "a9cccf688aeaeb72",
    "queue.claim_next_scoped[10]": "4ee0abdc7cc86a05",
    "queue.claim_next_scoped[1]": "09c7e736445e3493",
    "queue.claim_parent": "88b4b8c184051c9d",
    "queue.claim_parent#by_id": "471a0af8677be73a",
    "queue.claimable": "2c81f8c599d6ab66",
    "queue.complete": "84c7cfd8df87f507",
    "queue.complete#by_id": "2502d9a8bb223f43",
    "queue.complete_changed": "f586857a5f89230f",
    "queue.complete_changed#by_id": "ef5ae2dc4be14571",
    "queue.complete_many": "6b71f433ae621493",
    "queue.counts": "d6a7c4376ad6e65a",
    "queue.counts_for_workspace": "4271026006f7d9c5",
    "queue.delete_finished": "483aed4657b6635f",
    "queue.depth_all": "5c3d3046fdf30bfa",
    "queue.depth_for": "2336014be5f02f1b",
    "queue.due_counts": "36d0450deba30274",
    "queue.due_for_dispatch": "7a86cdd29226c286",
    "queue.due_unsent": "3f761e3b27325a3f",
    "queue.enqueue": "e914735bf71c3c75",
    "queue.enqueue_lookup": "d8dab21da412b1f8",
    "queue.enqueue_one": "24491c136157eac5",
    "queue.fail": "58ea0840f73c9af9",
    "queue.fail#by_id": "c91a16593635f087",
    "queue.fail_many": "4a7ea4d386860ad2",
    "queue.fence_check": "4c21bf25fd0cfdcb",
    "queue.fence_check#by_id": "8de28bf5c9743696",
    "queue.finish": "4902dc6cf6febc19",
    "queue.finish#by_id": "337516a1b0e26db0",
    "queue.get": "4fe0bb18f79cba3a",
    "queue.get#by_id": "4924a147f9790a69",
    "queue.heartbeat": "cfbf80d743c69841",
    "queue.heartbeat#by_id": "426514e7c09f2541",
    "queue.heartbeat_many": "a47dc107752f3e1e",
    "queue.landed": "587e6a4de1949754",
    "queue.landed#by_id": "3d400533bda5df9c",
    "queue.landed_many": "e90c64e2aa03b164",
    "queue.list[workspace_id,status]": "624249a2f382aa2a",
    "queue.live_claim": "ff3d08455e7d327e",
    "queue.live_claim#by_id": "38ab8e7224ac8580",
    "queue.mark_undispatched": "752b48ae78cc6d52",
    "queue.mark_undispatched#by_id": "a34bf4d1b75516de",
    "queue.mark_undispatched_many": "3c8cec10ea60d86a",
    "queue.next_work": "2ae4a19d3fff5819",
    "queue.next_work_scoped": "f3d3efd83eb93fff",
    "queue.own_claim": "42f23c7cab998cca",
    "queue.own_claim#by_id": "0647fc8052e16722",
    "queue.prune_payloads": "aa3b57325df9481d",
    "queue.release": "23140aaf5e2b6de5",
    "queue.released_many": "6afe8f52a847b531",
    "queue.requeue": "8f5b59ed33d03bc4",
    "queue.requeue#by_id": "5d0767f57022cc96",
    "queue.rescue_expired": "8eaa4d8f66e5519d",
    "queue.wait_mark": "0022846c23865706",
    "queue.wait_mark#by_id": "143f41ff16a42db5",
    "search[scoped]": "c47e4f14315024e9",
    "search[all,cursor]": "27d72149b1c3a8c4",
    "search[none]": "a3473055befc3c28",
    "search[q_prefix]": "f2e0d6c850ef3abd",
    "series.bound": "710d134a5f8f6d2a",
    "series.counts": "7552e897120330f9",
    "series.depth_sample": "0e8443cc504bc5b8",
    "series.lock": "b8ff01b6b352654a",
    "series.prune.onceflow_series": "e3d9bd77d19db9d4",
    "series.prune.onceflow_series_savings": "9262c27dda5c52ff",
    "series.prune.onceflow_series_spend": "c2af4dbed1b413ff",
    "series.read_budgets": "404b9219b6850ddf",
    "series.read_counts": "14fdd690a34f91a1",
    "series.read_gauges": "f59dd1d6b63263b7",
    "series.read_now": "409ebd09f6aff869",
    "series.read_savings": "a309eb541904d15d",
    "series.read_spend_providers": "d4f1604febfc59db",
    "series.read_spend_workspaces": "2ffffb8f6b004443",
    "series.read_spend_workspaces_scoped": "67a3033f10b10dd4",
    "series.rescued": "4f8497d04794d9f1",
    "series.savings": "db6682e7ef9690ca",
    "series.spend": "d7169f78316e08f7",
    "series.spend_clear": "a2fe65e21cf4eab7",
    "series.window": "c251d39076df49ab",
    "spend.report[workspace,scoped]": "e87c5b34358e543d",
    "spend.report[workspace]": "d94325b1bd75f94e",
    "series.zero": "3f532933899fa04a",
}


#: The dashboard search's statement for a few filter combinations (it is built from one
#: condition per filter given; these pin the conditions, the order and the cursor's).
SEARCH_SHAPES = {
    "none": (queue_search.Filters(), False),
    "all,cursor": (
        queue_search.Filters(
            workspace="w",
            job="j",
            branch="b",
            stage="s",
            worker_class="c",
            status="queued",
            since=datetime(2026, 1, 1, tzinfo=UTC),
            until=datetime(2026, 1, 2, tzinfo=UTC),
            q="job-or-id",
        ),
        True,
    ),
    "q_prefix": (queue_search.Filters(q="abcdef12"), False),
    "scoped": (queue_search.Filters(scope=WorkspaceScope.parse(["w", "acme-*"])), False),
}


def _digest(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()[:16]


def _rendered() -> dict[str, str]:
    out: dict[str, str] = {}
    for module in (queue_sql, oplog_sql):
        for value in vars(module).values():
            if isinstance(value, Query):
                out[value.name] = _digest(value.sql)
                if value.by_id is not None:
                    out[f"{value.name}#by_id"] = _digest(value.by_id)
    for limit in (1, 10):
        for scoped in (False, True):
            query = queue_sql.claim_next_query(limit, scoped)
            out[f"{query.name}[{limit}]"] = _digest(query.sql)
    listed = queue_sql.list_query(("workspace_id", "status"), 50)
    out[listed.name] = _digest(listed.sql)
    out["metrics.live_counts"] = _digest(metrics_sql.Q_LIVE_COUNTS)
    out["metrics.estimated_rows"] = _digest(metrics_sql.ESTIMATED_ROWS.sql)
    out["metrics.table_health"] = _digest(metrics_sql.TABLE_HEALTH.sql)
    for name, sql in detail.STATEMENTS.items():
        out[name] = _digest(sql)
    for name, sql in queue_series.STATEMENTS.items():
        out[name] = _digest(sql)
    for scoped in (False, True):  # the operators' spend report, grouped by workspace
        report = spend_sql.report([spend_sql.GROUPS["workspace"]], scoped=scoped)
        out[f"spend.report[workspace{',scoped' if scoped else ''}]"] = _digest(report)
    for name, (filters, cursor) in SEARCH_SHAPES.items():
        out[f"search[{name}]"] = _digest(queue_search.search_sql(filters, cursor=cursor, limit=51))
    return out


def test_every_statement_sends_the_sql_it_was_judged_on() -> None:
    assert _rendered() == PINNED


def test_the_hot_statements_are_pinned() -> None:
    """The statements whose speed was measured are among the pinned, in both forms."""
    for name in ("queue.claim", "queue.heartbeat", "queue.complete", "queue.complete_changed",
                 "queue.finish"):  # fmt: skip
        assert name in PINNED and f"{name}#by_id" in PINNED
    for name in ("queue.enqueue", "queue.enqueue_one", "queue.claim_next[1]",
                 "queue.complete_many", "queue.heartbeat_many"):  # fmt: skip
        assert name in PINNED


def test_a_statement_is_one_object_with_its_name_text_and_forms() -> None:
    claim = queue_sql.CLAIM
    assert claim.name == "queue.claim"
    assert ":token" in claim.text and "%(token)s" in claim.sql
    assert str(claim.clause) == claim.text
    assert claim.by_id is not None and claim.by_id != claim.sql
    assert "%(request_ids)b" in queue_sql.COMPLETE_MANY.sql  # sent in binary
