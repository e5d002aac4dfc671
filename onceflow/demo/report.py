"""The demo's report: figures measured at the provider and in the tables, and the invariants."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from onceflow.demo.plan import COLUMNS, Options, Run
from onceflow.keys import counters_key

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from onceflow.demo.standins import StandIn


def build_report(
    opts: Options, run: Run, llm: StandIn, maps: StandIn, *, embedded: bool
) -> dict[str, Any]:
    """Gather every figure and check every invariant; ``invariants_ok`` is the verdict."""
    from onceflow.demo.browser import TAB_BRANCH
    from onceflow.demo.stages import flow, job_doc
    from onceflow.oplog import OpLog

    ws = run.workspace
    queue = flow.queue
    oplog = OpLog(queue.engine, queue.settings)
    rows = [r for j in range(opts.jobs)  # per job: a long run has more rows than one page
            for r in queue.list(workspace_id=ws, job_id=f"job-{j}", limit=1000)]  # fmt: skip
    per_key = llm.stats()["per_key"]
    eval_calls = Counter({k: n for k, n in per_key.items() if "/eval:" in k})
    columns = COLUMNS[: opts.columns]
    cells = opts.jobs * len(columns)
    llm_calls = sum(eval_calls.values())
    raw_stats: dict[Any, Any] = oplog.redis().hgetall(counters_key(ws))
    stats = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw_stats.items()}

    checks: dict[str, bool] = {}
    checks["every request succeeded (none lost)"] = bool(rows) and all(
        r.status.value == "succeeded" for r in rows
    )
    checks["one row per distinct request (duplicates collapsed)"] = len(rows) == run.created
    docs = {job_doc(f"job-{j}"): oplog.get_sub_doc(ws, job_doc(f"job-{j}"))
            for j in range(opts.jobs)}  # fmt: skip
    checks["every cell filled"] = all(
        all(c in d.state.get("cells", {}) for c in columns) for d in docs.values()
    )
    every_cell_paid = all(eval_calls[f"job-{j}/eval:{c}"] >= 1
                          for j in range(opts.jobs) for c in columns)  # fmt: skip
    extra = llm_calls - cells
    if opts.faults:
        checks["extra LLM calls explained by the kill"] = every_cell_paid and (
            0 <= extra <= run.eval_inflight_at_kill
        )
    else:
        checks["LLM calls per cell = 1.00"] = every_cell_paid and llm_calls == cells
    gapless = True
    ops_applied = 0
    for name in [*docs, "board"]:
        ops = oplog.ops_since(ws, name, 0, limit=10_000)
        ops_applied += len(ops)
        gapless &= [o.clock for o in ops] == list(range(1, len(ops) + 1))
        gapless &= oplog.get_sub_doc(ws, name).clock == len(ops)
    checks["clocks gapless in every sub-doc"] = gapless
    tailored = [sum(1 for o in oplog.ops_since(ws, d) if o.op_type == "merge") for d in docs]
    checks["each job's tailor write applied once"] = tailored == [1] * opts.jobs
    order = oplog.get_sub_doc(ws, "board").state.get("order", [])
    checks["no op applied twice (each card once on the board)"] = sorted(order) == sorted(run.cards)
    tab = _tab_report(run, [r for r in rows if r.branch_path == TAB_BRANCH], opts.jobs)
    if tab is not None:
        checks["the browser tab ran its stages (a PullWorker in Chromium)"] = tab["ok"]
        checks["the tab's keys in no log (the api's, the page's)"] = tab["keys_logged"] is False
    return {
        "embedded_services": embedded,
        "jobs": opts.jobs,
        "columns": len(columns),
        "clients": opts.clients,
        "faults": opts.faults,
        "requests_enqueued": run.enqueued,
        "requests_created": run.created,
        "stage_runs": sum(r.attempts for r in rows),
        "requests_succeeded": sum(1 for r in rows if r.status.value == "succeeded"),
        "cells": cells,
        "llm_calls": llm_calls,
        "llm_calls_per_cell": round(llm_calls / cells, 2) if cells else 0.0,
        "extra_llm_calls": extra,
        "llm_calls_in_flight_at_kill": run.eval_inflight_at_kill,
        "tailor_llm_calls": sum(n for k, n in per_key.items() if "/tailor:" in k),
        "maps_calls": maps.stats()["total"],
        "commutes": opts.jobs,
        "lock_preflight": stats.get("preflight_hits", 0),
        "lock_double_check": stats.get("double_check_hits", 0),
        "lock_waited": stats.get("waits_served_by_broadcast", 0)
        + stats.get("waits_served_by_recheck", 0),
        "lock_computed": stats.get("computes", 0),
        "ops_applied": ops_applied,
        "op_retries": run.op_retries,
        "leases_reclaimed": sum(r.crash_attempts for r in rows),
        "zombie_writes_rejected": stats.get("zombie_writes_rejected", 0),
        "worker_killed": run.killed_worker,
        "wall_seconds": round(time.monotonic() - run.started, 2),
        "browser": tab,
        "checks": checks,
        "invariants_ok": all(checks.values()),
        # For the plot (see figure()): seconds since the start.
        "timeline": {
            "progress": [[round(t, 3), done, calls] for t, done, calls in run.progress],
            "killed_at": None if run.killed_at is None else round(run.killed_at, 3),
            "dropped_at": [round(t, 3) for t in sorted(run.dropped_at)],
        },
    }


def _tab_report(run: Run, rows: list[Any], jobs: int) -> dict[str, Any] | None:
    """What the browser tab did (``--browser``), from its own account and the table."""
    if run.tab is None:
        return None
    status = run.tab.status
    stages = int(status.get("stages", 0))
    succeeded = sum(1 for r in rows if r.status.value == "succeeded")
    paths = {str(k): int(v) for k, v in sorted(status.get("paths", {}).items())}
    errors = [str(e)[:300] for e in status.get("stageErrors", [])]
    return {
        "stages_run": stages,
        "requests_created": int(status.get("created", 0)),
        "requests_succeeded": succeeded,
        "cells": sum(paths.values()),
        "paths": paths,
        "cards_written": int(status.get("cardsAcked", 0)),
        "leader": status.get("leader"),
        "stage_errors": errors,
        "error": run.tab.error,
        "keys_logged": run.tab.keys_logged,
        # Each of its requests ran in the tab and succeeded; its cards were acknowledged.
        "ok": run.tab.error is None
        and len(rows) == jobs
        and succeeded == jobs
        and stages >= jobs
        and int(status.get("cardsAcked", 0)) == jobs,
    }


def print_report(report: dict[str, Any]) -> None:
    """The report as a table a person can read."""
    print("\nonceflow demo — three layers, one stack")
    rows = [
        ("requests enqueued / rows created", f"{report['requests_enqueued']} / "
         f"{report['requests_created']}  (layer 1: duplicates collapse at the primary key)"),
        ("stage runs / succeeded", f"{report['stage_runs']} / {report['requests_succeeded']}"),
        ("LLM calls / cells", f"{report['llm_calls']} / {report['cells']}  = "
         f"{report['llm_calls_per_cell']:.2f} per cell  (layer 2)"),
        ("  extra calls, in flight at kill", f"{report['extra_llm_calls']}, "
         f"{report['llm_calls_in_flight_at_kill']}"),
        ("Maps calls / commutes", f"{report['maps_calls']} / {report['commutes']}"),
        ("tailor LLM calls", str(report["tailor_llm_calls"])),
        ("lock: pre-flight / double-check / waited / computed",
         f"{report['lock_preflight']} / {report['lock_double_check']} / "
         f"{report['lock_waited']} / {report['lock_computed']}"),
        ("ops applied / op retries", f"{report['ops_applied']} / {report['op_retries']}  "
         "(layer 3: retries got the original clock)"),
        ("leases reclaimed", str(report["leases_reclaimed"])),
        ("zombie writes rejected", str(report["zombie_writes_rejected"])),
        ("worker killed (kill -9)", str(report["worker_killed"])),
        ("wall time", f"{report['wall_seconds']} s"),
    ]  # fmt: skip
    tab = report.get("browser")
    if tab is not None:
        paths = ", ".join(f"{k} {v}" for k, v in tab["paths"].items()) or "none"
        rows[-1:-1] = [
            ("browser tab: stages run / its requests",
             f"{tab['stages_run']} / {tab['requests_created']}  (a PullWorker in Chromium)"),
            ("  its cells by path", paths),
            ("  its cards written (WorkspaceClient)", str(tab["cards_written"])),
        ]  # fmt: skip
        if tab["error"]:
            rows.insert(-1, ("  tab error", tab["error"]))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print("\ninvariants:")
    for name, ok in report["checks"].items():
        print(f"  [{'ok' if ok else 'BROKEN'}] {name}")
    print("\nall invariants hold" if report["invariants_ok"] else "\nINVARIANTS BROKEN")


def figure(report: dict[str, Any]) -> Figure:
    """The plot as a matplotlib Figure: provider calls per cell and requests finished per
    second over time, the kill and each dropped write response marked, both y axes from 0.

    Marks carry a ``gid``: ``"kill"`` (a vertical line on each axis) and ``"dropped"``
    (one tick per dropped response on the lower axis).
    """
    from matplotlib.figure import Figure

    timeline = report["timeline"]
    progress = timeline["progress"]
    t = [p[0] for p in progress]
    cells = max(1, report["cells"])
    fig = Figure(figsize=(8, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(t, [p[2] / cells for p in progress], label="LLM calls per cell (evaluate)")
    top.axhline(1.0, linestyle="--", color="grey", label="one call per cell")
    top.set_ylabel("provider calls per cell")
    top.set_ylim(0, max(1.5, report["llm_calls_per_cell"] + 0.25))
    rates = _rates(t, [p[1] for p in progress], window=1.0)
    bottom.plot(t, rates, color="tab:green", label="requests finished / s")
    bottom.set_ylim(0, max([1.0, *rates]) * 1.15)
    bottom.set_ylabel("requests finished / s")
    bottom.set_xlabel("seconds since start")
    killed_at = timeline["killed_at"]
    if killed_at is not None:
        for ax, label in ((top, "kill -9 of an llm worker"), (bottom, "_kill")):
            ax.axvline(killed_at, color="tab:red", linewidth=1.5, gid="kill", label=label)
        top.annotate("kill -9", xy=(killed_at, top.get_ylim()[1]), xytext=(4, -14),
                     textcoords="offset points", color="tab:red")  # fmt: skip
    dropped = timeline["dropped_at"]
    if dropped:
        bottom.plot(dropped, [0.0] * len(dropped), linestyle="none", marker="|",
                    markersize=14, color="tab:orange", gid="dropped", clip_on=False,
                    label=f"write response dropped ({len(dropped)}, each retried)")  # fmt: skip
    top.legend(loc="upper right")
    bottom.legend(loc="upper right")
    fig.suptitle(
        f"onceflow demo: {report['requests_enqueued']} enqueues → {report['requests_created']} "
        f"requests, {report['llm_calls_per_cell']:.2f} LLM calls per cell"
    )
    fig.tight_layout()
    return fig


def _rates(t: list[float], done: list[int], *, window: float) -> list[float]:
    """Requests finished per second over the last ``window`` seconds, at each sample."""
    rates: list[float] = []
    j = 0
    for i in range(len(t)):
        while t[i] - t[j] > window:
            j += 1
        span = t[i] - t[j]
        rates.append((done[i] - done[j]) / span if span > 0 else 0.0)
    return rates


def plot(report: dict[str, Any], path: str) -> None:
    """Write :func:`figure` as a PNG to ``path``."""
    figure(report).savefig(path, dpi=110)
