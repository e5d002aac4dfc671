"""The tutorial (docs/tutorial/first-stage.md) runs as a newcomer pastes it, top to bottom.

Each shell block names its terminal on its first line (``# Terminal 2``); the test keeps one
bash state per terminal (working directory and exported variables), as a terminal does,
starting in the repository (terminal 1, "your clone") or in an empty ``$HOME``. A block's
long-running command — ``onceflow dev-services``, ``onceflow worker`` — is started in the
background, and the test goes on when its output says what the page tells the reader to
wait for; a later block in that terminal first presses Ctrl-C (SIGINT to its process
group). A ``# name.py`` block is saved in the tutorial's directory, as the page says. Each
``text`` block is the output of the shell block before it: every line of it (``…`` stands
for any text) must be a line that block printed.

Nothing is hidden or added: the services are the page's own ``onceflow dev-services``, the
settings its ``dev.env``; the scrubbed environment holds no ``ONCEFLOW_*`` variable. The
one step stood in for is the install (``python3 -m venv`` and ``pip install``, minutes of
downloads): the tutorial's ``.venv/bin/activate`` puts this test's own environment — the
same package with the same extras — on ``PATH`` instead.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from onceflow.demo.procs import wait_for
from tests.docs.blocks import PYTHON, ROOT, Block, extract

PAGE = ROOT / "docs" / "tutorial" / "first-stage.md"
TERMINAL = re.compile(r"^# Terminal (?P<n>\d+)\b")
SAVED_FILE = re.compile(r"^# (?P<name>[\w-]+\.py)\n")
#: Long-running commands, and the line the page tells the reader to wait for.
READY = {
    "onceflow dev-services": "onceflow dev services running",
    "onceflow worker": " ready.",
}
#: The install lines, stood in for (see the module's docstring).
INSTALL = ("python3 -m venv ", "pip install ")
TUTORIAL_DIR = "onceflow-tutorial"


@dataclass
class Terminal:
    """One terminal: its saved bash state, and the command it is running, if any."""

    number: int
    state: Path
    running: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    outputs: list[str] = field(default_factory=list)


class Session:
    """The reader's terminals, in a scratch ``$HOME``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir()
        self.terminals: dict[int, Terminal] = {}
        ours = str(Path(sys.executable).parent)
        path = [p for p in os.environ["PATH"].split(os.pathsep) if p != ours]
        self.env = {
            name: value for name, value in os.environ.items()
            if not name.startswith("ONCEFLOW_")
            and name not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONUNBUFFERED")
        }  # fmt: skip
        # A reader's terminal line-buffers Python's output, so the two background
        # ``ask.py`` runs of one block print whole lines; unbuffered, each ``print``
        # argument is a write of its own and the two runs' lines can interleave mid-line.
        self.env.update(HOME=str(self.home), PATH=os.pathsep.join(path))

    def terminal(self, number: int) -> Terminal:
        """Terminal ``number``; a new one opens in the clone (1) or in ``$HOME``."""
        if number not in self.terminals:
            state = self.tmp / f"terminal-{number}.sh"
            start = ROOT if number == 1 else self.home
            state.write_text(f"cd {shlex.quote(str(start))}\n")
            self.terminals[number] = Terminal(number, state)
        return self.terminals[number]

    def run(self, block: Block) -> str:
        """Run a shell block in its terminal; returns what it printed on stdout."""
        first = block.code.split("\n", 1)[0]
        named = TERMINAL.match(first)
        assert named, f"{block.where}: a block's first line names its terminal (# Terminal N)"
        term = self.terminal(int(named["n"]))
        if term.running is not None:
            self.ctrl_c(term)
        lines = [line for line in block.code.splitlines()[1:] if line.strip()]
        long_running = [i for i, line in enumerate(lines) if _ready_text(line)]
        assert long_running in ([], [len(lines) - 1]), (
            f"{block.where}: a long-running command comes last, alone"
        )
        head = lines[: long_running[0]] if long_running else lines
        out = self._foreground(term, block, [self._stand_in(block, line) for line in head])
        if long_running:
            self._background(term, block, lines[-1])
        return out

    def _stand_in(self, block: Block, line: str) -> str:
        """The line to run for ``line``: itself, or the install's stand-in."""
        if not line.startswith(INSTALL):
            return line
        if line.startswith("python3 -m venv "):
            target = Path(line.split()[-1].replace("~", str(self.home), 1))
            (target / "bin").mkdir(parents=True)
            bin_dir = shlex.quote(str(Path(sys.executable).parent))
            (target / "bin" / "activate").write_text(f'export PATH={bin_dir}:"$PATH"\n')
        return ": stood in for: " + shlex.quote(line)

    def _script(self, term: Terminal, lines: list[str], save: bool) -> str:
        body = "\n".join(lines)
        tail = f'\n{{ printf "cd %q\\n" "$PWD"; export -p; }} > {shlex.quote(str(term.state))}'
        return f"set -e\n. {shlex.quote(str(term.state))}\n{body}{tail if save else ''}\n"

    def _foreground(self, term: Terminal, block: Block, lines: list[str]) -> str:
        done = subprocess.run(
            ["bash", "-c", self._script(term, lines, save=True)], env=self.env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"{block.where}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            f"{self.logs()}"
        )
        return done.stdout

    def _background(self, term: Terminal, block: Block, line: str) -> None:
        term.log = self.tmp / f"terminal-{term.number}-{len(term.outputs)}.log"
        term.outputs.append(str(term.log))
        with open(term.log, "wb") as out:
            term.running = subprocess.Popen(
                ["bash", "-c", self._script(term, [f"exec {line}"], save=False)], env=self.env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        ready = _ready_text(line)
        assert ready is not None
        proc, log = term.running, term.log
        try:
            wait_for(
                lambda: ready in log.read_text(errors="replace") or proc.poll() is not None,
                timeout=120, what=f"{line!r} to say {ready!r}",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{block.where}: {exc}{self.logs()}") from None
        assert proc.poll() is None, f"{block.where}: {line!r} exited{self.logs()}"

    def ctrl_c(self, term: Terminal) -> int:
        """Press Ctrl-C in the terminal: SIGINT to its command's process group."""
        proc = term.running
        assert proc is not None
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
            raise AssertionError(
                f"terminal {term.number} did not stop on Ctrl-C{self.logs()}"
            ) from None
        term.running = None
        return code

    def stop_all(self) -> None:
        """Whatever still runs (after a failure): killed with its process group."""
        for term in self.terminals.values():
            if term.running is not None and term.running.poll() is None:
                os.killpg(term.running.pid, signal.SIGKILL)
                term.running.wait(timeout=15)

    def logs(self) -> str:
        parts = []
        for term in self.terminals.values():
            for log in term.outputs:
                parts.append(f"\n--- {log}\n{Path(log).read_text(errors='replace')[-3000:]}")
        return "".join(parts)


def _ready_text(line: str) -> str | None:
    for command, ready in READY.items():
        if line.startswith(command + " ") or line == command:
            return ready
    return None


def _matches(sample: str, actual: str) -> bool:
    """A sample line against an output line: ``…`` stands for any text."""
    pattern = ".*".join(re.escape(part) for part in sample.split("…"))
    return re.fullmatch(pattern, actual) is not None


@pytest.mark.slow
def test_the_tutorial_runs_as_pasted(tmp_path: Path) -> None:
    """Every block of the tutorial, in order, in its terminal: the page's outputs are what
    the commands print, and Ctrl-C stops the worker and the services cleanly."""
    text = PAGE.read_text()
    for ready in READY.values():
        assert ready.strip() in text, f"the page tells the reader to wait for {ready!r}"
    session = Session(tmp_path)
    tutorial = session.home / TUTORIAL_DIR
    last_output: tuple[Block, str] | None = None
    try:
        for block in extract(PAGE):
            if block.lang in PYTHON:
                saved = SAVED_FILE.match(block.code)
                assert saved, f"{block.where}: a Python block is a file to save (# name.py)"
                (tutorial / saved["name"]).write_text(block.code)
            elif block.lang in ("sh", "bash"):
                last_output = (block, session.run(block))
            elif block.lang == "text":
                assert last_output is not None, f"{block.where}: output of no command"
                command, printed = last_output
                lines = printed.splitlines()
                for sample in block.code.splitlines():
                    assert any(_matches(sample, line) for line in lines), (
                        f"{block.where}: {sample!r} is not in what {command.where} printed:\n"
                        f"{printed}"
                    )
            else:
                raise AssertionError(f"{block.where}: no runner for ```{block.lang}")
        # 10. Stop: Ctrl-C in the worker's terminal, then in the services'.
        for number in sorted(session.terminals, reverse=True):
            term = session.terminals[number]
            if term.running is not None:
                code = session.ctrl_c(term)
                assert code == 0, f"terminal {number} exited {code} on Ctrl-C{session.logs()}"
    finally:
        session.stop_all()
