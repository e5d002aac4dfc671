"""Enqueue: one request, a batch, or a batch on the caller's connection (in its transaction).

Mixed into :class:`~onceflow.queue.Queue`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from opentelemetry.trace import Span, SpanKind

from onceflow import tracing
from onceflow.connector import (
    AfterCommit,
    Execute,
    ExecutorConnector,
    FetchOne,
    Pooled,
    ShardGroups,
    Steps,
    Transaction,
    Using,
    all_rows,
    operation,
)
from onceflow.db import is_disconnect
from onceflow.errors import DatabaseUnavailable, InputMismatch, InvalidRequest
from onceflow.ids import (
    BRANCH_PATH_MAX,
    RequestId,
    check_id,
    check_worker_class,
    derive_request_id,
    random_request_id,
)
from onceflow.metrics import record as metrics
from onceflow.models.requests import EnqueueResult, NewRequest
from onceflow.models.status import Status, status_of
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

    settings: Settings
    resolver: Resolver | None

    # The enqueue signature repeats in each public entry point on purpose (Flow, services, Django).
    @operation
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
    ) -> Steps[EnqueueResult]:
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
        results = yield from self._enqueue(self._enqueue_params([item], now), strict)
        return results[0]

    @operation
    def enqueue_many(
        self,
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
        connection: Any = None,
    ) -> Steps[list[EnqueueResult]]:
        """Enqueue a batch in one round trip; results in the order of ``items``.

        ``INSERT … ON CONFLICT DO NOTHING``: the caller that inserted a row gets
        ``created=True``, every other caller the same id with ``created=False``.
        A row that exists with a different input is flagged ``input_mismatch``;
        with ``strict=True`` that raises :class:`InputMismatch` and nothing of
        the batch is written. ``connection`` runs it inside the caller's
        transaction: a SQLAlchemy ``Connection`` or any connector
        (:mod:`onceflow.connector`; the Django integration's for Django's
        connection); strict then writes the batch under a savepoint. Enqueues
        are counted in ``onceflow_requests_enqueued_total`` once that transaction
        commits, never if it rolls back.
        """
        if not _sized(items):
            return []
        if connection is None:
            spread = yield from self._by_shard(items)
            if spread is not None:  # a database split by workspace: one statement per shard
                if strict:
                    raise InvalidRequest(
                        "a strict batch is atomic, so it must stay on one shard: its "
                        "workspaces live on several (enqueue them per workspace)"
                    )
                return (yield from self._enqueue_spread(items, spread, now))
        params = self._enqueue_params(items, now)  # ids (random ones too) minted once, here
        if connection is not None:
            results: list[EnqueueResult] = yield Using(connection, self._enqueue(params, strict))
            return results
        return (yield from self._enqueue(params, strict))

    def _by_shard(self, items: Sequence[NewRequest]) -> Steps[list[int] | None]:
        """Each item's shard, when the items live on more than one (else None)."""
        for item in items:
            if not isinstance(item, NewRequest):
                raise InvalidRequest(f"expected NewRequest, got {type(item).__name__}")
        shards: list[int] = yield ShardGroups(tuple(item.workspace_id for item in items))
        return shards if len(set(shards)) > 1 else None

    def _enqueue_spread(
        self, items: Sequence[NewRequest], shards: list[int], now: datetime | None
    ) -> Steps[list[EnqueueResult]]:
        """``items`` of several shards: one enqueue per shard, results in input order. Each
        shard's rows commit on their own (every row is idempotent: a retry collapses)."""
        out: list[EnqueueResult | None] = [None] * len(items)
        for shard in sorted(set(shards)):
            picked = [i for i, s in enumerate(shards) if s == shard]
            params = self._enqueue_params([items[i] for i in picked], now)
            done = yield from self._enqueue(params, False)
            for i, result in zip(picked, done, strict=True):
                out[i] = result
        return [r for r in out if r is not None]

    @operation
    def enqueue_many_with(
        self,
        execute: Callable[[str, dict[str, Any]], Sequence[Mapping[str, Any]]],
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
    ) -> Steps[list[EnqueueResult]]:
        """Enqueue a batch through the caller's own executor of SQL; results as ``enqueue_many``.

        ``execute(query, params)`` runs one statement written for psycopg
        (``%(name)s`` placeholders; lists bound as arrays) and returns its rows
        as mappings: :class:`~onceflow.connector.ExecutorConnector`. The executor
        owns the connection and the transaction — nothing commits here. With
        ``strict=True`` a mismatch raises after the statement: roll back (or use a
        savepoint) to discard the rest of the batch. Nothing is counted in
        ``onceflow_requests_enqueued_total`` here (the commit is the caller's):
        count the results once committed with ``onceflow.metrics.record.enqueued``.
        Prefer ``enqueue_many(items, connection=<connector>)``.
        """
        if not _sized(items):
            return []
        params = self._enqueue_params(items, now)
        connector = ExecutorConnector(execute)
        results: list[EnqueueResult] = yield Using(connector, self._enqueue(params, strict))
        return results

    def _enqueue(self, params: dict[str, Any], strict: bool) -> Steps[list[EnqueueResult]]:
        """Insert the rows of ``params``; on a pooled connection, once more after a lost one.

        Idempotent (ON CONFLICT DO NOTHING, same ids): if the lost attempt committed, the
        retry collapses onto its rows. Traced as one ``onceflow.enqueue`` span when tracing
        is on: the rows it creates keep its context, so their runs continue its trace.
        """
        span = _enqueue_span(params) if tracing.active() else None
        if span is not None:
            params["trace_context"] = tracing.carrier_of(span)
        try:
            results = yield from self._traced_enqueue(params, strict)
        except BaseException as exc:
            if span is not None:
                tracing.ended_with(span, exc)
                span.end()
            raise
        if span is not None:
            _end_enqueue_span(span, results)
        return results

    def _traced_enqueue(self, params: dict[str, Any], strict: bool) -> Steps[list[EnqueueResult]]:
        try:
            results = yield from self._insert(params, strict)
        except DatabaseUnavailable as exc:
            if not is_disconnect(exc) or not (yield Pooled()):
                raise
            log.info("enqueue: retrying once on a fresh connection after: %s", exc)
            results = yield from self._insert(params, strict)
            # The lost attempt may have committed: then its rows read back as created=False
            # and nobody sends their wake-up. Mark them unsent: the next sweep sends them (a
            # duplicate wake-up for a row that had one is harmless).
            unsure = [r for r in results if not r.created and r.status is Status.QUEUED]
            if unsure:
                keys = {
                    "request_ids": [r.request_id for r in unsure],
                    "workspace_ids": [r.workspace_id for r in unsure],
                }
                yield Execute(sql.MARK_UNDISPATCHED_MANY, keys)
        yield AfterCommit(functools.partial(metrics.enqueued, results))
        return results

    def _insert(self, params: dict[str, Any], strict: bool) -> Steps[list[EnqueueResult]]:
        if not strict:
            # One INSERT statement is atomic on its own: no BEGIN/COMMIT round trips.
            return (yield from self._insert_rows(params, strict))
        # strict: a mismatch must roll the whole batch back (a savepoint on a caller's
        # connection).
        results: list[EnqueueResult] = yield Transaction(self._insert_rows(params, strict))
        return results

    def resolve(self, item: NewRequest) -> NewRequest:
        """``item`` completed from its stage's declaration (or the bare-queue defaults)."""
        if self.resolver is not None:
            item = self.resolver(item)
        if item.worker_class is None or item.dedupe is None or item.priority is None:
            wc, dedupe, priority = _bare_defaults(item)
            item = replace(item, worker_class=wc, dedupe=dedupe, priority=priority)
        return item

    def _enqueue_params(self, items: Sequence[NewRequest], now: datetime | None) -> dict[str, Any]:
        """The checked rows of ``items`` as ENQUEUE's parameters (``rows``: one JSON array),
        or, for one item, ENQUEUE_ONE's (its values by name); both with the columns the
        results are read by (ids, workspaces, input hashes, stages, worker classes)."""
        ids: list[str] = []
        spaces: list[str] = []
        hashes: list[str] = []
        stages: list[str] = []
        classes: list[str] = []
        rows: list[str] = []
        single: dict[str, Any] = {}
        limit = self.settings.payload_limit_bytes
        depth = self.settings.max_payload_depth
        for item in items:
            if not isinstance(item, NewRequest):
                raise InvalidRequest(f"expected NewRequest, got {type(item).__name__}")
            if self.resolver is not None:
                item = self.resolver(item)
            wc, dedupe, priority = _bare_defaults(item)  # as `resolve`, without a new item
            ws = check_id("workspace_id", item.workspace_id)
            job = check_id("job_id", item.job_id)
            stage = check_id("stage", item.stage)
            branch = check_id(
                "branch_path", item.branch_path, max_len=BRANCH_PATH_MAX, allow_empty=True
            )
            check_worker_class(wc)
            text, digest = encode_payload(item.input, limit, what="input", max_depth=depth)
            if item.request_id is not None:
                rid = check_id("request_id", item.request_id)
            elif dedupe:
                rid = derive_request_id(ws, job, branch, stage)  # each part checked above
            else:
                rid = random_request_id()
            max_attempts = _positive("max_attempts", item.max_attempts, self.settings.max_attempts)
            max_crash = _positive(
                "max_crash_attempts", item.max_crash_attempts, self.settings.max_crash_attempts
            )
            if (
                isinstance(priority, bool)
                or not isinstance(priority, int)
                or not -32768 <= priority <= 32767
            ):
                raise InvalidRequest("priority must be an integer in [-32768, 32767]")
            delay = _seconds("run_after_seconds", item.run_after_seconds)
            ids.append(rid)
            spaces.append(ws)
            hashes.append(digest)
            stages.append(stage)
            classes.append(wc)
            values = (rid, ws, job, branch, stage, dedupe, digest, wc, int(priority),
                      max_attempts, max_crash, delay)  # fmt: skip
            if len(items) == 1:  # one row is sent as its values (ENQUEUE_ONE)
                single = dict(zip(_ONE_ROW, values, strict=True))
                single["input"] = text
            else:
                rows.append(_row_json(values, text))
        params: dict[str, Any] = {
            "request_ids": ids, "workspace_ids": spaces, "input_hashes": hashes,
            "stages": stages, "worker_classes": classes,
            "now": now, "notify": self.settings.notify, **single,
            # The current span's (a hand-off's: the stage's); an enqueue puts its own span's.
            "trace_context": tracing.current_carrier() if tracing.active() else None,
        }  # fmt: skip
        if rows:
            params["rows"] = "[" + ",".join(rows) + "]"
        return params

    def _insert_rows(self, params: dict[str, Any], strict: bool) -> Steps[list[EnqueueResult]]:
        if "rows" not in params:
            return (yield from self._insert_one(params, strict))
        ids: list[str] = params["request_ids"]
        spaces: list[str] = params["workspace_ids"]
        hashes: list[str] = params["input_hashes"]
        # Rows by their key: an id a caller chose may name rows of two workspaces.
        inserted = yield from all_rows(sql.ENQUEUE, params)
        rows = {(r["workspace_id"], r["request_id"]): r for r in inserted}
        missing = [key for key in zip(spaces, ids, strict=True) if key not in rows]
        if missing:
            # Inserted by a concurrent enqueue that committed after this statement's snapshot:
            # ON CONFLICT waited for it, so a fresh snapshot (READ COMMITTED) sees it now.
            keys = {
                "request_ids": [k[1] for k in missing],
                "workspace_ids": [k[0] for k in missing],
            }
            found = yield from all_rows(sql.ENQUEUE_LOOKUP, keys)
            rows.update({(r["workspace_id"], r["request_id"]): r for r in found})
        results: list[EnqueueResult] = []
        seen: set[tuple[str, str]] = set()
        stages: list[str] = params["stages"]
        classes: list[str] = params["worker_classes"]
        for rid, ws, digest, stage, wc in zip(ids, spaces, hashes, stages, classes, strict=True):
            key = (ws, rid)
            row = rows[key]
            # The same request twice in one batch: only its first occurrence can have created it.
            created = bool(row["created"]) and key not in seen
            seen.add(key)
            stored = row["input_hash"]
            if stored != digest and strict:
                raise InputMismatch(rid, stored, digest)
            results.append(
                EnqueueResult(
                    RequestId(rid),
                    created,
                    status_of(row["status"]),
                    stored != digest,
                    stage,
                    wc,
                    ws,
                    None if created else row.get("trace_context"),
                )
            )
        return results

    def _insert_one(self, params: dict[str, Any], strict: bool) -> Steps[list[EnqueueResult]]:
        """``_insert_rows`` for one row (ENQUEUE_ONE's parameters): its one result row."""
        row = yield FetchOne(sql.ENQUEUE_ONE, params)
        if row is None:
            # Inserted by a concurrent enqueue that committed after this statement's snapshot
            # (as in _insert_rows): a fresh snapshot sees it now.
            keys = {"request_ids": params["request_ids"], "workspace_ids": params["workspace_ids"]}
            row = yield FetchOne(sql.ENQUEUE_LOOKUP, keys)
        rid, stored, digest = params["request_id"], row["input_hash"], params["input_hash"]
        if stored != digest and strict:
            raise InputMismatch(rid, stored, digest)
        status = status_of(row["status"])
        ws, stage, wc = params["workspace_id"], params["stage"], params["worker_class"]
        created = bool(row["created"])
        joined = None if created else row.get("trace_context")
        return [EnqueueResult(RequestId(rid), created, status, stored != digest,
                              stage, wc, ws, joined)]  # fmt: skip


#: Links an enqueue's span makes at most to the rows its duplicates joined.
_MAX_JOIN_LINKS = 32


def _enqueue_span(params: dict[str, Any]) -> Span:
    """The (not current) span of one enqueue statement, under the caller's current span."""
    ids: list[str] = params["request_ids"]
    if len(ids) == 1:
        attributes = tracing.attributes(
            request_id=ids[0], stage=params["stages"][0],
            worker_class=params["worker_classes"][0], workspace_id=params["workspace_ids"][0],
            operation="create",
        )  # fmt: skip
    else:
        attributes = tracing.attributes(operation="create")
        attributes["messaging.batch.message_count"] = len(ids)
    return tracing.TRACER.start_span("onceflow.enqueue", kind=SpanKind.PRODUCER,
                                     attributes=attributes)  # fmt: skip


@tracing.guarded
def _end_enqueue_span(span: Span, results: list[EnqueueResult]) -> None:
    """Count what the enqueue created and joined, link to the traces of the rows it joined."""
    created = sum(1 for r in results if r.created)
    span.set_attribute("onceflow.created", created)
    span.set_attribute("onceflow.joined", len(results) - created)
    linked = 0
    for result in results:
        if result.created or linked >= _MAX_JOIN_LINKS:
            continue
        joined = {"onceflow.request_id": result.request_id}
        for link in tracing.link_to(result.trace_context, joined):
            span.add_link(link.context, link.attributes)
            linked += 1
    span.end()


def _row_json(values: tuple[Any, ...], text: str) -> str:
    """One element of ENQUEUE's ``:rows``: the row's values, then the input's canonical JSON
    as it is. Written out (each value's type is checked by then): ``json.dumps`` builds an
    encoder per call, a third of the time of a row's parameters."""
    rid, ws, job, branch, stage, dedupe, digest, wc, priority, attempts, crash, delay = values
    return (
        f"[{_quote(rid)},{_quote(ws)},{_quote(job)},{_quote(branch)},{_quote(stage)},"
        f"{'true' if dedupe else 'false'},{_quote(digest)},{_quote(wc)},{int(priority)},"
        f"{int(attempts)},{int(crash)},{float(delay)!r},{text}]"
    )


#: JSON's string escaping (C; as json.dumps with ``ensure_ascii=False``).
_quote = json.encoder.encode_basestring


#: ENQUEUE_ONE's parameters, in the order of a row's values (and of ENQUEUE's ``:rows``
#: elements, whose input comes last).
_ONE_ROW = (
    "request_id", "workspace_id", "job_id", "branch_path", "stage", "dedupe", "input_hash",
    "worker_class", "priority", "max_attempts", "max_crash_attempts", "delay",
)  # fmt: skip


def _bare_defaults(item: NewRequest) -> tuple[Any, bool, Any]:
    """``item``'s worker class, dedupe and priority, a bare queue's defaults (``"default"``,
    True, 0) where it leaves them None; checked by the caller."""
    return (
        "default" if item.worker_class is None else item.worker_class,
        True if item.dedupe is None else bool(item.dedupe),
        0 if item.priority is None else item.priority,
    )


def _sized(items: Sequence[NewRequest]) -> bool:
    if len(items) > BATCH_MAX:
        raise InvalidRequest(f"a batch holds at most {BATCH_MAX} requests, got {len(items)}")
    return bool(items)


def _positive(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
        raise InvalidRequest(f"{name} must be an integer in [1, 1000]")
    return value
