"""Where a pool child's CPU goes, per stage, during a drain: onceflow's stage beside the floor.

    PYTHONPATH=. .venv/bin/python bench/stage_parts.py [--n 2000] [--rounds 2] [--json]

The drain of ``bench/drain_bench.py`` (one worker process at concurrency 2, matched flags,
2,000 no-op stages; onceflow and the design's floor taking turns), with this module as the
workers' app (``bench.stage_parts:app`` / ``:bare``: the same stages). In each pool child
the thread CPU (``time.thread_time``) of named parts of a stage is summed, and every 100
stages (and as it ends) written to ``ONCEFLOW_BENCH_PARTS_DIR/<pid>.json`` with the child's
whole CPU (``time.process_time``), its full garbage collections (``gc.callbacks``) and its memory
(``/proc/self/smaps_rollup``); the bench reads each child's last write.

Why: a tight loop of the same calls in one process (``bench/claim_layers.py``) measures
the code hot in the CPU's caches; in a drain each stage runs after the pool's parent, the
Postgres backends and Redis had the cores, and the same code costs two to three times
as much. This measures it where it runs. Parts nest (``run_request`` holds ``claim``,
which holds its ``statements``): each is the whole of its calls. Each wrapped call costs
about a microsecond of its own, counted in the parts around it.

Wrapping library functions is this benchmark's business only: nothing here is imported
by onceflow.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = os.environ.get("ONCEFLOW_BENCH_PARTS_DIR", "")
#: The parts, in the order the table shows them (a stage's path, outermost first).
PARTS = (
    ("stage", "the stage task's body (onceflow: `run_stage`; floor: its function)"),
    ("run_request", "`run_request` (claim, body, completion)"),
    ("claim", "the claim (`_claim`: `Queue.claim` and its retries)"),
    ("complete", "the completion (`lifecycle.record`: `Queue.finish` or `hand_off`)"),
    ("statements", "psycopg: `Cursor.execute` + `fetchone` (both statements)"),
    ("request", "building the request (`Request.from_row`, `after_run`)"),
    ("metrics", "metrics (`claimed`, `finished`/`run_ended`, `enqueued`, `in_progress`)"),
    ("encode", "the result's JSON (`encode_json`)"),
    ("context", "`StageContext` made"),
    ("heartbeats", "heartbeat registration (`add`, `remove`)"),
    ("validate", "input validation (pydantic `model_validate`)"),
    ("worker_id", "`worker_id()`"),
)
acc: dict[str, float] = {}
stages = [0]
_gc_start = [0.0]
tt = time.thread_time


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = tt()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + tt() - t

    return timed


def _wrap(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, _timed(name, getattr(owner, attr)))


def _memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss", "Private_Dirty"):
                out[key] = int(value.split()[0])
    return out


def _dump() -> None:
    stages[0] += 1
    if stages[0] % 100 == 0:
        _write()


#: The child's frozen objects, counted at its first write: gc.get_freeze_count() walks
#: the whole frozen list (126,000 objects in a Flow's child: ~15 ms with the caches cold).
_frozen: list[int] = []
#: The CPU of the writes themselves (memory read, file written), not counted as the child's.
_spent = [0.0]


def _write(**_: Any) -> None:
    if not OUT or not stages[0]:
        return
    start = time.process_time()
    if not _frozen:
        _frozen.append(gc.get_freeze_count())
    with open(f"{OUT}/{os.getpid()}.json", "w") as f:
        data = {"stages": stages[0], "parts": acc, "cpu": start - _spent[0]}
        json.dump({**data, "memory_kb": _memory(), "gc_frozen": _frozen[0]}, f)
    _spent[0] += time.process_time() - start


def _gc(phase: str, info: dict[str, Any]) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _gc_start[0] = tt()
    else:
        acc["gc_full"] = acc.get("gc_full", 0.0) + tt() - _gc_start[0]
        acc["gc_full_n"] = acc.get("gc_full_n", 0) + 1


def _stage_task(fn: Callable[..., Any]) -> Callable[..., Any]:
    timed = _timed("stage", fn)

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return timed(*args, **kwargs)
        finally:
            _dump()

    return counted


def _classmethod(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, classmethod(_timed(name, getattr(owner, attr).__func__)))


if OUT:  # in the bench's workers only (the bench itself imports the stages once it has
    # set their settings: bench/drain_bench.py's Drain)
    import psycopg
    from celery.signals import worker_process_shutdown

    import onceflow.metrics.record as metrics
    import onceflow.queue.claims as claims
    import onceflow.tasks.runtime as runtime
    import onceflow.tasks.stage_task as flow_module
    from bench import bench_stages
    from bench.bench_stages import app, bare, flow  # noqa: F401 - the workers' apps
    from onceflow.models.requests import Request

    gc.callbacks.append(_gc)
    worker_process_shutdown.connect(_write, weak=False)  # the last stages, as the child ends
    flow_module.StageTask.run_stage = _stage_task(flow_module.StageTask.run_stage)
    bench_stages.floor_noop.run = _stage_task(bench_stages.floor_noop.run)
    _wrap(flow_module, "run_request", "run_request")
    _wrap(flow_module, "worker_id", "worker_id")
    _wrap(runtime, "_claim", "claim")
    _wrap(runtime, "record", "complete")  # the outcome's write (lifecycle.record)
    _wrap(runtime, "StageContext", "context")
    _wrap(runtime._heartbeats, "add", "heartbeats")
    _wrap(runtime._heartbeats, "remove", "heartbeats")
    _wrap(psycopg.Cursor, "execute", "statements")
    _wrap(psycopg.Cursor, "fetchone", "statements")
    _classmethod(Request, "from_row", "request")
    _wrap(Request, "after_run", "request")
    for _name in ("claimed", "finished", "run_ended", "enqueued", "in_progress"):
        if hasattr(metrics, _name):  # run_ended: Queue.finish's (older trees have none)
            _wrap(metrics, _name, "metrics")
    # encode_payload before encode_json existed: for runs against an older tree
    _wrap(claims, "encode_json" if hasattr(claims, "encode_json") else "encode_payload", "encode")
    _classmethod(bench_stages.NoopInput, "model_validate", "validate")


# ---------------------------------------------------------------------------- the bench


def run_sides(n: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    from bench import drain_bench as db
    from bench.harness import admin_url, bench_redis_url, log
    from bench.runtime_bench import bench_databases

    admin = admin_url()
    redis_url = bench_redis_url(db.REDIS_DEFAULT)
    out: dict[str, list[dict[str, Any]]] = {"onceflow": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp, bench_databases(admin, False) as (url, _):
        os.environ["ONCEFLOW_BENCH_PARTS_DIR"] = tmp  # inherited by the workers
        b = db.Drain(url, None, redis_url, Path("/nonexistent"), Path(tmp))
        b.module = "bench.stage_parts"
        try:
            for i in range(rounds):
                for kind in out:
                    for old in Path(tmp).glob("*.json"):
                        old.unlink()
                    res = db.drain(b, kind, n, 1, 2, f"parts{i}-{kind}")
                    children = [json.loads(p.read_text()) for p in Path(tmp).glob("*.json")]
                    out[kind].append({"per_s": res["per_s"], "children": children})
                    log(f"round {i + 1} {kind}: {res['per_s']:,.0f}/s")
        finally:
            b.stop_all()
            b.cleanup()
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per part, µs per stage (the median over the rounds' children); the rest likewise."""
    per: dict[str, list[float]] = {}
    for run in runs:
        for child in run["children"]:
            k = child["stages"]
            for name, value in child["parts"].items():
                scale = 1.0 if name.endswith("_n") else 1e6 / k
                per.setdefault(name, []).append(value * scale)
            per.setdefault("cpu", []).append(child["cpu"] * 1e6 / k)
            for key, kb in child["memory_kb"].items():
                per.setdefault(f"mem_{key}", []).append(kb / 1024)
            per.setdefault("gc_frozen", []).append(child["gc_frozen"])
        per.setdefault("per_s", []).append(run["per_s"])
    return {name: statistics.median(values) for name, values in per.items()}


def render(res: dict[str, dict[str, float]]) -> str:
    from bench.harness import table

    o, f = res["onceflow"], res["floor"]
    rows = [["the child's whole CPU (all threads, Celery's part too)", f"{o['cpu']:.0f}",
             f"{f['cpu']:.0f}"]]  # fmt: skip
    for name, label in PARTS:
        if name in o or name in f:
            rows.append([label, f"{o.get(name, 0):.1f}", f"{f.get(name, 0):.1f}"])
    rows += [
        [
            "full collections in the child (µs per stage; collections per child)",
            f"{o.get('gc_full', 0):.1f}; {o.get('gc_full_n', 0):.0f}",
            f"{f.get('gc_full', 0):.1f}; {f.get('gc_full_n', 0):.0f}",
        ],
        [
            "the child's memory: private dirty · PSS (MB)",
            f"{o['mem_Private_Dirty']:.1f} · {o['mem_Pss']:.1f}",
            f"{f['mem_Private_Dirty']:.1f} · {f['mem_Pss']:.1f}",
        ],
        ["objects frozen before the fork", f"{o['gc_frozen']:,.0f}", f"{f['gc_frozen']:,.0f}"],
        ["drain, stages/s (median)", f"{o['per_s']:,.0f}", f"{f['per_s']:,.0f}"],
    ]
    return "\n".join(
        table(["per stage, a pool child's thread CPU (µs)", "onceflow", "floor"], rows)
    )


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness import command_line

    parser = command_line(__doc__)
    parser.add_argument("--n", type=int, default=2000, help="stages per drain")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    runs = run_sides(args.n, args.rounds)
    res = {kind: summarize(r) for kind, r in runs.items()}
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
