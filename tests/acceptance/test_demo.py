"""The README's `make demo`, as a newcomer runs it: on real services, and on none."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis as redis_lib

from tests.acceptance.procs import wait_for

pytestmark = pytest.mark.slow
DEMO_PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "run-the-demo.md"


def run_demo(env: dict[str, str], *args: str) -> tuple[dict[str, Any], str]:
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    return json.loads(result.stdout), result.stderr


@contextlib.contextmanager
def redis_left_as_found(redis_url: str, ignore: tuple[bytes, ...] = ()) -> Iterator[None]:
    """Sentinels named like the demo's worker classes and maintenance queue, and a key of
    another application, in the configured database: untouched after the demo, and no new
    key left behind. Keys containing an ``ignore`` fragment belong to another test's
    processes still running beside the demo (not the demo's to keep or remove)."""
    client = redis_lib.Redis.from_url(redis_url)
    sentinel = f"sentinel-{uuid.uuid4().hex}"
    for name in ("llm", "fallback", "onceflow"):
        client.delete(name)
        client.rpush(name, sentinel)
    client.set("someone-else:key", sentinel)

    def snapshot() -> dict[bytes, Any]:
        keys = [k for k in client.scan_iter(count=1000) if not any(f in k for f in ignore)]
        contents = {k: _content(client, k) for k in keys}
        # A key that expired between the scan and its read is not there.
        return {k: v for k, v in contents.items() if v[0] != b"none"}

    before = snapshot()
    # Keys with a TTL that were there before (another test's lock or release mark) may
    # expire meanwhile: Redis removed them, not the demo. (-2: expired since the snapshot.)
    volatile = {k for k in before if client.pttl(k) != -1}
    yield
    after = snapshot()
    assert sorted(set(after) - set(before)) == []  # nothing new left behind
    expired = {k for k in volatile if k not in after}
    assert after == {k: v for k, v in before.items() if k not in expired}  # nothing changed
    assert client.lrange("llm", 0, -1) == [sentinel.encode()]
    client.delete("llm", "fallback", "onceflow", "someone-else:key")


def _content(client: redis_lib.Redis, key: bytes) -> Any:
    """A key's type and value, independent of its encoding: Redis 7.0 keeps a small set of
    strings in a hash table, whose DUMP (member order) changes when another member is
    added and removed again (the demo's workspace in ``onceflow:counters:workspaces``)."""
    kind = client.type(key)
    if kind == b"set":
        return kind, sorted(client.smembers(key))
    if kind == b"hash":
        return kind, sorted(client.hgetall(key).items())
    return kind, client.dump(key)


# The demos run side by side where nothing they check can see the other: the two on the
# configured servers share one "Redis left as found" window (a key either left behind fails it),
# and the fresh-machine one has servers of its own. Each asserts on its own report as before.


@pytest.fixture(scope="module")
def fresh_machine_demo() -> Iterator[Future[tuple[dict[str, Any], str, str]]]:
    """The fresh-machine demo (its own embedded servers), started in the background; its test
    waits for it. :func:`configured_demos` asks for it first, so it runs beside those."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_run_fresh_machine)
        yield future
        future.cancel()


@dataclass
class KeepOpen:
    """What the ``--flower --keep-open`` run showed: its terminal (stderr) text, the report
    it had printed (stdout) at the keep-open notice, whether it was still running then,
    Flower's answer then and after Ctrl-C, its exit code, and the pids still carrying its
    marker once it had exited."""

    err: str
    report: str
    open_at_notice: bool
    flower_url: str | None
    flower_status: int | None
    exit_code: int | None
    flower_after: int | None
    leftovers: list[int]


@pytest.fixture(scope="module")
def configured_demos(
    fresh_machine_demo: Future[tuple[dict[str, Any], str, str]],
    database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str], Path, KeepOpen]:
    """(no-faults run, faults run, the faults run's plot, the keep-open run), run at once on
    the configured servers, inside one :func:`redis_left_as_found` window."""
    png = tmp_path_factory.mktemp("demo") / "demo.png"
    with redis_left_as_found(redis_url), ThreadPoolExecutor(3) as pool:
        no_faults = pool.submit(_run_no_faults, database_url, redis_url)
        faults = pool.submit(_run_faults, database_url, redis_url, png)
        keep_open = pool.submit(_run_keep_open, database_url, redis_url)
        return no_faults.result(), faults.result(), png, keep_open.result()


def test_demo_without_faults_pays_exactly_one_llm_call_per_cell(
    configured_demos: tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str], Path, Any],
) -> None:
    report, _ = configured_demos[0]
    assert report["invariants_ok"] is True
    assert report["embedded_services"] is False
    assert (report["cells"], report["llm_calls"], report["llm_calls_per_cell"]) == (12, 12, 1.0)
    assert report["maps_calls"] == report["commutes"] == 4
    assert report["requests_enqueued"] > report["requests_created"] == 4 * 5  # collapsed
    assert report["requests_succeeded"] == report["requests_created"]
    assert report["leases_reclaimed"] == 0 and report["op_retries"] == 0


def _run_no_faults(database_url: str, redis_url: str) -> tuple[dict[str, Any], str]:
    return run_demo(
        {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url},
        "--no-faults", "--jobs", "4", "--columns", "3", "--clients", "6",
    )  # fmt: skip


def _run_faults(database_url: str, redis_url: str, png: Path) -> tuple[dict[str, Any], str]:
    return run_demo(
        {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url},
        "--jobs", "4", "--columns", "3", "--clients", "6", "--plot", str(png),
    )  # fmt: skip


def test_demo_with_faults_accounts_for_every_extra_call_and_plots_them(
    configured_demos: tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str], Path, Any],
) -> None:
    (report, stderr), png = configured_demos[1], configured_demos[2]
    assert report["invariants_ok"] is True, report["checks"]
    assert report["worker_killed"] is True
    assert "kill -9" in stderr
    assert report["requests_succeeded"] == report["requests_created"]
    assert 0 <= report["extra_llm_calls"] <= report["llm_calls_in_flight_at_kill"]
    assert report["leases_reclaimed"] >= 1  # the killed worker's requests were reclaimed
    assert report["op_retries"] >= 1  # dropped responses were retried, applied once
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "\r  [" not in stderr  # no progress bar off a terminal

    # The plot marks the kill and each dropped response; both y axes start at 0.
    from onceflow.demo.report import figure

    timeline = report["timeline"]
    killed_at, dropped_at = timeline["killed_at"], timeline["dropped_at"]
    assert killed_at is not None and 0 < killed_at < report["wall_seconds"]
    assert len(dropped_at) >= 1
    fig = figure(report)
    top, bottom = fig.axes
    for ax in (top, bottom):
        assert ax.get_ylim()[0] == 0
        kills = [line for line in ax.get_lines() if line.get_gid() == "kill"]
        assert [list(line.get_xdata()) for line in kills] == [[killed_at, killed_at]]
    (drops,) = [line for line in bottom.get_lines() if line.get_gid() == "dropped"]
    assert list(drops.get_xdata()) == dropped_at
    assert max(bottom.get_lines()[0].get_ydata()) > 0  # requests finished per second


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_fresh_machine() -> tuple[dict[str, Any], str, str]:
    """(report, stderr, marker) of the demo on URLs where nothing answers."""
    pg_port, redis_port = _closed_port(), _closed_port()
    marker = uuid.uuid4().hex  # inherited by every process the demo starts
    report, stderr = run_demo(
        {
            "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://127.0.0.1:{pg_port}/onceflow",
            "ONCEFLOW_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "ONCEFLOW_TEST_MARKER": marker,
        },
        "--no-faults", "--jobs", "2", "--columns", "2", "--clients", "4",
    )  # fmt: skip
    return report, stderr, marker


def test_fresh_machine_path_starts_embedded_services_and_cleans_up(
    fresh_machine_demo: Future[tuple[dict[str, Any], str, str]],
) -> None:
    report, stderr, marker = fresh_machine_demo.result(timeout=300)
    assert "starting the embedded servers" in stderr
    assert report["embedded_services"] is True
    assert report["invariants_ok"] is True
    assert report["llm_calls_per_cell"] == 1.0
    # Nothing left behind: no server, worker or beat process that the demo started survives.
    assert [p.pid for p in psutil.process_iter() if _has_marker(p, marker)] == []


def _has_marker(proc: psutil.Process, marker: str) -> bool:
    try:
        return proc.environ().get("ONCEFLOW_TEST_MARKER") == marker
    except (psutil.Error, OSError):
        return False


def _run_keep_open(database_url: str, redis_url: str) -> KeepOpen:
    """``onceflow demo --flower --keep-open`` on a terminal: wait for the keep-open notice,
    ask Flower, press Ctrl-C, and record what each step showed."""
    marker = uuid.uuid4().hex  # inherited by every process the demo starts
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url,
           "ONCEFLOW_TEST_MARKER": marker}  # fmt: skip
    primary, secondary = pty.openpty()  # stderr on a terminal: the progress bar is drawn
    err: list[str] = []
    out: list[str] = []
    demo = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "demo", "--flower", "--keep-open",
         "--jobs", "3", "--columns", "2", "--clients", "4"],
        stdout=subprocess.PIPE, stderr=secondary, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    os.close(secondary)
    readers = [
        threading.Thread(target=_read_pty, args=(primary, err), daemon=True),
        threading.Thread(target=_read_pipe, args=(demo.stdout, out), daemon=True),
    ]
    for reader in readers:
        reader.start()
    url: str | None = None
    flower_status = exit_code = None
    open_at_notice = False
    report = ""
    try:
        wait_for(lambda: "press Ctrl-C" in "".join(err) or demo.poll() is not None,
                 timeout=240, what="the report and the keep-open notice")  # fmt: skip
        open_at_notice = demo.poll() is None
        # The demo flushes its report to stdout before the notice goes to stderr, but the two
        # are read by separate threads: the pipe's reader may not have appended it yet (seen
        # in CI: an empty report). Its last row is the wall time.
        wait_for(lambda: "wall time" in "".join(out) or demo.poll() is not None,
                 timeout=30, what="the report on stdout")  # fmt: skip
        report = "".join(out)
        found = re.search(r"Flower: (http://127\.0\.0\.1:\d+)", "".join(err))
        url = found.group(1) if found else None
        if open_at_notice and url is not None:
            flower = url
            flower_status = wait_for(lambda: _http_status(flower), timeout=60, what="Flower")
            demo.send_signal(signal.SIGINT)
            exit_code = demo.wait(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
        for reader in readers:
            reader.join(timeout=10)
        os.close(primary)
    return KeepOpen(
        err="".join(err),
        report=report,
        open_at_notice=open_at_notice,
        flower_url=url,
        flower_status=flower_status,
        exit_code=exit_code,
        flower_after=_http_status(url) if url else None,
        leftovers=[p.pid for p in psutil.process_iter() if _has_marker(p, marker)],
    )


def test_keep_open_keeps_flower_until_ctrl_c_then_cleans_up_everything(
    configured_demos: tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str], Path, Any],
) -> None:
    """--flower --keep-open: after the report Flower answers; Ctrl-C stops every process the
    demo started (the kill's replacement worker too) and leaves Redis as it was (the shared
    :func:`redis_left_as_found` window of :func:`configured_demos`). On a terminal the run
    draws a progress bar, and the report it prints (faults on, as in `make demo`) has the
    sample's lines on docs/how-to/run-the-demo.md."""
    run: KeepOpen = configured_demos[3]
    assert run.open_at_notice, run.err[-3000:]
    assert run.flower_url is not None, run.err[-3000:]
    assert run.flower_status in (200, 401)  # it answers (a login is required)
    assert "all invariants hold" in run.report
    assert run.exit_code == 0
    assert "stopping and cleaning up" in run.err
    assert re.search(r"\r  \[#+-*\] +\d+/15 requests", run.err), run.err[-2000:]
    assert run.flower_after is None  # Flower is gone
    assert run.leftovers == []
    assert report_labels(page_sample()) == report_labels(run.report)


def _read_pty(fd: int, into: list[str]) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: every writer closed
            return
        if not data:
            return
        into.append(data.decode(errors="replace"))


def _read_pipe(stream: Any, into: list[str]) -> None:
    for line in iter(stream.readline, b""):
        into.append(line.decode(errors="replace"))


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def page_sample() -> str:
    """The demo page's sample report (the fenced block that starts with its title)."""
    blocks = re.findall(r"```\n(onceflow demo — .*?)```", DEMO_PAGE.read_text(), re.S)
    assert len(blocks) == 1, "the demo page has one sample demo report"
    return str(blocks[0])


def report_labels(text: str) -> list[str]:
    """The labels of a printed report, in order: row names and invariant names."""
    labels = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        check = re.match(r"\[(?:ok|BROKEN)\] (.*)", line)
        labels.append(check.group(1) if check else re.split(r"\s{2,}", line)[0])
    return labels


def test_report_labels_reads_rows_and_invariants() -> None:
    sample = "title\n  a / b   1 / 2  (x)\n\ninvariants:\n  [ok] one\n  [BROKEN] two\n"
    assert report_labels(sample) == ["title", "a / b", "invariants:", "one", "two"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_only() -> None:
    from onceflow.demo.progress import ProgressBar

    term = _Terminal()
    bar = ProgressBar(term, 500)
    bar.update(250, 400, "LLM calls 7")
    bar.close()
    assert re.search(r"^\r  \[#{15}-{15}\] 250/500 requests .*LLM calls 7", term.getvalue())
    piped = io.StringIO()
    ProgressBar(piped, 500).update(250, 400)
    assert piped.getvalue() == ""
    disabled = _Terminal()
    ProgressBar(disabled, 500, enabled=False).update(250, 400)  # --json
    assert disabled.getvalue() == ""
