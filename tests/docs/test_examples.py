"""Every fenced code block of README.md and docs/**/*.md runs as written, on the real services.

How a block is run is decided by its language tag and, optionally, an HTML comment on the
line(s) right before its fence (invisible on GitHub):

* ``python`` — executed in-process, in a fresh namespace, with the test database and Redis
  as ``ONCEFLOW_DATABASE_URL`` / ``ONCEFLOW_REDIS_URL`` and a temporary directory as the
  current directory. A block whose first line names a module (``# myproject/stages.py``)
  is written there instead (and byte-compiled); later blocks and commands import it.
* ``sh`` / ``bash`` / ``console`` — each command line is run (``\\`` continuations joined,
  comments dropped) from the repository root, ``PYTHONPATH`` pointing at the written
  modules. ``export NAME=value`` applies to the lines after it, except for the database
  and Redis URLs, which stay the test session's. ``REQUEST_ID`` stands for the last
  ``request_id`` a command printed. Long-running commands (``onceflow worker|work|beat|
  api|flower|mcp|dev-services|demo|metrics``, ``celery … worker|beat``, ``bench/*.py``) are checked
  with ``--help`` appended (the command line must parse); inside a group they are started
  instead and run until the group ends. ``make TARGET`` is checked with ``make -n``;
  ``pip install …`` and ``python -m venv …`` with ``--help`` (nothing is installed).
* ``json`` / ``yaml`` — parsed. ``js`` — checked by ``node --check``.
* no tag — a diagram or an output sample: not run.

Markers:

* ``<!-- example: NAME -->`` starts a group; ``<!-- example: NAME, continues -->`` adds the
  block to it (same Python namespace, same shell environment, same background processes).
  A group that started processes ends by waiting until no request is queued or running,
  and every request must have succeeded.
* ``<!-- example: output -->`` marks a sample of output: not run.
* ``<!-- example: skip (reason) -->`` — not run; the reason is required.

Blocks stand alone, as a reader pastes them: there is no hidden set-up, a page's modules
are its own (a block defining ``# myproject/stages.py`` serves the later blocks of that page
only), and no two groups of any page use the same request or sub-doc — a reader who follows
the pages in order on one database would otherwise see a second enqueue collapse onto the
first one's row and nothing run. Pages that a test of their own runs from top to bottom
(``OWN_TEST``) are left to it.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import yaml  # type: ignore[import-untyped]
from sqlalchemy import Engine, text

from onceflow.demo.procs import wait_for
from tests.docs.blocks import PYTHON, ROOT, Block, extract

#: Pages run, block by block in order, by a test of their own (on their own services).
OWN_TEST = {ROOT / "docs" / "tutorial" / "first-stage.md": "tests/docs/test_tutorial.py"}
DOCS = [
    ROOT / "README.md",
    *(p for p in sorted((ROOT / "docs").rglob("*.md")) if p not in OWN_TEST),
]
SHELL = {"sh", "bash", "console", "shell"}
COMMAND = r"(\$ |onceflow |celery |python3? |\.venv/bin/|make |pip |curl |docker )"
LONG_RUNNING = {
    "worker",
    "work",
    "beat",
    "api",
    "flower",
    "mcp",
    "dev-services",
    "demo",
    "metrics",
}
EXAMPLE_QUEUES = ["onceflow.wc.llm", "onceflow.wc.fallback", "onceflow"]
SESSION_VARS = {"ONCEFLOW_DATABASE_URL", "ONCEFLOW_REDIS_URL"}
# Fast retries for every process an example starts (as the acceptance tests use).
FAST = {
    "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
    "ONCEFLOW_BACKOFF_MAX_SECONDS": "1",
    "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
}


@dataclass
class Group:
    """Blocks run together (one test)."""

    name: str
    blocks: list[Block] = field(default_factory=list)


def groups() -> list[Group]:
    """The blocks of every document, grouped by their markers."""
    out: list[Group] = []
    for path in DOCS:
        named: dict[str, Group] = {}
        for block in extract(path):
            name, _, rest = block.marker.partition(",")
            name = name.strip()
            if rest.strip() == "continues":
                assert name in named, f"{block.where}: continues unknown example {name!r}"
                named[name].blocks.append(block)
                continue
            group = Group(block.where, [block])
            if name and not name.startswith(("skip", "output")):
                named[name] = group
            out.append(group)
    return out


GROUPS = groups()


def test_markers_are_known_and_skips_give_a_reason() -> None:
    """A typo in a marker must not silently skip a block."""
    for group in GROUPS:
        for block in group.blocks:
            marker = block.marker
            if marker.startswith("skip"):
                assert re.fullmatch(r"skip \(.+\)", marker), f"{block.where}: skip needs (reason)"
            elif marker:
                assert re.fullmatch(r"output|[\w-]+(, continues)?", marker), block.where


def test_untagged_blocks_are_not_commands() -> None:
    """A block with no language is never run, so it must not be code someone would run."""
    for group in GROUPS:
        for block in group.blocks:
            if block.lang == "" and not block.marker:
                first = block.code.lstrip().split("\n", 1)[0]
                assert not re.match(COMMAND, first), (
                    f"{block.where}: looks like a command; tag it ```sh"
                )


def test_no_block_hides_its_set_up() -> None:
    """What a block needs is in the block: a reader never sees code in an HTML comment."""
    for path in [*DOCS, *OWN_TEST]:
        assert "example-setup" not in path.read_text(), f"{path.relative_to(ROOT)}: hidden set-up"


#: Which group made each request and sub-doc, over the groups run in this session.
MADE_BY: dict[tuple[str, str, str], str] = {}


def _assert_own_ids(group: Group, engine: Engine) -> None:
    """The requests and sub-docs the group made are made by no other group: followed in
    order on one database, two examples would otherwise share a row."""
    with engine.connect() as conn:
        requests = conn.execute(
            text("SELECT workspace_id, request_id FROM workspace_process_requests")
        )
        sub_docs = conn.execute(text("SELECT workspace_id, sub_doc FROM workspace_sub_docs"))
        made = {("request", *r) for r in requests} | {("sub-doc", *r) for r in sub_docs}
    for kind, workspace, name in sorted(made):
        other = MADE_BY.setdefault((kind, workspace, name), group.name)
        assert other == group.name, (
            f"{group.name}: {kind} {name!r} of workspace {workspace!r} is also made by "
            f"{other}; give each example its own workspace or job ids"
        )


class Runner:
    """Runs one group's blocks: Python in-process, commands as subprocesses."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.namespace: dict[str, Any] = {"__name__": "__example__"}
        self.env: dict[str, str] = {}
        self.request_id: str | None = None
        self.background: list[tuple[subprocess.Popen[bytes], Path]] = []

    # -- modules and Python --------------------------------------------------------------
    def write_module(self, block: Block) -> None:
        """Write a ``# pkg/mod.py`` block into the temporary directory and compile it."""
        rel = block.module
        assert rel is not None
        target = self.tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in target.relative_to(self.tmp).parents:
            if str(parent) != ".":
                (self.tmp / parent / "__init__.py").touch()
        target.write_text(block.code)
        py_compile.compile(str(target), doraise=True)
        _forget_modules(self.tmp)

    def run_python(self, block: Block) -> None:
        """Execute a Python block in the group's namespace."""
        self._apply_env()
        exec(compile(block.code, block.where, "exec"), self.namespace)  # noqa: S102 - the point

    def _apply_env(self) -> None:
        os.environ.update(self.env)
        from onceflow.settings import get_settings

        get_settings.cache_clear()

    # -- commands ------------------------------------------------------------------------
    def run_shell(self, block: Block, in_group: bool) -> None:
        """Run each command line of a shell block."""
        for line in _logical_lines(block.code):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
            for command in _split(tokens, ";"):
                self.run_command(block, command, in_group)

    def run_command(self, block: Block, argv: list[str], in_group: bool) -> None:
        """Run (or check, or start) one command."""
        if not argv:
            return
        if argv[0] == "export":
            for assignment in argv[1:]:
                name, _, value = assignment.partition("=")
                if name not in SESSION_VARS:
                    self.env[name] = value
            return
        env = {**os.environ, **self.env, **FAST}
        env["PYTHONPATH"] = os.pathsep.join([str(self.tmp), str(ROOT)])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            if name not in SESSION_VARS:
                env[name] = value
        argv = [self.request_id if a == "REQUEST_ID" and self.request_id else a for a in argv]
        where = f"{block.where}: {shlex.join(argv)}"
        if argv[0] == "make":
            argv = ["make", "-n", *argv[1:]]
        elif argv[1:2] == ["install"] or argv[1:3] == ["-m", "venv"]:
            argv = [*argv, "--help"]  # installs nothing: the command line must parse
        elif _long_running(argv):
            if in_group:
                log = self.tmp / f"bg-{len(self.background)}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )  # fmt: skip
                self.background.append((proc, log))
                return
            argv = [*argv, "--help"]
        if argv[0] == "onceflow":
            stdout = self._onceflow(argv[1:], env, where)
        elif (
            argv[-1] == "--help"
            and argv[0].endswith(("/python", "python"))
            and argv[1].endswith(".py")
        ):
            stdout = _help_in_process(argv[1:], where)
        else:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert done.returncode == 0, f"{where}\nexit {done.returncode}\n{done.stderr[-2000:]}"
            stdout = done.stdout
        for out_line in stdout.splitlines():
            try:
                value = json.loads(out_line)
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("request_id"), str):
                self.request_id = value["request_id"]

    def _onceflow(self, args: list[str], env: dict[str, str], where: str) -> str:
        """Run the onceflow CLI in-process (a subprocess costs seconds of imports)."""
        from click.testing import CliRunner

        from onceflow.cli import main
        from onceflow.settings import get_settings

        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
        get_settings.cache_clear()
        try:
            result = CliRunner().invoke(main, args, env=changed, catch_exceptions=False)
        finally:
            get_settings.cache_clear()
        assert result.exit_code == 0, f"{where}\nexit {result.exit_code}\n{result.output[-2000:]}"
        return result.stdout

    def finish(self, engine: Engine) -> None:
        """With processes started: wait for requests until none is queued or running.

        Every request must have succeeded.
        """
        if not self.background:
            return

        def logs() -> str:
            return "\n".join(log.read_text(errors="replace")[-3000:] for _, log in self.background)

        def rows() -> list[Any]:
            with engine.connect() as conn:
                sql = "SELECT stage, status, error FROM workspace_process_requests ORDER BY 1"
                return list(conn.execute(text(sql)))

        try:
            wait_for(
                lambda: (rs := rows()) and all(r.status not in ("queued", "running") for r in rs),
                timeout=60, what="every request of the example to finish",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{rows()}\n{logs()}") from None
        bad = [r for r in rows() if r.status != "succeeded"]
        assert not bad, f"requests that did not succeed: {bad}\n{logs()}"

    def stop(self) -> None:
        """Stop every background process (its whole process group)."""
        for proc, _ in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)


def _help_in_process(args: list[str], where: str) -> str:
    """``python script.py … --help`` in this process (its imports are mostly loaded already)."""
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(ROOT / args[0]), *args[1:]]
    sys.path.insert(0, str((ROOT / args[0]).parent))
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(ROOT / args[0]), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    assert exit_.value.code in (0, None), f"{where}\nexit {exit_.value.code}"
    return out.getvalue()


def _logical_lines(code: str) -> Iterator[str]:
    """Command lines with backslash continuations joined."""
    pending = ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        yield pending + raw
        pending = ""
    if pending:
        yield pending


def _split(tokens: list[str], sep: str) -> Iterator[list[str]]:
    current: list[str] = []
    for token in tokens:
        if token == sep:
            yield current
            current = []
        else:
            current.append(token)
    yield current


def _long_running(argv: list[str]) -> bool:
    if argv[0] == "onceflow":
        return len(argv) > 1 and argv[1] in LONG_RUNNING
    if argv[0] == "celery":
        return "worker" in argv or "beat" in argv
    if argv[0] in ("uvicorn",):
        return True
    return len(argv) > 1 and argv[1].startswith("bench/")


def _forget_modules(tmp: Path) -> None:
    """Drop imported modules that live in the temporary directory (they were rewritten)."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if file.startswith(str(tmp)):
            del sys.modules[name]


def _earlier_modules(group: Group) -> list[Block]:
    """Module blocks of the group's own page before it; a later version of a module
    replaces an earlier one."""
    first = group.blocks[0]
    return [
        b for b in extract(first.path)
        if b.line < first.line and b.module and not b.marker.startswith("skip")
    ]  # fmt: skip


@pytest.fixture()
def runner(
    tmp_path: Path, clean_db: Engine, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Runner]:
    """A runner in a temporary directory on an empty database and empty broker queues."""
    # The broker queues the examples use, emptied: never the whole database (a neighbour's).
    redis_lib.Redis.from_url(redis_url).delete(*EXAMPLE_QUEUES)
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = Runner(tmp_path, redis_url)
    try:
        yield r
    finally:
        r.stop()
        _forget_modules(tmp_path)
        for name in r.env:
            os.environ.pop(name, None)
        from onceflow.settings import get_settings

        get_settings.cache_clear()


@pytest.mark.parametrize("group", GROUPS, ids=[g.name for g in GROUPS])
def test_example_runs_as_written(group: Group, runner: Runner, clean_db: Engine) -> None:
    """Each block (or group of blocks) does what the document says, without an error."""
    for block in _earlier_modules(group):
        runner.write_module(block)
    in_group = len(group.blocks) > 1
    for block in group.blocks:
        if block.marker.startswith(("skip", "output")):
            continue
        if block.lang in PYTHON:
            if block.module:
                runner.write_module(block)
            else:
                runner.run_python(block)
        elif block.lang in SHELL:
            runner.run_shell(block, in_group)
        elif block.lang == "json":
            json.loads(block.code)
        elif block.lang in ("yaml", "yml"):
            yaml.safe_load(block.code)
        elif block.lang in ("js", "javascript"):
            script = runner.tmp / "example.mjs"
            script.write_text(block.code)
            done = subprocess.run(["node", "--check", str(script)], capture_output=True, text=True)
            assert done.returncode == 0, f"{block.where}: {done.stderr}"
        else:
            assert block.lang in ("", "text"), f"{block.where}: no runner for ```{block.lang}"
    runner.finish(clean_db)
    _assert_own_ids(group, clean_db)
