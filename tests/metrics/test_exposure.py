"""/metrics on a real `onceflow api` (operator key, viewer role) and the exporter's answer
when the database is down."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.integrations.fastapi.auth import hash_key
from onceflow.keys import queue_name
from tests.acceptance.procs import ROOT, Proc, api_server, free_port, wait_for
from tests.metrics.scrape import parse, total

APP = "tests.metrics.stages:flow"
VIEWER, ADMIN, API_KEY = "viewer-key-" + "v" * 20, "admin-key-" + "a" * 20, "api-key-" + "k" * 20


def get(
    url: str, key: str | None = None, method: str = "GET", body: object = None
) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - a test URL
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_api_metrics_need_a_viewer_key_and_count_routes_by_template(
    tmp_path: Path, clean_db: Engine, redis_url: str
) -> None:
    env = {
        "ONCEFLOW_OPERATOR_KEYS": json.dumps(
            {hash_key(VIEWER): ["viewer"], hash_key(ADMIN): ["admin"]}
        ),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["w1"]}),
        "ONCEFLOW_API_MAX_BODY_BYTES": "4096",
    }
    try:
        with api_server(tmp_path, env, app=APP) as (base, proc):
            # Keys of every kind are configured: no start-up warning says otherwise.
            assert "keys configured" not in proc.log()
            assert get(f"{base}/metrics")[0] == 401
            assert get(f"{base}/metrics", API_KEY)[0] == 401  # an API key is no operator key
            assert get(f"{base}/metrics", "not-a-key-at-all")[0] == 401
            item = {"stage": "m_idle", "job_id": "j1"}
            assert get(f"{base}/v1/workspaces/w1/requests", API_KEY, "POST", item)[0] == 201
            assert get(f"{base}/v1/workspaces/w1/requests", API_KEY, "POST", item)[0] == 200
            assert get(f"{base}/v1/workspaces/w2/requests", API_KEY, "POST", item)[0] == 403
            assert get(f"{base}/no/such/path/123")[0] == 404
            big = {**item, "input": {"pad": "x" * 5000}}  # over ONCEFLOW_API_MAX_BODY_BYTES
            assert get(f"{base}/v1/workspaces/w1/requests", API_KEY, "POST", big)[0] == 413
            status, body = get(f"{base}/metrics", VIEWER)
            assert status == 200
            assert get(f"{base}/metrics", ADMIN)[0] == 200
    finally:
        redis_lib.Redis.from_url(redis_url).delete(queue_name("m-idle"))
    s = parse(body)
    route = "/v1/workspaces/{ws}/requests"
    assert total(s, "onceflow_http_requests_total", route=route, method="POST", status="201") == 1
    assert total(s, "onceflow_http_requests_total", route=route, method="POST", status="200") == 1
    assert total(s, "onceflow_http_requests_total", route=route, method="POST", status="403") == 1
    assert total(s, "onceflow_http_requests_total", route="unmatched", status="404") == 1
    # Refused by the body limit before routing: still counted under its route template.
    assert total(s, "onceflow_http_requests_total", route=route, method="POST", status="413") == 1
    assert total(s, "onceflow_http_requests_total", route="unmatched", status="413") == 0
    assert total(s, "onceflow_http_requests_total", route="/metrics", status="401") == 3
    assert total(s, "onceflow_http_request_duration_seconds_count", route=route) == 4
    # Raw paths never become labels.
    assert "/v1/workspaces/w1" not in body and "/no/such" not in body
    # The API process recorded its enqueues; the database collector answered.
    assert total(s, "onceflow_requests_enqueued_total", outcome="created", stage="m_idle") == 1
    assert total(s, "onceflow_requests_enqueued_total", outcome="duplicate") == 1
    assert total(s, "onceflow_requests", status="queued", worker_class="m-idle") == 1
    assert total(s, "onceflow_database_up") == 1


def test_exporter_answers_with_database_down(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    prom = tmp_path / "prom"
    prom.mkdir()
    port = free_port()
    env = {
        "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://nobody:s3cret-pw@127.0.0.1:{closed}/none",
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "PYTHONPATH": str(ROOT),
    }
    proc = Proc(["metrics", "--port", str(port)], tmp_path / "exporter.log", env, ROOT)
    try:
        proc.wait_log("metrics on")
        status, body = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.stop()
    assert status == 200
    s = parse(body)
    assert s[("onceflow_database_up", frozenset())] == 0
    assert "# TYPE onceflow_requests gauge" not in body  # no counts invented
    assert "not answering" in proc.log()
    assert "s3cret-pw" not in proc.log()  # the password is never logged


@pytest.mark.parametrize("flag", [[], ["--bind", "127.0.0.1"]])
def test_exporter_help_says_unauthenticated(flag: list[str]) -> None:
    from click.testing import CliRunner

    from onceflow.cli import main

    result = CliRunner().invoke(main, ["metrics", "--help", *flag])
    assert result.exit_code == 0
    assert "UNAUTHENTICATED" in result.output


def test_standalone_worker_serves_its_metrics(tmp_path: Path, clean_db: Engine) -> None:
    from onceflow.queue import Queue

    queue = Queue(clean_db)
    queue.enqueue("s", "w", "ok", worker_class="m-solo")
    queue.enqueue("s", "w", "bad", input={"fail": True}, worker_class="m-solo", max_attempts=1)
    port = free_port()
    args = ["work", "tests.metrics.stages:standalone", "-w", "m-solo", "--metrics-port", str(port)]
    proc = Proc(args, tmp_path / "work.log", {"PYTHONPATH": str(ROOT)}, ROOT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def drained() -> bool:
            try:
                s = parse(get(url)[1])
            except OSError:
                return False  # not serving yet
            return total(s, "onceflow_attempts_total", worker_class="m-solo") == 2

        wait_for(drained, timeout=30, what="both requests recorded")
        s = parse(get(url)[1])
    finally:
        proc.stop()
    labels = {"worker_class": "m-solo", "stage": "s"}
    assert total(s, "onceflow_claims_total", **labels) == 2
    assert total(s, "onceflow_attempts_total", outcome="succeeded", **labels) == 1
    assert total(s, "onceflow_attempts_total", outcome="dead", **labels) == 1
    assert total(s, "onceflow_stage_duration_seconds_count", **labels) == 2
    assert total(s, "onceflow_stages_in_progress", worker_class="m-solo") == 0
    assert total(s, "onceflow_requests", status="dead", worker_class="m-solo") == 1
