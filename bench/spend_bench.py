"""Spend control beside the peers: one rate-limited LLM provider, W workspaces x K clients.

    PYTHONPATH=. .venv/bin/python bench/spend_bench.py [--quick | --smoke] [--json]
        [--sides naive,rate_limit,onceflow,onceflow-spend,onceflow-cache] [--plot PATH]

Results and their reading: docs/benchmarks.md, "Spend control".

The provider is ``bench/harness/provider.py``'s stand-in, a process of its own: one account
whose requests and tokens are counted over a sliding window (60 s for a real provider; the
quick run uses 3 s and the full one 10 s, limits scaled alike); beyond either limit it
answers 429 with Retry-After, and a refused call takes nothing from the window. Each
accepted call takes ``--latency`` and is billed its input tokens (the prompt's words) and
output tokens (half to all of ``max_tokens``).

The work: W workspaces, each with J jobs of C cells; each cell is one call whose prompt is
drawn from P < J x C distinct prompts of the workspace (a job's C cells are distinct, jobs
repeat one another's prompts), every workspace the same demand. K clients per workspace
each submit all of its jobs (every client in its own order; all W x K clients released
together). The sides, each on the same worker processes (``--workers`` processes of
``celery worker -P prefork -c <concurrency> --without-gossip --without-mingle
--without-heartbeat``, events off, onceflow's shipped Celery settings):

* ``naive``: a Celery task per cell per client (K x J x C tasks a workspace), retried on a
  429 by ``autoretry_for`` with exponential backoff and jitter (``retry_backoff_max`` one
  window, 50 retries);
* ``rate_limit``: the same task with Celery's ``rate_limit`` set to the provider's requests
  per window divided by the worker processes, as users do (it is per worker);
* ``onceflow``: a Flow stage per job (the K clients' enqueues of a job are one request),
  one call per cell under ``ctx.compute_once``; a 429 raises ``RetryLater(retry_after)``;
  ``onceflow beat`` sweeps;
* ``onceflow-spend``: the same stage, each call under ``Provider(...).permit(...)``
  declared with the stand-in's limits (its window ``--window-margin`` longer) and
  ``LedgerHooks``: the estimate is the prompt's tokens plus ``max_tokens``, settled with the
  stand-in's usage; a 429 is reported back (``permit.rate_limited``);
* ``onceflow-cache``: ``onceflow-spend`` with the result cache across jobs
  (``compute_once(..., cache=CacheKey(scope="workspace", key=prompt, ttl=…))``).

Each workspace has a budget of ``--budget-fraction`` of its demand's tokens (a day budget
in tokens, ``on_exceeded="fail"``): enforced on the ``onceflow-spend`` and cache sides,
the yardstick of the overrun of the others.

Reported per side: the 429s the provider sent; the fraction of its tightest limit used
(requests or tokens, whichever is higher) over the busy period's whole windows — windows
of the provider's length from its first request, the last (partial) window, where the
work runs out, left out; the wall time from the clients' release to the last cell; each
workspace's completion time and their max / median; the budget overrun (tokens billed
beyond a workspace's budget, the worst workspace); the calls the provider billed per
distinct prompt it saw; the cells done.

Postgres: ``ONCEFLOW_BENCH_DATABASE_URL`` (admin URL; a fresh database is created and
dropped). Redis: a private server of the run's own (``bench.harness.private_redis``), or
``ONCEFLOW_BENCH_REDIS_URL``. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    ROOT,
    Proc,
    admin_url,
    bench_database,
    command_line,
    database_machine,
    emit,
    finish,
    loadavg,
    log,
    private_redis,
    redis_version,
    table,
    wait_for,
)
from bench.harness.provider import (
    count_tokens,
    output_tokens,
    provider_reset,
    provider_stats,
    standin_provider,
)

SIDES = ["naive", "rate_limit", "onceflow", "onceflow-spend", "onceflow-cache"]
SPEND_SIDES = ("onceflow-spend", "onceflow-cache")
STAGE_SIDE = {"onceflow": "plain", "onceflow-spend": "spend", "onceflow-cache": "cache"}
WORDS = ["the", "job", "asks", "for", "a", "senior", "engineer", "who", "builds",
         "reliable", "data", "pipelines"]  # fmt: skip


@dataclass
class Config:
    workspaces: int
    clients: int
    jobs: int
    cells: int
    prompts: int
    window: float
    rpm: int
    tpm: int
    latency: float
    max_tokens: int
    budget_fraction: float
    workers: int
    concurrency: int
    deadline: float
    window_margin: float


PRESETS: dict[str, dict[str, Any]] = {
    "full": {"workspaces": 8, "clients": 3, "jobs": 6, "cells": 5, "prompts": 10,
             "window": 10.0, "rpm": 40, "tpm": 12_000, "deadline": 600.0},
    "quick": {"workspaces": 4, "clients": 2, "jobs": 4, "cells": 4, "prompts": 8,
              "window": 3.0, "rpm": 20, "tpm": 6_000, "deadline": 90.0},
    "smoke": {"workspaces": 2, "clients": 2, "jobs": 2, "cells": 2, "prompts": 3,
              "window": 2.0, "rpm": 6, "tpm": 2_000, "deadline": 60.0, "workers": 1,
              "concurrency": 2},
}  # fmt: skip


# ------------------------------------------------------------------------------ the work


def prompt_text(ws: str, p: int) -> str:
    """Prompt ``p`` of workspace ``ws``: 100 to 300 words, the same length in every
    workspace (so every workspace has the same demand)."""
    n = 100 + (p * 37) % 201
    body = " ".join(WORDS[(p + i) % len(WORDS)] for i in range(n - 4))
    return f"{ws} prompt {p}: {body}"


def workload(cfg: Config, ws: str) -> dict[str, list[str]]:
    """Workspace ``ws``'s jobs: C distinct prompts each, drawn from its P (the same draw in
    every workspace)."""
    rng = random.Random(7)
    return {
        f"job-{j}": [prompt_text(ws, p) for p in rng.sample(range(cfg.prompts), cfg.cells)]
        for j in range(cfg.jobs)
    }


def demand_tokens(cfg: Config, jobs: dict[str, list[str]]) -> int:
    """The tokens of a workspace's cells, each called once."""
    return sum(
        count_tokens(p) + output_tokens(p, cfg.max_tokens) for ps in jobs.values() for p in ps
    )


# ------------------------------------------------------------------------------ one side


class Bench:
    def __init__(self, cfg: Config, stack: contextlib.ExitStack, log_dir: Path) -> None:
        self.cfg = cfg
        self.stack = stack
        self.log_dir = log_dir
        self.tag = secrets.token_hex(3)
        self.keys = f"onceflow-spend-{self.tag}"
        self.procs: list[Proc] = []

    def setup(self, redis_url: str, db_url: str, provider_url: str) -> None:
        cfg = self.cfg
        per_worker = cfg.rpm * 60 / cfg.window / cfg.workers
        self.env = {
            "ONCEFLOW_DATABASE_URL": db_url,
            "ONCEFLOW_REDIS_URL": redis_url,
            "ONCEFLOW_BROKER_URL": redis_url,
            "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.2",
            "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
            "ONCEFLOW_BACKOFF_MAX_SECONDS": str(max(5.0, 2 * cfg.window)),
            "SPEND_KEYS": self.keys,
            "SPEND_PROVIDER_URL": provider_url,
            "SPEND_PROVIDER_NAME": f"spend-bench-{self.tag}",
            "SPEND_QUEUE": f"spend-{self.tag}",
            "SPEND_WINDOW": str(cfg.window),
            "SPEND_WINDOW_MARGIN": str(cfg.window_margin),
            "SPEND_RPM": str(cfg.rpm),
            "SPEND_TPM": str(cfg.tpm),
            "SPEND_RATE_LIMIT": f"{per_worker:g}/m",
            "SPEND_BACKOFF_MAX": str(cfg.window),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        os.environ.update(self.env)
        from onceflow.settings import get_settings

        get_settings.cache_clear()
        import redis

        self.r = redis.Redis.from_url(redis_url)
        self.provider_url = provider_url

    # -- processes
    def start(self, side: str, run: str) -> None:
        import bench.spend_stages as ss

        if side in STAGE_SIDE:
            app, queues = "bench.spend_stages:flow_app", ss.flow.broker_queues([ss.QUEUE])
        else:
            app, queues = "bench.spend_stages:capp", [ss.QUEUE + "-celery"]
        self.r.delete(f"{self.keys}:ready")
        for n in range(self.cfg.workers):
            argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-Q", ",".join(queues),
                    "-c", str(self.cfg.concurrency), "-P", "prefork", "-l", "WARNING",
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                    "-n", f"{run}-{n}@%h"]  # fmt: skip
            self.procs.append(Proc(f"{run}-worker-{n}", argv, self.log_dir, dict(os.environ)))

        def ready() -> bool:
            for p in self.procs:
                p.check_alive()
            return int(self.r.get(f"{self.keys}:ready") or 0) >= self.cfg.workers

        wait_for(ready, 90, f"{side}'s workers ready")
        if side in STAGE_SIDE:
            beat = [sys.executable, "-m", "onceflow.cli", "beat", "-l", "INFO",
                    "--app", "bench.spend_stages:flow"]  # fmt: skip
            proc = Proc(f"{run}-beat", beat, self.log_dir, dict(os.environ))
            self.procs.append(proc)
            proc.wait_log("beat: Starting", timeout=60)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.procs = []

    # -- one side
    def run(self, side: str) -> dict[str, Any]:
        cfg = self.cfg
        run = f"{self.tag}-{side.replace('onceflow', 'of').replace('_', '')}"
        spaces = {f"{run}-w{i}": workload(cfg, f"{run}-w{i}") for i in range(cfg.workspaces)}
        budgets = {
            ws: math.floor(cfg.budget_fraction * demand_tokens(cfg, jobs))
            for ws, jobs in spaces.items()
        }
        if side in SPEND_SIDES and cfg.budget_fraction > 0:
            from onceflow.spend import set_budget

            for ws, tokens in budgets.items():
                set_budget(ws, "day", limit_tokens=tokens, on_exceeded="fail", allow_new=True)
        provider_reset(self.provider_url)
        self.start(side, run)
        expected = (
            cfg.workspaces * cfg.jobs * (1 if side in STAGE_SIDE else cfg.clients * cfg.cells)
        )
        barrier = threading.Barrier(cfg.workspaces * cfg.clients + 1)
        errors: list[str] = []

        def client(ws: str, n: int) -> None:
            rng = random.Random(f"{ws}-{n}")
            jobs = list(spaces[ws].items())
            rng.shuffle(jobs)
            barrier.wait()
            try:
                if side in STAGE_SIDE:
                    from bench.spend_stages import flow

                    for job, prompts in jobs:
                        flow.enqueue("spend_cells", ws, job, "", {
                            "prompts": prompts, "side": STAGE_SIDE[side],
                            "max_tokens": cfg.max_tokens})  # fmt: skip
                    return
                import bench.spend_stages as ss

                task = ss.naive if side == "naive" else ss.rate_limited
                for _job, prompts in jobs:
                    for prompt in prompts:
                        task.apply_async((run, ws, prompt, cfg.max_tokens))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client, args=(ws, n), daemon=True)
                   for ws in spaces for n in range(cfg.clients)]  # fmt: skip
        for t in threads:
            t.start()
        barrier.wait()
        started = time.time()
        log(f"{side}: {cfg.workspaces} workspaces x {cfg.clients} clients released")
        complete = True
        try:
            wait_for(lambda: self.ended(side, run) >= expected, cfg.deadline, f"{side} to end", 0.1)
        except TimeoutError:
            complete = False
        wall = time.time() - started
        for t in threads:
            t.join(timeout=30)
        stats = provider_stats(self.provider_url)
        finished = self.finish_times(side, run, spaces)
        cells_done = self.cells_done(side, run, spaces)
        self.stop()
        return self.figures(side, stats, budgets, finished, started, wall, complete, cells_done,
                            errors)  # fmt: skip

    def ended(self, side: str, run: str) -> int:
        """How many of the side's units (Celery tasks, onceflow requests) have ended."""
        if side not in STAGE_SIDE:
            return int(self.r.llen(f"{self.keys}:{run}:fin"))
        from bench.harness import raw_connect

        with raw_connect(os.environ["ONCEFLOW_DATABASE_URL"]) as conn:
            row = conn.execute(
                "SELECT count(*) FROM workspace_process_requests WHERE workspace_id LIKE %s"
                " AND status IN ('succeeded', 'dead', 'cancelled')",
                (f"{run}-w%",),
            ).fetchone()
        return int(row[0]) if row else 0

    def finish_times(self, side: str, run: str, spaces: dict[str, Any]) -> dict[str, float]:
        """Each workspace's last end (epoch seconds)."""
        last: dict[str, float] = {}
        if side not in STAGE_SIDE:
            for raw in self.r.lrange(f"{self.keys}:{run}:fin", 0, -1):
                ws, at, _ = json.loads(raw)
                last[ws] = max(last.get(ws, 0.0), at)
            return last
        from bench.harness import raw_connect

        with raw_connect(os.environ["ONCEFLOW_DATABASE_URL"]) as conn:
            rows = conn.execute(
                "SELECT workspace_id, extract(epoch FROM max(finished_at))::float8"
                " FROM workspace_process_requests WHERE workspace_id LIKE %s GROUP BY 1",
                (f"{run}-w%",),
            ).fetchall()
        return {ws: at for ws, at in rows if at is not None}

    def cells_done(self, side: str, run: str, spaces: dict[str, dict[str, list[str]]]) -> int:
        if side not in STAGE_SIDE:
            # A cell is done once one of the K clients' tasks for it succeeded.
            done: dict[str, int] = {}
            for raw in self.r.lrange(f"{self.keys}:{run}:fin", 0, -1):
                ws, _, success = json.loads(raw)
                done[ws] = done.get(ws, 0) + int(success)
            return sum(min(n // self.cfg.clients, self.cfg.jobs * self.cfg.cells)
                       for n in done.values())  # fmt: skip
        from bench.spend_stages import flow, job_doc
        from onceflow.context import oplog_for

        oplog = oplog_for(flow.queue)
        return sum(
            len(oplog.get_sub_doc(ws, job_doc(job)).state.get("cells", {}))
            for ws, jobs in spaces.items()
            for job in jobs
        )

    def figures(self, side: str, stats: dict[str, Any], budgets: dict[str, int],
                finished: dict[str, float], started: float, wall: float, complete: bool,
                cells_done: int, errors: list[str]) -> dict[str, Any]:  # fmt: skip
        cfg = self.cfg
        used = limit_used(stats)
        times = sorted(finished.get(ws, started + wall) - started for ws in budgets)
        median = statistics.median(times) if times else 0.0
        per_ws = stats["per_workspace"]
        overruns = {
            ws: max(0, per_ws.get(ws, {}).get("tokens", 0) - b) for ws, b in budgets.items()
        }
        if cfg.budget_fraction <= 0:  # no budget: nothing to overrun
            overruns = dict.fromkeys(budgets, 0)
        worst = max(overruns, key=lambda ws: overruns[ws]) if overruns else None
        calls, distinct = stats["accepted"], stats["distinct_prompts"]
        mean_call = stats["tokens"] / calls if calls else 0.0
        in_flight = cfg.workers * cfg.concurrency
        bound = in_flight * (max(count_tokens(prompt_text("x", p)) for p in range(cfg.prompts))
                             + cfg.max_tokens)  # fmt: skip
        res = {
            "side": side,
            "complete": complete,
            "wall_seconds": wall,
            "requests": stats["requests"],
            "rejected_429": stats["rejected"],
            "calls": calls,
            "tokens": stats["tokens"],
            **used,
            "completion_seconds": times,
            "completion_max_over_median": (times[-1] / median) if median else None,
            "budget_tokens": budgets[worst] if worst else None,
            "budget_enforced": side in SPEND_SIDES and cfg.budget_fraction > 0,
            "overrun_tokens": overruns[worst] if worst else 0,
            "overrun_fraction": overruns[worst] / budgets[worst] if worst and budgets[worst] else 0,
            "overrun_calls": (overruns[worst] / mean_call) if worst and mean_call else 0.0,
            "overrun_bound_tokens": bound,
            "distinct_prompts": stats["distinct_prompts"],
            "calls_per_distinct_prompt": calls / distinct if distinct else None,
            "max_calls_per_prompt": stats["max_calls_per_prompt"],
            "cells": cfg.workspaces * cfg.jobs * cfg.cells,
            "cells_done": cells_done,
            "most_in_a_window": stats["most_in_a_window"],
            "errors": errors[:5],
        }  # fmt: skip
        log(
            f"  {side}: {res['rejected_429']} 429s, {res['calls']} calls, limit used "
            f"{res['limit_used']:.0%} ({res['tightest']}), wall {wall:.1f}s, max/median "
            f"{res['completion_max_over_median'] or 0:.2f}, overrun {res['overrun_tokens']} tokens,"
            f" {res['calls_per_distinct_prompt'] or 0:.2f} calls/prompt, cells "
            f"{cells_done}/{res['cells']}{'' if complete else ' INCOMPLETE'}"
        )
        return res


def limit_used(stats: dict[str, Any]) -> dict[str, Any]:
    """The fraction of the provider's limits used over the busy period's whole windows."""
    arrivals = stats["arrivals"]
    window, rpm, tpm = stats["window_seconds"], stats["rpm"], stats["tpm"]
    if not arrivals:
        return {"limit_used": 0.0, "tightest": "rpm", "requests_used": 0.0, "tokens_used": 0.0,
                "busy_seconds": 0.0, "windows": 0}  # fmt: skip
    t0 = stats["first_arrival"]
    busy = arrivals[-1][0] - t0
    n = int(busy // window) + 1
    whole = max(1, n - 1)
    inside = [(at, tok) for at, tok in arrivals if n == 1 or at < t0 + whole * window]
    req = len(inside) / (rpm * whole)
    tok = sum(t for _, t in inside) / (tpm * whole)
    return {
        "limit_used": max(req, tok),
        "tightest": "rpm" if req >= tok else "tpm",
        "requests_used": req,
        "tokens_used": tok,
        "busy_seconds": busy,
        "windows": whole,
    }


# ------------------------------------------------------------------------------ report


def verdicts(r: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's targets, for one side (None: not applicable, no budget enforced)."""
    return {
        "no_429_90pct": r["rejected_429"] == 0 and r["limit_used"] >= 0.9,
        "overrun_within_in_flight": (
            r["overrun_tokens"] <= r["overrun_bound_tokens"] if r["budget_enforced"] else None
        ),
        "one_call_per_prompt": (r["calls_per_distinct_prompt"] or 0) <= 1.0,
        "fair_2x": (r["completion_max_over_median"] or 0) <= 2.0,
    }


def render(res: dict[str, Any]) -> str:
    cfg = res["config"]
    m = res["machine"]
    lines = [
        f"{m['date']} · {m['cpu']} · nproc {m['nproc']} · load average {res['loadavg_start']}"
        f" → {res['loadavg_end']} · PostgreSQL {m['postgres']} · Redis {m['redis']} · "
        f"Celery {m['celery']} · wall time {res['wall_seconds']:.0f} s",
        "",
        f"`.venv/bin/python {res['command']}`",
        "",
        f"W={cfg['workspaces']} workspaces x K={cfg['clients']} clients x J={cfg['jobs']} jobs"
        f" x C={cfg['cells']} cells ({cfg['prompts']} distinct prompts a workspace); provider "
        f"{cfg['rpm']} requests and {cfg['tpm']} tokens per {cfg['window']:g} s window, "
        f"{cfg['latency'] * 1000:.0f} ms a call; budget {cfg['budget_fraction']:.0%} of a "
        f"workspace's demand; {cfg['workers']} worker processes x {cfg['concurrency']}.",
        "",
    ]
    rows = []
    for r in res["sides"]:
        if r.get("skipped"):
            rows.append([r["side"], "not run: " + r["skipped"], *[""] * 7])
            continue
        v = verdicts(r)
        overrun = (
            f"{r['overrun_tokens']} ({r['overrun_fraction']:.0%}, {r['overrun_calls']:.1f} calls)"
        )
        if not r["budget_enforced"]:
            overrun += " (no budget)"
        rows.append([
            r["side"], r["rejected_429"],
            f"{r['limit_used']:.0%} {r['tightest']}",
            f"{r['wall_seconds']:.1f}" + ("" if r["complete"] else " (deadline)"),
            f"{r['completion_max_over_median']:.2f}" if r["completion_max_over_median"] else "",
            overrun,
            f"{r['calls_per_distinct_prompt']:.2f}" if r["calls_per_distinct_prompt"] else "",
            f"{r['cells_done']}/{r['cells']}",
            ", ".join(k for k, good in (("429s/90%", v["no_429_90pct"]),
                      ("budget", v["overrun_within_in_flight"]),
                      ("1 call/prompt", v["one_call_per_prompt"]), ("fair", v["fair_2x"]))
                      if good) or "none",
        ])  # fmt: skip
    lines += table(
        ["side", "429s", "limit used", "wall s", "finish max/median", "budget overrun, tokens",
         "calls / distinct prompt", "cells done", "targets met"],
        rows,
    )  # fmt: skip
    lines += [
        "",
        "Targets: 0 provider 429s while using >= 90 % of the tightest limit; no budget overrun "
        f"beyond the calls in flight ({res['sides'][0].get('overrun_bound_tokens', '?')} tokens "
        "here); 1.00 calls per distinct prompt; no workspace finishing more than 2x later than "
        "the median.",
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """The report as four bar charts, an SVG with its text as text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "onceflow-spend-bench"})
    sides = [r for r in res["sides"] if not r.get("skipped")]
    names = [r["side"].replace("onceflow-", "onceflow-\n") for r in sides]
    colours = ["#c44e52" if r["side"] in ("naive", "rate_limit") else
               "#dd8452" if r["side"] == "onceflow" else "#4c72b0" for r in sides]  # fmt: skip
    panels = [
        ("429s from the provider", [r["rejected_429"] for r in sides], None),
        ("share of the tightest limit used", [100 * r["limit_used"] for r in sides], 90),
        ("budget overrun, % of the budget", [100 * r["overrun_fraction"] for r in sides], None),
        ("calls per distinct prompt", [r["calls_per_distinct_prompt"] or 0 for r in sides], 1),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    for ax, (title, values, target) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(sides)), values, color=colours)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 10 else f"{v:.2g}" for v in values],
                     fontsize=8)  # fmt: skip
        if target is not None:
            ax.axhline(target, color="#444", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(sides)), names, fontsize=7)
        ax.margins(y=0.15)
    cfg = res["config"]
    fig.suptitle(
        f"W={cfg['workspaces']} x K={cfg['clients']} x J={cfg['jobs']} x C={cfg['cells']}, "
        f"{cfg['rpm']} req / {cfg['tpm']} tokens per {cfg['window']:g} s; "
        f"{res['machine']['date'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    log(f"plot written to {path}")


def main() -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="a run of about 2 minutes")
    parser.add_argument("--smoke", action="store_true", help="the smallest settings (tests)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--budget-fraction", type=float, default=0.8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--window-margin",
        type=float,
        default=0.1,
        help="seconds the Provider's window is declared beyond the stand-in's",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the SVG chart here")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no run: the report (and --plot) of a run's --json output",
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        if args.plot:
            plot(saved, args.plot)
        emit(saved, args.json, render)
        return 0
    preset = dict(PRESETS["smoke" if args.smoke else "quick" if args.quick else "full"])
    cfg = Config(
        latency=args.latency, max_tokens=args.max_tokens, budget_fraction=args.budget_fraction,
        window_margin=args.window_margin, **{"workers": args.workers,
                                             "concurrency": args.concurrency, **preset},
    )  # fmt: skip
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(SIDES)}")

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "command": "bench/spend_bench.py " + " ".join(sys.argv[1:]),
        "config": cfg.__dict__,
        "loadavg_start": loadavg(),
        "sides": [],
    }
    with contextlib.ExitStack() as stack:
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_url = os.environ.get("ONCEFLOW_BENCH_REDIS_URL") or stack.enter_context(
            private_redis()
        )
        db_url = stack.enter_context(bench_database(admin_url(), prefix="onceflow_spend"))
        provider_url = stack.enter_context(
            standin_provider(
                rpm=cfg.rpm, tpm=cfg.tpm, window=cfg.window, latency=cfg.latency, logdir=log_dir
            )
        )
        bench = Bench(cfg, stack, log_dir)
        bench.setup(redis_url, db_url, provider_url)
        stack.callback(bench.stop)
        import celery

        results["machine"] = database_machine(
            db_url, redis=redis_version(redis_url), celery=celery.__version__
        )
        for side in sides:
            results["sides"].append(bench.run(side))
        if bench.r is not None and os.environ.get("ONCEFLOW_BENCH_REDIS_URL"):
            keys = list(bench.r.scan_iter(match=f"*{bench.tag}*", count=1000))
            if keys:
                bench.r.delete(*keys)
    if args.plot:
        results.setdefault("loadavg_end", loadavg())
        results.setdefault("wall_seconds", time.perf_counter() - t0)
        plot(results, args.plot)
    return finish(results, t0, args.json, render)


if __name__ == "__main__":
    sys.exit(main())
