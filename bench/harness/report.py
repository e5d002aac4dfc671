"""The report: progress on stderr, the machine and date header, Markdown tables, the
command line with ``--json``, and the raw numbers as JSON instead of the Markdown."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg(sep: str = " ") -> str:
    """The 1, 5 and 15 minute load averages, or ``n/a``."""
    try:
        with open("/proc/loadavg") as f:
            return sep.join(f.read().split()[:3])
    except OSError:
        return "n/a"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_info(**more: Any) -> dict[str, Any]:
    """The report's header: the date, the machine, Python, then ``more`` (servers' and
    libraries' versions) in the order given."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu_model(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        **more,
    }


def psycopg_version() -> str:
    return f"{psycopg.__version__} ({psycopg.pq.__impl__})"


def ok(met: bool) -> str:
    """A target's verdict in a table cell."""
    return "met" if met else "**missed**"


def row(cells: Iterable[Any]) -> str:
    """One Markdown table row; a ``None`` cell is written ``| |``."""
    return "|" + "".join(" |" if c is None else f" {c} |" for c in cells)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """A Markdown table's lines: ``align`` has one letter a column (``l`` or ``r``; every
    column right-aligned but the first when empty)."""
    align = align or "l" + "r" * (len(header) - 1)
    return [
        row(header),
        row("---:" if a == "r" else "---" for a in align),
        *(row(r) for r in rows),
    ]


def command_line(
    doc: str | None, json_help: str = "print the raw numbers as JSON", *, full: bool = False
) -> argparse.ArgumentParser:
    """A benchmark's command line, with ``--json`` (the raw numbers on stdout instead of the
    Markdown report): described by its docstring's first paragraph, or all of it
    (``full``, as written)."""
    if full:
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    else:
        p = argparse.ArgumentParser(description=(doc or "").split("\n\n", 1)[0])
    p.add_argument("--json", action="store_true", help=json_help)
    return p


def command_header(res: dict[str, Any]) -> str:
    """A report's first line: the command that made it, its date and its wall time."""
    return (
        f"Command: `.venv/bin/python {res['command']}` · {res['machine']['date']} · wall time "
        f"{res['wall_seconds']:.0f} s"
    )


def header(info: dict[str, Any], *more: str) -> str:
    """A report's first line: the date, the CPUs, the PostgreSQL server, then ``more``."""
    return " · ".join(
        [info["date"], f"nproc {info['nproc']}", f"PostgreSQL {info['postgres']}", *more]
    )


def finish(
    results: dict[str, Any], started: float, as_json: bool, render: Callable[[Any], str]
) -> int:
    """The end of a run: the load average and the wall time into ``results``, then the
    report (:func:`emit`); the exit status."""
    results["loadavg_end"] = loadavg()
    results["wall_seconds"] = time.perf_counter() - started
    log(f"done in {results['wall_seconds']:.0f}s")
    emit(results, as_json, render)
    return 0


def emit(results: Any, as_json: bool, render: Callable[[Any], str]) -> None:
    """The run's report on stdout: the raw numbers as JSON, or ``render``'s Markdown."""
    if as_json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(render(results))
