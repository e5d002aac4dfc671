"""The dashboard's request search on a real table: filters, pasted ids, keyset pages, and
every query shape on an index (no sequential scan) on a table of 20k rows."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.db import fetch_all, raw_connection
from onceflow.errors import InvalidRequest
from onceflow.models.scopes import WorkspaceScope
from onceflow.queue import search
from onceflow.queue.search import Filters

pytestmark = pytest.mark.slow

# 20k rows over 50 workspaces, 400 jobs, 2 classes, 4 stages, 5 statuses; one a second.
_ROWS = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, finished_at, claim_token,
     lease_expires_at, created_at, updated_at)
SELECT md5('r' || i) || md5('s' || i), 'w' || (i % 50), 'job-' || (i % 400), 'b' || (i % 3),
       'stage' || (i % 4), true, '{}', 'h', CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'cpu' END,
       s.status, 5, 3,
       CASE WHEN s.status IN ('succeeded', 'dead', 'cancelled') THEN t.at END,
       CASE WHEN s.status = 'running' THEN 't' END,
       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END, t.at, t.at
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT (ARRAY['succeeded', 'succeeded', 'succeeded', 'succeeded', 'succeeded',
                            'succeeded', 'queued', 'running', 'dead', 'cancelled'])[i % 10 + 1]
                  AS status) s,
     LATERAL (SELECT timestamptz '2026-12-01 00:00:00+00' + i * interval '1 second' AS at) t
"""
N = 20_000
BASE = datetime(2026, 12, 1, tzinfo=UTC)

# One filter combination of each shape the dashboard sends.
SHAPES: dict[str, Filters] = {
    "none": Filters(),
    "workspace": Filters(workspace="w7"),
    "workspace+status": Filters(workspace="w7", status="dead"),
    "job": Filters(job="job-17"),
    "job+branch": Filters(job="job-17", branch="b1"),
    "stage": Filters(stage="stage2"),
    "worker_class": Filters(worker_class="llm"),
    "status": Filters(status="running"),
    "since+until": Filters(since=BASE + timedelta(hours=1), until=BASE + timedelta(hours=2)),
    "stage+class+status+time": Filters(
        stage="stage1", worker_class="cpu", status="succeeded", since=BASE
    ),
    "q=request_id": Filters(q="0" * 64),
    "q=prefix": Filters(q="abcdef12"),
    "q=job": Filters(q="job-17"),
    "q+workspace": Filters(q="job-17", workspace="w17"),
    "scoped": Filters(scope=WorkspaceScope.parse(["w7", "w1*"])),
    "scoped+workspace": Filters(workspace="w7", scope=WorkspaceScope.parse(["w7", "w1*"])),
    "scoped+status": Filters(status="dead", scope=WorkspaceScope.parse(["w3*"])),
}


@pytest.fixture(scope="module")
def big(engine: Engine) -> Engine:
    from onceflow.models import metadata

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(sorted(metadata.tables))))
        conn.execute(text(_ROWS), {"n": N})
        conn.execute(text("ANALYZE workspace_process_requests"))
    return engine


def _plan(engine: Engine, filters: Filters, *, cursor: bool) -> str:
    after = (BASE + timedelta(hours=3), "w9", "f" * 64) if cursor else None
    statement = search.search_sql(filters, cursor=cursor, limit=51)
    with raw_connection(engine) as raw:
        rows = fetch_all(
            raw, "EXPLAIN (FORMAT JSON) " + statement, search.search_params(filters, after)
        )
    return json.dumps(rows)


@pytest.mark.parametrize("cursor", [False, True], ids=["first page", "next page"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_query_shape_reads_an_index(big: Engine, shape: str, cursor: bool) -> None:
    plan = _plan(big, SHAPES[shape], cursor=cursor)
    assert '"Node Type": "Seq Scan"' not in plan, (shape, plan)
    assert "Index" in plan, (shape, plan)
    # The planner picks between the indexes by cost (a workspace's rows spread over the
    # table: reading ix_wpr_created newest first may be cheaper); these have one choice.
    expected = {
        "job": "ix_wpr_job",
        "none": "ix_wpr_created",
        "q=request_id": "ix_wpr_request_id",
        "q=prefix": "ix_wpr_request_id",
        "q=job": "ix_wpr_job",
    }.get(shape)
    if expected is not None:
        assert expected in plan, (shape, plan)


def _everything(engine: Engine, filters: Filters, limit: int) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = search.search(engine, filters, limit=limit, cursor=cursor)
        assert len(page["items"]) <= limit
        pages.extend(page["items"])
        cursor = page["next"]
        if cursor is None:
            return pages


def _from_table(engine: Engine, where: str, params: dict[str, Any]) -> list[str]:
    query = text(
        f"SELECT request_id FROM workspace_process_requests WHERE {where} "  # noqa: S608
        "ORDER BY created_at DESC, workspace_id DESC, request_id DESC"
    )
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(query, params)]


def test_filters_and_pages_equal_the_table(big: Engine) -> None:
    cases = [
        (Filters(workspace="w8", status="dead"), "workspace_id = 'w8' AND status = 'dead'", {}),
        (Filters(job="job-17", branch="b2"), "job_id = 'job-17' AND branch_path = 'b2'", {}),
        (
            Filters(
                stage="stage1",
                worker_class="llm",
                since=BASE + timedelta(hours=1),
                until=BASE + timedelta(hours=2),
            ),
            "stage = 'stage1' AND worker_class = 'llm' AND created_at >= :a AND created_at < :b",
            {"a": BASE + timedelta(hours=1), "b": BASE + timedelta(hours=2)},
        ),
    ]
    for filters, where, params in cases:
        expected = _from_table(big, where, params)
        assert expected, where  # the case finds something
        got = [r["request_id"] for r in _everything(big, filters, limit=7)]
        assert got == expected, where  # every row once, in order: no duplicate, no gap
    page = search.search(big, Filters(workspace="w8", status="dead"), limit=3)
    row = page["items"][0]
    assert set(row) == {
        "request_id", "workspace_id", "job_id", "branch_path", "stage", "worker_class",
        "status", "attempts", "created_at", "updated_at", "finished_at",
    }  # fmt: skip
    assert row["workspace_id"] == "w8" and row["status"] == "dead"
    assert datetime.fromisoformat(row["created_at"]).tzinfo is not None


def test_paging_holds_while_rows_are_added(big: Engine) -> None:
    """Keyset pages: rows enqueued between pages (newer) neither repeat nor push rows out."""
    filters = Filters(workspace="w3")
    expected = _from_table(big, "workspace_id = 'w3'", {})
    first = search.search(big, filters, limit=100)
    with big.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                 input_hash, worker_class, max_attempts, max_crash_attempts)
            VALUES ('added-while-paging', 'w3', 'j', '', 's', true, '{}', 'h', 'cpu', 1, 1)""")
        )
    try:
        got = [r["request_id"] for r in first["items"]]
        cursor = first["next"]
        while cursor is not None:
            page = search.search(big, filters, limit=100, cursor=cursor)
            got += [r["request_id"] for r in page["items"]]
            cursor = page["next"]
        assert got == expected
    finally:
        with big.begin() as conn:
            conn.execute(text(
                "DELETE FROM workspace_process_requests WHERE request_id = 'added-while-paging'"
            ))  # fmt: skip


def test_a_limited_reader_lists_only_its_workspaces(big: Engine) -> None:
    def listed(scope: list[str], **filters: Any) -> list[str]:
        found = _everything(big, Filters(scope=WorkspaceScope.parse(scope), **filters), limit=97)
        return [r["request_id"] for r in found]

    # Exact ids and prefixes: w7 and w1, w10 … w19; never w2 or w70-like neighbours.
    expected = _from_table(big, "workspace_id = 'w7' OR workspace_id LIKE 'w1%'", {})
    assert listed(["w7", "w1*"]) == expected and len(expected) == 12 * N // 50
    assert listed(["w7"], status="dead") == _from_table(
        big, "workspace_id = 'w7' AND status = 'dead'", {}
    )
    # A pattern's _ and % are the id's characters, not LIKE's wildcards.
    assert listed(["w_*"]) == [] and listed(["w%"]) == [] and listed(["w_"]) == []
    # A pasted id of another workspace is not found.
    other = _from_table(big, "workspace_id = 'w2'", {})[0]
    assert listed(["w7"], q=other) == []


def test_a_pasted_id_finds_its_request(big: Engine) -> None:
    with big.connect() as conn:
        rid, ws, job = conn.execute(text(
            "SELECT request_id, workspace_id, job_id FROM workspace_process_requests "
            "ORDER BY request_id LIMIT 1 OFFSET 123"
        )).one()  # fmt: skip
    [found] = search.search(big, Filters(q=rid))["items"]
    assert (found["request_id"], found["workspace_id"]) == (rid, ws)
    by_prefix = search.search(big, Filters(q=rid[:10]))["items"]
    assert rid in [r["request_id"] for r in by_prefix]
    assert all(r["request_id"].startswith(rid[:10]) for r in by_prefix)
    by_job = search.search(big, Filters(q=job), limit=200)["items"]
    assert len(by_job) == N // 400 and {r["job_id"] for r in by_job} == {job}
    # Too short a prefix is an exact id only: nothing starts-with-matches it.
    assert search.search(big, Filters(q=rid[:7]))["items"] == []
    assert search.search(big, Filters(q="no-such-id"))["items"] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"filters": Filters(status="sleeping")}, "status must be one of"),
        ({"filters": Filters(workspace="")}, "workspace"),
        ({"filters": Filters(since=datetime(2026, 1, 1))}, "with a zone"),
        ({"filters": Filters(since=BASE, until=BASE)}, "since must be before until"),
        ({"filters": Filters(), "cursor": "not-a-cursor"}, "cursor is not one"),
        ({"filters": Filters(), "limit": 201}, "limit must be"),
        ({"filters": Filters(), "limit": 0}, "limit must be"),
    ],
)
def test_bad_input_is_refused_with_a_message(
    clean_db: Engine, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        search.search(clean_db, **kwargs)


def test_parse_time_names_the_parameter() -> None:
    assert search.parse_time("since", "2026-12-01T00:00:00Z") == BASE
    with pytest.raises(InvalidRequest, match="until must be an ISO 8601"):
        search.parse_time("until", "yesterday")


def test_pages_hold_on_a_database_whose_ids_sort_by_another_collation(
    empty_database: str,
) -> None:
    """Ids of one instant page in code-point order whatever the columns' collation: an ICU
    collation sorts 'a' before 'B' where Python (merging shards' pages) sorts 'B' first, so a
    page ordered by the collation would be cut at a key the next page's cursor then skips."""
    from onceflow.db import make_engine

    collation = "en-US-x-icu"
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.begin() as conn:
            if not conn.execute(
                text("SELECT 1 FROM pg_collation WHERE collname = :c"), {"c": collation}
            ).first():
                pytest.skip(f"no {collation} collation in this Postgres")
            conn.execute(
                text(f"""
                CREATE TABLE workspace_process_requests (
                    request_id text COLLATE "{collation}", workspace_id text COLLATE "{collation}",
                    job_id text, branch_path text, stage text, worker_class text, status text,
                    attempts int, created_at timestamptz, updated_at timestamptz,
                    finished_at timestamptz, PRIMARY KEY (workspace_id, request_id))""")
            )
            ids = [("a", "b"), ("a", "C"), ("B", "b"), ("B", "C"), ("c", "a")]
            for ws, rid in ids:
                conn.execute(
                    text(
                        "INSERT INTO workspace_process_requests VALUES (:rid, :ws, 'j', '', 's',"
                        " 'cpu', 'queued', 0, :at, :at, NULL)"
                    ),
                    {"rid": rid, "ws": ws, "at": BASE},
                )
            # The two orders differ here, or the test proves nothing.
            in_collation = conn.execute(text(
                "SELECT workspace_id, request_id FROM workspace_process_requests "
                "ORDER BY workspace_id DESC, request_id DESC"
            )).all()  # fmt: skip
            assert [tuple(r) for r in in_collation] != sorted(ids, reverse=True)
        got = [(r["workspace_id"], r["request_id"]) for r in _everything(engine, Filters(), 1)]
        assert got == sorted(ids, reverse=True)
        got = [(r["workspace_id"], r["request_id"]) for r in _everything(engine, Filters(), 2)]
        assert got == sorted(ids, reverse=True)
    finally:
        engine.dispose()


def test_a_search_stops_at_the_dashboard_query_timeout(
    clean_db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's statement runs under ONCEFLOW_DASHBOARD_QUERY_TIMEOUT_SECONDS: held up (here
    by a lock on the table) it is stopped and says so, an HTTP 503, never a 500."""
    from onceflow.errors import DatabaseUnavailable
    from onceflow.integrations.fastapi.responses import error_response
    from onceflow.settings import get_settings

    monkeypatch.setenv("ONCEFLOW_DASHBOARD_QUERY_TIMEOUT_SECONDS", "0.3")
    get_settings.cache_clear()
    try:
        with clean_db.connect() as holder:
            holder.execute(text("LOCK TABLE workspace_process_requests IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(DatabaseUnavailable, match=r"past its 0\.3 s limit") as caught:
                search.search(clean_db, Filters(stage="s"))
            holder.rollback()
        assert error_response(caught.value).status_code == 503
        # The setting holds for that transaction only: the connection is back unbounded.
        with raw_connection(clean_db) as raw:
            [row] = fetch_all(raw, "SHOW statement_timeout", {})
        assert row["statement_timeout"] == "0"
        assert search.search(clean_db, Filters(stage="s"))["items"] == []
    finally:
        monkeypatch.delenv("ONCEFLOW_DASHBOARD_QUERY_TIMEOUT_SECONDS")
        get_settings.cache_clear()
