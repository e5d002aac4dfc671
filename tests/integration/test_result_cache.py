"""The result cache across jobs on real Postgres and Redis: a hit pays nothing and fills the
cell, the scope decides who shares an entry, entries expire by the database clock and can be
invalidated, hits are counted and written to the ledger with what they saved, identical
calls of 8 processes merge in flight, and bad input changes nothing."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.cache import CacheKey, ResultCache, invalidate
from onceflow.errors import InvalidRequest, PayloadTooLarge
from onceflow.locks import Path, compute_once, get_backend
from tests.integration.cache_callers import CountingProvider, provider, summarise

#: What the stand-in's answer (1000 tokens in, 200 out) costs at the test price.
COST = Decimal("0.0045")


@pytest.fixture()
def llm_server() -> Iterator[CountingProvider]:
    server = CountingProvider()
    try:
        yield server
    finally:
        server.stop()


def prompt() -> str:
    return f"Summarise posting {uuid.uuid4().hex}: {'lorem ipsum ' * 50}"


def run(
    server: CountingProvider, redis_url: str, ws: str, job: str, scope: str, text_: str,
    ttl: float = 60.0,
) -> tuple[str, str, bool]:  # fmt: skip
    return summarise(server.url, redis_url, ws, job, scope, text_, ttl)


def ledger(engine: Engine, ws: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT outcome, provider, model, input_tokens, output_tokens, cost, "
                 "saved_cost, cell_key FROM spend_ledger WHERE workspace_id = :ws "
                 "AND outcome = 'cache_hit'"),
            {"ws": ws},
        ).mappings().all()  # fmt: skip
    return [dict(r) for r in rows]


def entries(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT (SELECT count(*) FROM result_cache) "
                     "+ (SELECT count(*) FROM result_cache_global)")
            ).scalar_one()
        )  # fmt: skip


def test_a_hit_in_another_job_pays_nothing_fills_the_cell_and_is_counted(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    ws, key = f"ws-{uuid.uuid4().hex[:8]}", prompt()
    path, value, filled = run(llm_server, redis_url, ws, "job-1", "workspace", key)
    assert (path, filled, llm_server.calls) == ("computed", True, 1)
    hits_before = get_backend().counters.snapshot(ws)["cache_hits"]
    path, again, filled = run(llm_server, redis_url, ws, "job-2", "workspace", key)
    assert (path, again, filled) == ("cache_hit", value, True)
    assert llm_server.calls == 1
    assert get_backend().counters.snapshot(ws)["cache_hits"] == hits_before + 1
    [row] = ledger(clean_db, ws)
    assert row["provider"] == "cache-llm" and row["model"] == "stand-in"
    assert (row["input_tokens"], row["output_tokens"], row["cost"]) == (0, 0, None)
    assert row["saved_cost"] == COST and row["cell_key"] == "job-2/summary"


def test_workspace_scope_is_per_workspace_and_global_scope_is_shared(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    key = prompt()
    for ws in ("ws-a", "ws-b"):
        assert run(llm_server, redis_url, ws, "job", "workspace", key)[0] == "computed"
    assert llm_server.calls == 2
    assert run(llm_server, redis_url, "ws-a", "job-2", "workspace", key)[0] == "cache_hit"
    assert llm_server.calls == 2
    # A global key of the same text is another entry; after one call every workspace hits.
    assert run(llm_server, redis_url, "ws-c", "job", "global", key)[0] == "computed"
    for ws in ("ws-a", "ws-b", "ws-d"):
        assert run(llm_server, redis_url, ws, "other", "global", key)[0] == "cache_hit"
    assert llm_server.calls == 3


def test_an_entry_expires_by_the_database_clock_then_the_call_is_paid_again(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    key = prompt()
    assert run(llm_server, redis_url, "ws", "j1", "global", key, ttl=0.5)[0] == "computed"
    assert run(llm_server, redis_url, "ws", "j2", "global", key, ttl=0.5)[0] == "cache_hit"
    with clean_db.connect() as conn:
        expires = conn.execute(text("SELECT expires_at FROM result_cache_global")).scalar_one()
        # Wait for the database clock (not this process's) to pass the entry's expiry.
        while conn.execute(text("SELECT now() < :e"), {"e": expires}).scalar_one():
            conn.commit()
            time.sleep(0.05)
    assert run(llm_server, redis_url, "ws", "j3", "global", key, ttl=0.5)[0] == "computed"
    assert llm_server.calls == 2


def test_invalidate_makes_the_next_call_pay_again(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    key = prompt()
    assert run(llm_server, redis_url, "ws", "j1", "workspace", key)[0] == "computed"
    assert invalidate("workspace", key=key, workspace_id="other-ws") is False  # not its entry
    assert run(llm_server, redis_url, "ws", "j2", "workspace", key)[0] == "cache_hit"
    assert invalidate("workspace", key=key, workspace_id="ws") is True
    assert invalidate("workspace", key=key, workspace_id="ws") is False  # gone already
    assert run(llm_server, redis_url, "ws", "j3", "workspace", key)[0] == "computed"
    assert llm_server.calls == 2
    # By digest, as the CLI takes it for a long prompt.
    digest = CacheKey("workspace", key, 1).digest
    assert ResultCache(clean_db).invalidate("workspace", digest=digest, workspace_id="ws")


def test_bad_input_is_refused_and_changes_nothing(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    key = prompt()
    assert run(llm_server, redis_url, "ws", "j1", "workspace", key)[0] == "computed"
    calls: list[int] = []
    cells: dict[str, Any] = {}

    def once(cache: Any, compute: Any = lambda: "value") -> Any:
        return compute_once(
            "ws", "job-bad", "t", check=lambda: cells.get("t"),
            compute=lambda: calls.append(1) or compute(), store=lambda v: cells.update(t=v),
            cache=cache,
        )  # fmt: skip

    for bad in (
        lambda: CacheKey("tenant", key, 60),  # type: ignore[arg-type]
        lambda: CacheKey("workspace", "", 60),
        lambda: CacheKey("workspace", key, 0),
        lambda: CacheKey("workspace", key, float("nan")),
        lambda: CacheKey("workspace", key, True),
        lambda: once("not a key"),
        lambda: once(CacheKey("workspace", "other", 60), compute=lambda: {1, 2}),  # not JSON
        lambda: once(CacheKey("workspace", "big", 60), compute=lambda: "x" * 300_000),
        lambda: invalidate("tenant", key=key, workspace_id="ws"),
        lambda: invalidate("workspace", key=key),  # which workspace?
        lambda: invalidate("global", key=key, workspace_id="ws"),
        lambda: invalidate("workspace", key=key, digest="ab", workspace_id="ws"),
        lambda: invalidate("workspace", digest="not-hex", workspace_id="ws"),
        lambda: compute_once(  # a hit's run named without a cache
            "ws",
            "job-bad",
            "t",
            check=lambda: None,
            compute=lambda: calls.append(1) or 1,
            store=lambda v: cells.update(t=v),
            stage="s",
            request_id="r",
        ),
    ):
        with pytest.raises((InvalidRequest, PayloadTooLarge)):
            bad()
    assert cells == {}  # no cell filled with a value that could not be cached
    assert entries(clean_db) == 1  # the first entry only, kept
    assert run(llm_server, redis_url, "ws", "j2", "workspace", key)[0] == "cache_hit"
    assert llm_server.calls == 1


def test_a_cell_already_stored_never_reads_the_cache(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    outcome = compute_once(
        "ws", "job", "t", check=lambda: "stored", compute=lambda: "never",
        store=lambda v: None, cache=CacheKey("global", prompt(), 60),
    )  # fmt: skip
    assert outcome.path is Path.PREFLIGHT and entries(clean_db) == 0


@pytest.mark.slow
@pytest.mark.parametrize(("scope", "expected_calls"), [("global", 1), ("workspace", 4)])
def test_eight_processes_asking_at_once_merge_in_flight(
    clean_db: Engine, redis_url: str, scope: str, expected_calls: int
) -> None:
    server = CountingProvider(delay=0.5)  # each call is in flight for half a second
    key = prompt()
    spawn = mp.get_context("spawn")
    try:
        with spawn.Manager() as manager, ProcessPoolExecutor(8, mp_context=spawn) as pool:
            barrier = manager.Barrier(8)
            # 8 processes, 4 workspaces, each its own job: identical prompt everywhere.
            runs = [pool.submit(summarise, server.url, redis_url, f"ws-{i % 4}", f"job-{i}",
                                scope, key, 60.0, barrier) for i in range(8)]  # fmt: skip
            results = [r.result(timeout=120) for r in runs]
        assert server.calls == expected_calls
        paths = sorted(path for path, _, _ in results)
        assert paths.count("computed") == expected_calls
        assert set(paths) <= {"computed", "waited", "double_check", "cache_hit"}
        assert "waited" in paths  # merged on the key's lock while the call was in flight
        assert len({value for _, value, _ in results}) == 1
        assert all(filled for _, _, filled in results)
        # Every caller that did not pay has its cache_hit row, with the cost it spared.
        saved = [r for i in range(4) for r in ledger(clean_db, f"ws-{i}")]
        assert len(saved) == 8 - expected_calls
        assert {r["saved_cost"] for r in saved} <= {COST}
    finally:
        server.stop()


def test_a_provider_permit_used_outside_a_cached_computation_records_no_cost(
    clean_db: Engine, redis_url: str, llm_server: CountingProvider
) -> None:
    # The entry keeps the cost of the calls settled *while* it computed, nothing else.
    llm = provider(redis_url)
    from tests.integration.cache_callers import ask

    ask(llm_server.url, llm, "ws", "warm-up")  # settled outside any cached computation
    key = prompt()
    compute_once(
        "ws", "job", "t", check=lambda: None, compute=lambda: "no provider call",
        store=lambda v: None, cache=CacheKey("workspace", key, 60),
    )  # fmt: skip
    entry = ResultCache(clean_db).get("ws", CacheKey("workspace", key, 60))
    assert entry is not None and entry.cost is None and entry.provider is None
