"""The pickup's parts (bench/drain_bench.py ``--pickup-parts``): the bench's stages with
timestamp probes, for the worker processes (``bench.pickup_probe:app`` / ``:bare``) and the
enqueuing process (:func:`instrument_caller`).

Each probe appends ``<name> <time.time()> <pid>`` to the file ``ONCEFLOW_BENCH_PROBE_LOG``
(one ``write`` to an append-only file: no round trip on the measured path). Points, in the
order a pickup passes them:

* enqueuing process: ``c0`` before ``flow.enqueue`` / ``send_task``; onceflow only:
  ``c_inserted`` when ``Queue.enqueue_many`` returns (the input resolved and validated, the
  row committed), ``c_send0`` as ``app.send_task`` starts; both: ``c_sent`` when it returns;
* worker main process: ``p_recv`` (Celery's ``task_received``: the message read from the
  broker and made a request, before the pool gets it);
* pool child: ``k_recv`` as ``fast_trace_task`` starts (the job read from the pool's
  pipe), ``k_prerun`` (``task_prerun``), onceflow only: ``k_claim0`` / ``k_claim1`` around
  the runtime's claim (``onceflow.tasks.runtime._claim``); both: ``k_body`` on the body's
  first line.

Wrapping library functions is this benchmark's business only: nothing here is imported
by onceflow.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from celery.signals import task_prerun, task_received, worker_process_init

import onceflow.tasks.runtime as runtime
from bench import bench_stages
from bench.bench_stages import app, bare, flow

LOG = os.environ.get("ONCEFLOW_BENCH_PROBE_LOG", "")
ORDER = (
    "c0", "c_inserted", "c_send0", "c_sent", "p_recv", "k_recv", "k_prerun",
    "k_claim0", "k_claim1", "k_body",
)  # fmt: skip
_fd: tuple[int, int] | None = None


def mark(name: str, *, stamp: bool = True) -> None:
    global _fd
    now = time.time()
    if not LOG:
        return
    if _fd is None or _fd[0] != os.getpid():
        _fd = (os.getpid(), os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
    line = f"{name} {now!r} {os.getpid()}" if stamp else name
    os.write(_fd[1], f"{line}\n".encode())


def begin(side: str, kept: bool) -> None:
    """The line that opens one pickup's probes (``kept``: past the warm-up)."""
    mark(f"BEGIN {side}:{int(kept)}", stamp=False)


def _wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    inner = getattr(owner, attr)

    def probed(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        try:
            return inner(*args, **kwargs)
        finally:
            if after:
                mark(after)

    setattr(owner, attr, probed)


@task_received.connect
def _received(**_: Any) -> None:
    mark("p_recv")


@task_prerun.connect
def _prerun(**_: Any) -> None:
    mark("k_prerun")


@worker_process_init.connect
def _child(**_: Any) -> None:
    # The pool sends its children the job's function by reference: the child's copy is wrapped.
    import celery.app.trace as trace

    _wrap(trace, "fast_trace_task", "k_recv", None)


_wrap(runtime, "_claim", "k_claim0", "k_claim1")
_spec = flow.stages["bench_noop"]
_body = _spec.func


def _probed_body(ctx: Any, data: Any) -> Any:
    mark("k_body")
    return _body(ctx, data)


object.__setattr__(_spec, "func", _probed_body)  # a frozen StageSpec: the bench's own copy
_started = bench_stages.started


def _probed_started(tag: str, pickup: bool) -> None:
    if tag == "bare":
        mark("k_body")
    _started(tag, pickup)


bench_stages.started = _probed_started


def instrument_caller() -> None:
    """Probe the enqueuing side (this process's Flow, its queue and both apps' sends)."""
    _wrap(flow.queue, "enqueue_many", None, "c_inserted")
    _wrap(app, "send_task", "c_send0", "c_sent")
    _wrap(bare, "send_task", None, "c_sent")


def parts(path: str) -> dict[str, dict[str, float]]:
    """Per side, the p50 in ms of each step between consecutive probes, read back from the log
    (a ``BEGIN <side> <kept>`` line before each pickup; warm-up pickups are not kept)."""
    import statistics

    runs: dict[str, list[dict[str, float]]] = {"onceflow": [], "bare": []}
    current: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            name, value, *_ = line.split()
            if name == "BEGIN":
                side, kept = value.split(":")
                current = {}
                if kept == "1":
                    runs[side].append(current)
            else:
                current.setdefault(name, float(value))
    out: dict[str, dict[str, float]] = {}
    for side, rows in runs.items():
        names = [n for n in ORDER if rows and all(n in r for r in rows)]
        steps = {
            f"{a} → {b}": statistics.median(r[b] - r[a] for r in rows) * 1e3
            for a, b in itertools.pairwise(names)
        }
        steps["c0 → k_body"] = statistics.median(r["k_body"] - r["c0"] for r in rows) * 1e3
        out[side] = steps
    return out


__all__ = ["app", "bare", "begin", "flow", "instrument_caller", "mark", "parts"]
