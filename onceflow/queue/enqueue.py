"""Enqueue: one request, a batch, or a batch on the caller's connection (in its transaction).

Mixed into :class:`~onceflow.queue.Queue`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine

from onceflow.db import (
    fetch_all,
    is_disconnect,
    raw_connection,
    translate_errors,
)
from onceflow.errors import DatabaseUnavailable, InputMismatch, InvalidRequest
from onceflow.ids import (
    BRANCH_PATH_MAX,
    RequestId,
    check_id,
    check_worker_class,
    random_request_id,
    request_id_for,
)
from onceflow.metrics import record as metrics
from onceflow.models.requests import EnqueueResult, NewRequest
from onceflow.models.status import Status
from onceflow.payloads import JSON, encode_payload
from onceflow.queue import sql
from onceflow.queue.batch import _seconds
from onceflow.settings import Settings

log = logging.getLogger("onceflow.queue")

BATCH_MAX = 10_000


#: Turns a request into the one its stage's declaration makes (a Flow's ``resolve``).
Resolver = Callable[[NewRequest], NewRequest]


class EnqueueOps:
    """Enqueue operations of the layer-1 store (a mixin of :class:`~onceflow.queue.Queue`)."""

    engine: Engine
    settings: Settings
    resolver: Resolver | None

    def enqueue(
        self,
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: JSON = None,
        *,
        worker_class: str | None = None,
        dedupe: bool | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        max_crash_attempts: int | None = None,
        run_after_seconds: float = 0.0,
        request_id: str | None = None,
        strict: bool = False,
        now: datetime | None = None,
    ) -> EnqueueResult:
        """Enqueue one request; a duplicate collapses onto the existing row (``created=False``)."""
        item = NewRequest(
            workspace_id=workspace_id,
            job_id=job_id,
            stage=stage,
            branch_path=branch_path,
            input={} if input is None else input,
            worker_class=worker_class,
            dedupe=dedupe,
            priority=priority,
            max_attempts=max_attempts,
            max_crash_attempts=max_crash_attempts,
            run_after_seconds=run_after_seconds,
            request_id=request_id,
        )
        return self.enqueue_many([item], strict=strict, now=now)[0]

    def enqueue_many(
        self,
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
        connection: Connection | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue a batch in one round trip; results in the order of ``items``.

        ``INSERT … ON CONFLICT DO NOTHING``: the caller that inserted a row gets
        ``created=True``, every other caller the same id with ``created=False``.
        A row that exists with a different input is flagged ``input_mismatch``;
        with ``strict=True`` that raises :class:`InputMismatch` and nothing of
        the batch is written. ``connection`` runs it inside the caller's
        transaction; its enqueues are counted in ``onceflow_requests_enqueued_total``
        when that transaction commits (SQLAlchemy's ``commit`` event on the
        connection), never if it rolls back.
        """
        if not items:
            return []
        if len(items) > BATCH_MAX:
            raise InvalidRequest(f"a batch holds at most {BATCH_MAX} requests, got {len(items)}")
        params = self._enqueue_params(items, now)  # ids (random ones too) minted once, here
        if connection is not None:
            with translate_errors(self.engine.url):
                results = self._enqueue_on(connection, params, strict)
            metrics.enqueued_on_commit(connection, results)
            return results
        # Idempotent (ON CONFLICT DO NOTHING, same ids): after a lost connection it runs once
        # more; if the first attempt committed, the retry collapses onto its rows.
        try:
            results = self._enqueue_pooled(params, strict)
            metrics.enqueued(results)  # committed: counted
            return results
        except DatabaseUnavailable as exc:
            if not is_disconnect(exc):
                raise
            log.info("enqueue: retrying once on a fresh connection after: %s", exc)
        results = self._enqueue_pooled(params, strict)
        metrics.enqueued(results)
        # The lost attempt may have committed: then its rows read back as created=False and
        # nobody sends their wake-up. Mark them unsent: the next sweep sends them (a duplicate
        # wake-up for a row that had one is harmless).
        unsure = [r.request_id for r in results if not r.created and r.status is Status.QUEUED]
        if unsure:
            with raw_connection(self.engine) as raw:
                raw.execute(sql.Q_MARK_UNDISPATCHED_MANY, {"request_ids": unsure})
        return results

    def _enqueue_pooled(self, params: dict[str, Any], strict: bool) -> list[EnqueueResult]:
        with raw_connection(self.engine) as raw:
            if not strict:
                # One INSERT statement is atomic on its own: no BEGIN/COMMIT round trips.
                return self._enqueue_raw(raw, params, strict)
            with raw.transaction():  # strict: a mismatch must roll the whole batch back
                return self._enqueue_raw(raw, params, strict)

    def enqueue_many_with(
        self,
        execute: Callable[[str, dict[str, Any]], Sequence[Mapping[str, Any]]],
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue a batch through the caller's own executor of SQL; results as ``enqueue_many``.

        ``execute(query, params)`` runs one statement written for psycopg
        (``%(name)s`` placeholders; lists bound as arrays) and returns its rows
        as mappings. The executor owns the connection and the transaction —
        nothing commits here — so the rows land with the caller's other writes
        (the Django integration passes a cursor of Django's own connection).
        Inputs are checked before any SQL runs. With ``strict=True`` a mismatch
        raises after the statement: roll back (or use a savepoint) to discard
        the rest of the batch. Nothing is counted in ``onceflow_requests_enqueued_total``
        here (the commit is the caller's): count the results once committed with
        ``onceflow.metrics.record.enqueued(results)`` (the Django integration does, in
        ``transaction.on_commit``).
        """
        if not items:
            return []
        if len(items) > BATCH_MAX:
            raise InvalidRequest(f"a batch holds at most {BATCH_MAX} requests, got {len(items)}")
        params = self._enqueue_params(items, now)

        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            return list(execute(sql.Q_ENQUEUE_LOOKUP if lookup else sql.Q_ENQUEUE, values))

        return self._enqueue_with(run, params, strict)

    def resolve(self, item: NewRequest) -> NewRequest:
        """``item`` completed from its stage's declaration (or the bare-queue defaults)."""
        if self.resolver is not None:
            item = self.resolver(item)
        if item.worker_class is None or item.dedupe is None or item.priority is None:
            item = replace(
                item,
                worker_class="default" if item.worker_class is None else item.worker_class,
                dedupe=True if item.dedupe is None else item.dedupe,
                priority=0 if item.priority is None else item.priority,
            )
        return item

    def _enqueue_params(self, items: Sequence[NewRequest], now: datetime | None) -> dict[str, Any]:
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "request_ids", "workspace_ids", "job_ids", "branch_paths", "stages", "dedupes",
                "inputs", "input_hashes", "worker_classes", "priorities", "max_attempts",
                "max_crash_attempts", "delays",
            )
        }  # fmt: skip
        limit = self.settings.payload_limit_bytes
        depth = self.settings.max_payload_depth
        for item in items:
            if not isinstance(item, NewRequest):
                raise InvalidRequest(f"expected NewRequest, got {type(item).__name__}")
            item = self.resolve(item)
            check_id("workspace_id", item.workspace_id)
            check_id("job_id", item.job_id)
            check_id("stage", item.stage)
            check_id("branch_path", item.branch_path, max_len=BRANCH_PATH_MAX, allow_empty=True)
            check_worker_class(item.worker_class)
            text, digest = encode_payload(item.input, limit, what="input", max_depth=depth)
            if item.request_id is not None:
                rid = check_id("request_id", item.request_id)
            elif item.dedupe:
                rid = request_id_for(item.workspace_id, item.job_id, item.branch_path, item.stage)
            else:
                rid = random_request_id()
            max_attempts = _positive("max_attempts", item.max_attempts, self.settings.max_attempts)
            max_crash = _positive(
                "max_crash_attempts", item.max_crash_attempts, self.settings.max_crash_attempts
            )
            if not isinstance(item.priority, int) or not -32768 <= item.priority <= 32767:
                raise InvalidRequest("priority must be an integer in [-32768, 32767]")
            delay = _seconds("run_after_seconds", item.run_after_seconds)
            for key, value in (
                ("request_ids", rid), ("workspace_ids", item.workspace_id),
                ("job_ids", item.job_id), ("branch_paths", item.branch_path),
                ("stages", item.stage), ("dedupes", bool(item.dedupe)), ("inputs", text),
                ("input_hashes", digest), ("worker_classes", item.worker_class),
                ("priorities", item.priority), ("max_attempts", max_attempts),
                ("max_crash_attempts", max_crash), ("delays", delay),
            ):  # fmt: skip
                cols[key].append(value)
        return {**cols, "now": now, "notify": self.settings.notify}

    def _enqueue_on(
        self, conn: Connection, params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        """Enqueue on the caller's SQLAlchemy connection (inside its transaction)."""

        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            stmt = sql.ENQUEUE_LOOKUP if lookup else sql.ENQUEUE
            return list(conn.execute(stmt, values).mappings())

        return self._enqueue_with(run, params, strict)

    def _enqueue_raw(
        self, raw: psycopg.Connection[Any], params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            return fetch_all(raw, sql.Q_ENQUEUE_LOOKUP if lookup else sql.Q_ENQUEUE, values)

        return self._enqueue_with(run, params, strict)

    @staticmethod
    def _enqueue_with(
        run: Callable[[bool, dict[str, Any]], list[Any]], params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        ids: list[str] = params["request_ids"]
        hashes: list[str] = params["input_hashes"]
        rows = {r["request_id"]: r for r in run(False, params)}
        missing = [rid for rid in ids if rid not in rows]
        if missing:
            # Inserted by a concurrent enqueue that committed after this statement's snapshot:
            # ON CONFLICT waited for it, so a fresh snapshot (READ COMMITTED) sees it now.
            rows.update({r["request_id"]: r for r in run(True, {"request_ids": missing})})
        results: list[EnqueueResult] = []
        seen: set[str] = set()
        stages: list[str] = params["stages"]
        classes: list[str] = params["worker_classes"]
        for rid, digest, stage, wc in zip(ids, hashes, stages, classes, strict=True):
            row = rows[rid]
            # The same id twice in one batch: only its first occurrence can have created it.
            created = bool(row["created"]) and rid not in seen
            seen.add(rid)
            mismatch = row["input_hash"] != digest
            if mismatch and strict:
                raise InputMismatch(rid, row["input_hash"], digest)
            status = Status(row["status"])
            results.append(
                EnqueueResult(
                    RequestId(rid), created, status, mismatch, stage=stage, worker_class=wc
                )
            )
        return results


def _positive(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
        raise InvalidRequest(f"{name} must be an integer in [1, 1000]")
    return value
