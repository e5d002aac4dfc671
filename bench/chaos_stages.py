"""The Flow whose stages the chaos run drains (``ONCEFLOW_APP=bench.chaos_stages:flow``).

Two worker classes: ``fast`` (no-ops, op writes, hand-off sources) and ``llm`` (compute_once
cells, long heartbeating stages, hand-off targets). Every body records what it did in a
*ledger* outside the faulted path: one JSON line per event in ``$CHAOS_LEDGER_DIR/<pid>.jsonl``
(a local file survives a ``kill -9`` of its writer and every Postgres/Redis fault). Events:

* ``start`` / ``end`` — the body began / reached its last line (``end`` is written just before
  the body returns, so a completion can only follow an ``end`` of the same claim);
* ``call`` — a cell's provider call is about to be sent (with the cell's key);
* ``op`` — an op write returned, with its op id, clock, whether it was a replay, and for a
  cell's stored value the provider key of the cell (``job/column``).

Each event carries the request id, the attempt, a short hash of the claim token (never the
token), the pid and ``time.monotonic()`` (one clock for every process on the machine).

``foreign`` is a second Flow declaring other stages on the same table: the chaos run sweeps
with it to show what a foreign sweeper does to this Flow's rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from onceflow.demo.providers import llm_from_env
from onceflow.models.ops import OpModel, State, register_op
from onceflow.settings import Settings
from onceflow.tasks import Flow, StageContext

FAST = "fast"
LLM = "llm"
WORKSPACE = "chaos"
#: The stage lease (seconds); the latency scenario shortens it.
LEASE = float(os.environ.get("CHAOS_LEASE_SECONDS", "3"))
#: Hand-offs are bare ``ctx.then(stage, input)`` (the target's declaration routes them) unless
#: this is "1": then they name the worker class, for runs against older commits, where a
#: bare hand-off went to class "default".
EXPLICIT_HANDOFF = os.environ.get("CHAOS_EXPLICIT_HANDOFF", "") == "1"
#: What follows a cell's key on its prompt's first line: `` pid=<caller's pid>``.
CALLER = "pid="


class ChaosCount(OpModel):
    """Count one write of ``key``: applied twice, the count shows 2."""

    type: Literal["chaos.count"] = "chaos.count"
    key: str = Field(min_length=1, max_length=200)


def _count(state: State, op: ChaosCount) -> tuple[State, Any]:
    counts = state.setdefault("n", {})
    counts[op.key] = counts.get(op.key, 0) + 1
    return state, counts[op.key]


register_op("chaos.count", ChaosCount, _count)


# ----------------------------------------------------------------------------- ledger

_ledger_lock = threading.Lock()
_ledger: tuple[int, Any] | None = None


def token_hash(token: str) -> str:
    """The short hash of a claim token that the ledger and the audit triggers both record."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def record(event: str, ctx: StageContext, **extra: Any) -> None:
    """Append one ledger line for ``ctx``'s claim (no-op without ``CHAOS_LEDGER_DIR``)."""
    global _ledger
    directory = os.environ.get("CHAOS_LEDGER_DIR")
    if not directory:
        return
    line = json.dumps(
        {
            "e": event,
            "rid": ctx.request.request_id,
            "stage": ctx.request.stage,
            "att": ctx.attempt,
            "tok": token_hash(ctx.claim.token),
            "pid": os.getpid(),
            "t": time.monotonic(),
            **extra,
        }
    )
    with _ledger_lock:
        if _ledger is None or _ledger[0] != os.getpid():
            path = os.path.join(directory, f"{os.getpid()}.jsonl")
            _ledger = (os.getpid(), open(path, "a", buffering=1))  # noqa: SIM115 - process-long
        _ledger[1].write(line + "\n")


def _write(
    ctx: StageContext, sub_doc: str, op: dict[str, Any], key: str, cell: str | None = None
) -> None:
    result = ctx.apply_op(sub_doc, op, key=key)
    record(
        "op",
        ctx,
        op_id=result.op_id,
        sub_doc=sub_doc,
        dup=result.duplicate,
        clock=result.clock,
        cell=cell,
    )


# ----------------------------------------------------------------------------- inputs


class NoopInput(BaseModel):
    """Nothing but a tag."""

    tag: str = ""


class OpsInput(BaseModel):
    """Which op sub-doc to count in, and how many writes."""

    group: str = Field(min_length=1, max_length=100)
    writes: int = Field(default=2, ge=1, le=10)


class CellInput(BaseModel):
    """The cell (column of this request's job) to pay for once."""

    column: str = Field(min_length=1, max_length=100)


class LongInput(BaseModel):
    """How long the stage runs, heartbeating."""

    seconds: float = Field(gt=0, le=600)


class HandoffInput(BaseModel):
    """Where the hand-off comes from."""

    origin: str = Field(min_length=1, max_length=200)


# ----------------------------------------------------------------------------- stages


def _declare(flow: Flow) -> Flow:
    @flow.stage("noop", input=NoopInput, worker_class=FAST, lease_seconds=LEASE)
    def noop(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
        record("start", ctx)
        record("end", ctx)
        return {"tag": data.tag}

    @flow.stage("ops", input=OpsInput, worker_class=FAST, lease_seconds=LEASE)
    def ops(ctx: StageContext, data: OpsInput) -> dict[str, Any]:
        record("start", ctx)
        rid = ctx.request.request_id
        for i in range(data.writes):
            _write(ctx, f"ops:{data.group}", {"type": "chaos.count", "key": f"{rid}:{i}"}, f"w{i}")
        record("end", ctx)
        return {"writes": data.writes}

    @flow.stage("handoff", input=HandoffInput, worker_class=FAST, lease_seconds=LEASE)
    def handoff(ctx: StageContext, data: HandoffInput) -> dict[str, Any]:
        record("start", ctx)
        target = HandoffInput(origin=ctx.request.request_id).model_dump()
        if EXPLICIT_HANDOFF:  # older commits sent a bare hand-off to class "default"
            ctx.then("handoff_target", target, worker_class=LLM)
        else:
            ctx.then("handoff_target", target)
        record("end", ctx)
        return {"handed_off": True}

    @flow.stage("handoff_target", input=HandoffInput, worker_class=LLM, lease_seconds=LEASE)
    def handoff_target(ctx: StageContext, data: HandoffInput) -> dict[str, Any]:
        record("start", ctx)
        record("end", ctx)
        return {"origin": data.origin}

    @flow.stage("cell", input=CellInput, worker_class=LLM, lease_seconds=LEASE)
    def cell(ctx: StageContext, data: CellInput) -> dict[str, Any]:
        record("start", ctx)
        job = ctx.request.job_id
        doc = f"cells:{job}"

        def check() -> Any:
            return ctx.read_sub_doc(doc).state.get("cells", {}).get(data.column)

        def compute() -> float:
            # The caller's pid after the cell key: the stand-in tells each paid call's
            # process, so a call is explained by its own process's kill (chaos_checks).
            cell = f"{job}/{data.column}"
            prompt = f"cell: {cell} {CALLER}{os.getpid()}\nScore job {job} on {data.column!r}."
            record("call", ctx, cell=cell)
            return float(json.loads(llm_from_env().complete(prompt))["score"])

        def store(value: float) -> None:
            op = {"type": "cell.set", "column": data.column, "value": value}
            _write(ctx, doc, op, f"cell:{data.column}", cell=f"{job}/{data.column}")

        outcome = ctx.compute_once(f"cell:{data.column}", check=check, compute=compute, store=store)
        record("end", ctx, path=str(outcome.path))
        return {"value": outcome.value, "path": str(outcome.path)}

    @flow.stage("long", input=LongInput, worker_class=LLM, lease_seconds=LEASE)
    def long(ctx: StageContext, data: LongInput) -> dict[str, Any]:
        record("start", ctx)
        started = time.monotonic()
        beat = started
        while (now := time.monotonic()) - started < data.seconds:
            if now - beat >= LEASE / 3:
                ctx.heartbeat()
                beat = now
            time.sleep(min(0.1, data.seconds))
        ctx.check()
        record("end", ctx)
        return {"seconds": data.seconds}

    return flow


def build_flow(settings: Settings | None = None) -> Flow:
    """A Flow with the chaos stages (the harness builds one per scenario, on its own URLs)."""
    return _declare(Flow(settings=settings, name="onceflow-chaos"))


class ForeignInput(BaseModel):
    """Anything."""

    n: int = 0


def build_foreign(settings: Settings | None = None) -> Flow:
    """Another application's Flow on the same table: it declares none of the chaos stages."""
    other = Flow(settings=settings, name="onceflow-foreign")

    @other.stage("foreign_report", input=ForeignInput, worker_class="foreign")
    def foreign_report(ctx: StageContext, data: ForeignInput) -> dict[str, Any]:
        return {"n": data.n}

    return other


flow = build_flow()
app = flow.app
