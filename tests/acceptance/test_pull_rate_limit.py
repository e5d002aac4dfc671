"""A pull worker under its key's request rate (a real `onceflow api`, real Postgres and Redis).

A refused call (429) was not processed: the Python pull worker sends it again once the
server's ``Retry-After`` has passed, as the browser SDK does, instead of giving up a
completion while its claim still holds (it raised ``TransportError`` at the first 429, and
the stage ran again after its lease lapsed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullWorker
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import api_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("runtime")]

API_KEY = "of_test_rate_api_key_0123456789abcdef"
WORKER_KEY = "of_test_rate_worker_key_0123456789ab"
PULL = "t-pull"
WS = "w-rate"
RATE = "5 per 2 seconds"  # per key: spent in a few calls, back within seconds


@pytest.fixture()
def limited_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_API_RATE_LIMIT": RATE,
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("rate-api"), env) as served:
        yield served


def test_a_completion_refused_by_the_rate_limit_is_sent_again_and_lands(
    limited_api: tuple[str, Any], engine: Engine
) -> None:
    url, proc = limited_api
    auth = {"Authorization": f"Bearer {WORKER_KEY}"}
    with httpx.Client(base_url=url, timeout=10) as http:
        made = http.post(
            f"/v1/workspaces/{WS}/requests",
            json={"stage": "noop", "job_id": "rate", "input": {"value": 1}, "worker_class": PULL},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert made.status_code == 201, made.text
        with PullWorker(url, WORKER_KEY, PULL, lease_seconds=30) as worker:
            claim = worker.claim()
            assert claim is not None
            # Spend the worker key's rate with heartbeats of the claim, up to a refusal.
            beat = f"/v1/claims/{claim.request_id}/heartbeat"
            body = {"claim_token": claim.token, "workspace_id": WS}
            statuses = [http.post(beat, json=body, headers=auth).status_code for _ in range(12)]
            assert 429 in statuses, statuses
            done = worker.complete(claim, {"by": "pull"})
    assert done["status"] == "succeeded" and done["result"] == {"by": "pull"}
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT status, attempts FROM workspace_process_requests WHERE workspace_id = :w"),
            {"w": WS},
        ).one()
    assert tuple(row) == ("succeeded", 1)
    # The completion itself was refused first, then sent again (the server's access log).
    answers = re.findall(r'"POST /v1/claims/\w+/complete HTTP/1.1" (\d{3})', proc.log())
    assert answers[0] == "429" and answers[-1] == "200", answers
