"""The cost of tracing: the stage drain and the compute lock with tracing off, with the
OpenTelemetry SDK exporting every span, and (``--baseline``) with no tracing code at all.

    PYTHONPATH=. .venv/bin/python bench/tracing_bench.py [--quick] [--json]
        [--baseline DIR] [--only drain|lock] [--rounds N] [--requests N] [--calls N]
        [--configs 1x2,1x4]

Results and their reading: docs/benchmarks.md, "Tracing". Sides, measured in the same
rounds, in turns (:func:`bench.harness.rotated`), each round's ratio taken against the side
below it, the figure the median of the per-round ratios:

* ``baseline`` (``--baseline DIR``): the onceflow of checkout ``DIR`` (the commit before
  tracing was added), no SDK. Its processes run ``python -P`` with ``DIR`` first on
  ``PYTHONPATH``, so that neither the current directory nor the editable install wins.
* ``off``: this checkout's onceflow, tracing off: no tracer provider is installed (the
  default when no ``OTEL_*`` variable asks for one). ``off / baseline`` is what the tracing
  code costs when nobody traces.
* ``sdk``: this checkout's onceflow with ``OTEL_TRACES_EXPORTER=otlp``: the SDK's tracer
  provider with its ``BatchSpanProcessor`` (default schedule and batch sizes) and the
  OTLP/HTTP protobuf exporter, sending every span to a receiver in this process
  (``onceflow.demo.traces.TraceReceiver``, which reads each body and answers; bodies are
  decoded after the drain, to count the spans). The drain's rows carry a stored trace
  context, as rows enqueued under a traced call do. ``sdk / off`` is what tracing costs
  when every span is sampled and exported.

1. Drain: bench/drain_bench.py's gated drain (N no-op requests queued, the workers started,
   then the queue released; the rate is (N - 1) / (last finish - first finish)), onceflow's
   side only, with the workers of each side started by the same command line
   (``python -P -m celery -A bench.tracing_stages:app worker --pool prefork -c <c>
   --prefetch-multiplier 1 --without-gossip --without-mingle --without-heartbeat``),
   differing only by their environment.
2. Lock: one process per side (bench/tracing_side.py) on a private Redis, blocks of
   ``--calls`` calls of each path (an uncontended acquire + release; ``compute_once``
   computing; ``compute_once`` finding the value stored), sides in turns within each round.

Progress goes to stderr; Markdown (or ``--json``) to stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.drain_bench import Drain, drain
from bench.harness import (
    ROOT,
    Proc,
    admin_url,
    bench_redis_url,
    command_line,
    loadavg,
    log,
    per_round_ratios,
    private_redis,
    raw_connect,
    rotated,
    table,
)
from bench.http_bench import source_of
from bench.runtime_bench import REDIS_DEFAULT, bench_databases, runtime_machine
from onceflow.demo.traces import TraceReceiver

#: The worker app of every side (bench_stages' apps; tracing set up from ``OTEL_*``).
MODULE = "bench.tracing_stages"
#: Each side's ratio is taken against this one.
AGAINST = {"off": "baseline", "sdk": "off"}
LOCK_PATHS = ("pair", "computed", "preflight")
#: A stored trace context per row (a sampled W3C traceparent), for the sdk side's drains.
STORE_CONTEXT = """UPDATE workspace_process_requests
SET trace_context = '00-' || md5(request_id) || '-'
    || substr(md5(request_id || 's'), 1, 16) || '-01'"""


def side_env(
    side: str, receiver: TraceReceiver, baseline: Path | None, base: dict[str, str]
) -> dict[str, str]:
    """``base`` as a side's environment: the baseline's checkout first on ``PYTHONPATH`` for
    ``baseline``; the ``OTEL_*`` variables that turn the SDK on for ``sdk``, none otherwise."""
    env = {k: v for k, v in base.items() if not k.startswith("OTEL_")}
    if side == "baseline":
        assert baseline is not None
        env["PYTHONPATH"] = os.pathsep.join([str(baseline), base.get("PYTHONPATH", "")])
    if side == "sdk":
        env.update({
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "onceflow-bench",
        })  # fmt: skip
    return env


class SideDrain(Drain):
    """drain_bench's gated drain, its workers started as the current side's."""

    def __init__(self, *args: Any, receiver: TraceReceiver, baseline: Path | None) -> None:
        super().__init__(*args)
        self.module = MODULE
        self.receiver = receiver
        self.baseline = baseline
        self.side = "off"

    def start(self, name: str, argv: list[str], total: int = 0) -> Proc:
        # ``python -P``: no current directory first on sys.path (PYTHONPATH decides).
        argv = [argv[0], "-P", *argv[1:]] if argv[1:2] == ["-m"] else argv
        base = {**self.env, "ONCEFLOW_BENCH_TOTAL": str(total)}
        env = side_env(self.side, self.receiver, self.baseline, base)
        proc = Proc(f"{self.side}-{name}", argv, self.logdir, env)
        self.procs.append(proc)
        return proc

    def enqueue(self, kind: str, n: int, tag: str) -> float:
        seconds = super().enqueue(kind, n, tag)
        if self.side == "sdk":  # rows enqueued under a traced call keep its context
            with raw_connect(self.url) as conn:
                conn.execute(STORE_CONTEXT)
        return seconds


def bench_drain(
    b: SideDrain, sides: list[str], n: int, rounds: int, configs: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    """Per configuration, ``rounds`` rounds of one drain per side, in turns."""
    results = []
    for processes, concurrency in configs:
        runs: dict[str, list[float]] = {side: [] for side in sides}
        spans_per_request: list[float] = []
        for r in range(rounds):
            for side in rotated(sides, r):
                b.side = side
                before = len(b.receiver.spans())
                res = drain(b, "onceflow", n, processes, concurrency, f"{side}{r}p{processes}")
                runs[side].append(res["per_s"])
                if side == "sdk":  # what the workers exported by the time they stopped
                    spans_per_request.append((len(b.receiver.spans()) - before) / n)
                    if not spans_per_request[-1]:
                        log("no span was exported by the sdk side's workers")
                log(f"drain {processes}x{concurrency} round {r + 1} {side}: {res['per_s']:,.0f}/s")
        results.append({
            "processes": processes, "concurrency": concurrency,
            "per_s": {side: statistics.median(v) for side, v in runs.items()},
            "runs": runs,
            "ratios": {
                side: per_round_ratios(runs[side], runs[AGAINST[side]])
                for side in sides if AGAINST.get(side) in runs
            },
            "spans_per_request": spans_per_request,
        })  # fmt: skip
    return results


class LockSide:
    """bench/tracing_side.py for one side: blocks of calls on request."""

    def __init__(self, side: str, redis_url: str, env: dict[str, str], logdir: Path) -> None:
        self.side = side
        self._err: IO[bytes] = open(logdir / f"lock-{side}.log", "wb")  # noqa: SIM115 - closed in stop
        script = str(ROOT / "bench" / "tracing_side.py")
        self.popen = subprocess.Popen(
            [sys.executable, "-P", script, redis_url, f"onceflow-bench-lock-{side}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env,
            cwd=logdir, text=True,
        )  # fmt: skip
        self.info = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the lock side {self.side} exited: see its log")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def block(self, path: str, calls: int) -> float:
        assert self.popen.stdin is not None
        self.popen.stdin.write(f"{path} {calls}\n")
        self.popen.stdin.flush()
        return float(self._answer()["seconds"])

    def stop(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self._err.close()


def bench_lock(
    sides: list[str], receiver: TraceReceiver, baseline: Path | None, calls: int, rounds: int,
    logdir: Path,
) -> dict[str, Any]:  # fmt: skip
    """Rounds of one block per path and side, sides in turns; µs per call and ratios (of
    calls per second, as the drain's)."""
    with private_redis() as url, contextlib.ExitStack() as stack:
        procs = {}
        for side in sides:
            env = side_env(side, receiver, baseline, {**os.environ, "PYTHONPATH": str(ROOT)})
            procs[side] = LockSide(side, url, env, logdir)
            stack.callback(procs[side].stop)
        for side, proc in procs.items():
            where, traced = proc.info["onceflow"], proc.info["traced"]
            log(f"lock side {side}: onceflow from {where}, traced={traced}")
            if proc.info["traced"] != (side == "sdk"):
                raise RuntimeError(f"the lock side {side} is traced={proc.info['traced']}")
            for path in LOCK_PATHS:  # warm-up: connections, scripts, the exporter's session
                proc.block(path, max(50, calls // 10))
        per_s: dict[str, dict[str, list[float]]] = {p: {s: [] for s in sides} for p in LOCK_PATHS}
        for r in range(rounds):
            for path in LOCK_PATHS:
                for side in rotated(sides, r):
                    per_s[path][side].append(calls / procs[side].block(path, calls))
            log(f"lock round {r + 1}: " + ", ".join(
                f"{p} " + "/".join(f"{per_s[p][s][-1]:,.0f}" for s in sides) for p in LOCK_PATHS
            ))  # fmt: skip
    return {
        path: {
            "us_per_call": {s: 1e6 / statistics.median(v) for s, v in by_side.items()},
            "runs": by_side,
            "ratios": {
                s: per_round_ratios(by_side[s], by_side[AGAINST[s]])
                for s in sides
                if AGAINST.get(s) in by_side
            },
        }
        for path, by_side in per_s.items()
    }


# ---------------------------------------------------------------------------- report

LABELS = {
    "off": "tracing off / no tracing code (the commit before)",
    "sdk": "SDK + batch OTLP exporter / tracing off",
}
PATHS = {
    "pair": "acquire + release",
    "computed": "`compute_once`, computed",
    "preflight": "`compute_once`, pre-flight hit",
}


def _ratio(r: dict[str, Any]) -> str:
    spread = f"{min(r['ratios']):.3f} to {max(r['ratios']):.3f}"
    return f"{r['median']:.3f} ({spread})"


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Command: `{res['command']}` · {m['date']} · wall time {res['wall_seconds']:.0f} s",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['os']}; Python {m['python']}; "
        f"PostgreSQL {m.get('postgres')}; Redis {m.get('redis_server')}; Celery {m.get('celery')}. "
        f"Load average {res['loadavg_start']} at the start, {res['loadavg_end']} at the end.",
        f"Sides: {', '.join(res['sides'])}"
        + (f"; baseline: onceflow from {res['baseline']}" if res.get("baseline") else "")
        + ". Ratios: median of per-round ratios of rates (spread).",
        "",
    ]
    if "drain" in res:
        rows = []
        for d in res["drain"]:
            config = f"{d['processes']}x{d['concurrency']}"
            rates = " · ".join(f"{s} {d['per_s'][s]:,.0f}" for s in res["sides"])
            for side, r in d["ratios"].items():
                rows.append([config, LABELS[side], _ratio(r), rates])
            if d["spans_per_request"]:
                spans = statistics.median(d["spans_per_request"])
                rows.append([config, "spans exported per request (sdk)", f"{spans:.1f}", ""])
        lines += [f"Drain of {res['config']['requests']} no-op requests:", ""]
        lines += table(["workers", "figure", "ratio", "requests/s (medians)"], rows, "llrl")
        lines.append("")
    if "lock" in res:
        rows = []
        for path, p in res["lock"].items():
            us = " · ".join(f"{s} {p['us_per_call'][s]:.1f}" for s in res["sides"])
            for side, r in p["ratios"].items():
                rows.append([PATHS[path], LABELS[side], _ratio(r), us])
        lines += [f"Compute lock, blocks of {res['config']['calls']} calls:", ""]
        lines += table(["path", "figure", "ratio", "µs per call (medians)"], rows, "llrl")
    return "\n".join(lines)


def _config(text: str) -> tuple[int, int]:
    processes, _, concurrency = text.strip().partition("x")
    return int(processes), int(concurrency)


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests, calls and rounds")
    parser.add_argument("--only", choices=("drain", "lock"), default=None)
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="a checkout of onceflow from before tracing (its root), measured as a third side",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="requests per drain")
    parser.add_argument("--calls", type=int, default=None, help="lock calls per block")
    parser.add_argument(
        "--configs", default=None, help="drain configurations, processes x concurrency"
    )
    args = parser.parse_args(argv)
    quick: dict[str, Any] = {
        "requests": 300,
        "rounds": 2,
        "calls": 500,
        "lock_rounds": 3,
        "configs": "1x2",
    }
    full: dict[str, Any] = {
        "requests": 2_000,
        "rounds": 6,
        "calls": 2_000,
        "lock_rounds": 10,
        "configs": "1x2,1x4",
    }
    cfg = quick if args.quick else full
    cfg = {
        **cfg,
        **{k: v for k, v in (("requests", args.requests), ("calls", args.calls),
                             ("configs", args.configs)) if v is not None},
    }  # fmt: skip
    if args.rounds is not None:
        cfg["rounds"] = cfg["lock_rounds"] = args.rounds
    baseline = args.baseline.resolve() if args.baseline else None
    sides = (["baseline"] if baseline else []) + ["off", "sdk"]
    started = time.perf_counter()
    res: dict[str, Any] = {
        "command": "bench/tracing_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": cfg, "sides": sides, "onceflow": source_of(ROOT),
        "baseline": source_of(baseline) if baseline else None, "loadavg_start": loadavg(),
    }  # fmt: skip
    redis_url = bench_redis_url(REDIS_DEFAULT)
    with (
        TraceReceiver() as receiver,
        tempfile.TemporaryDirectory(prefix="onceflow-tracing-bench-") as tmp,
        bench_databases(admin_url(), False) as (url, _),
    ):
        b = SideDrain(url, None, redis_url, Path("/nonexistent"), Path(tmp),
                      receiver=receiver, baseline=baseline)  # fmt: skip
        try:
            res["machine"] = runtime_machine(b)
            if args.only in (None, "drain"):
                configs = [_config(c) for c in cfg["configs"].split(",")]
                res["drain"] = bench_drain(b, sides, cfg["requests"], cfg["rounds"], configs)
            if args.only in (None, "lock"):
                res["lock"] = bench_lock(sides, receiver, baseline, cfg["calls"],
                                         cfg["lock_rounds"], Path(tmp))  # fmt: skip
        finally:
            b.stop_all()
            b.cleanup()
        res["spans_received"] = len(receiver.spans())
        res["bad_bodies"] = receiver.bad_bodies
    res["loadavg_end"] = loadavg()
    res["wall_seconds"] = time.perf_counter() - started
    print(json.dumps(res, indent=2, default=str) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
