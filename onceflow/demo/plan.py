"""A demo run: its options (the CLI flags), the work its clients ask for, what it observed.

Shared by the scenario that runs it (:mod:`onceflow.demo.scenario`) and the report that
checks it (:mod:`onceflow.demo.report`).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from onceflow.demo.browser import TabOutcome

#: The columns a job's evaluation may score (``--columns`` takes the first ones).
COLUMNS = ["fit", "pay", "remote", "growth", "stack", "team", "mission", "location"]
#: The sections a tailored letter is written in.
SECTIONS = ["opening", "experience", "motivation", "closing"]


# Knobs as dataclass fields (alike by shape with other records): data, not logic.
@dataclass
class Options:
    """The demo's knobs (the CLI flags)."""

    jobs: int = 6
    columns: int = 4
    clients: int = 8
    workers: int = 2
    faults: bool = True
    flower: bool = False
    timeout: float = 120.0
    log_dir: Path | None = None
    #: After the report, keep Flower, workers and beat running until Ctrl-C / SIGTERM.
    keep_open: bool = False
    #: Draw a progress bar on stderr (the CLI sets it on a TTY, never with --json).
    progress: bool = False
    #: A real headless browser tab among the clients (``onceflow api`` + Chromium).
    browser: bool = False
    #: Every process exports its spans to a local receiver; the report ends with one
    #: request's trace as a tree (``--trace``).
    trace: bool = False

    def expected_requests(self) -> int:
        """Distinct requests the clients create: 4 stages per job, plus the agent's branch,
        plus the browser tab's branch."""
        return self.jobs * (4 + (1 if self.clients >= 2 else 0) + (1 if self.browser else 0))


@dataclass
class Run:
    """What the run observed, filled in as it goes."""

    started: float = field(default_factory=time.monotonic)
    #: This run's namespace: broker key prefix and workspace id (see the module's doc).
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    enqueued: int = 0
    created: int = 0
    op_retries: int = 0
    ops_sent: int = 0
    cards: set[str] = field(default_factory=set)
    killed_worker: bool = False
    eval_inflight_at_kill: int = 0
    #: Seconds since the start of the kill, and of each dropped write response.
    killed_at: float | None = None
    dropped_at: list[float] = field(default_factory=list)
    progress: list[tuple[float, int, int]] = field(default_factory=list)
    #: What the browser tab reported (``--browser``), else None.
    tab: TabOutcome | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def workspace(self) -> str:
        """The run's workspace: its compute locks, counters and ops live under it."""
        return f"demo-{self.run_id}"

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.started


__all__ = ["COLUMNS", "SECTIONS", "Options", "Run"]
