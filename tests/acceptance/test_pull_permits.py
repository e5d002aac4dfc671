"""Pull workers share a provider's limits and the workspace budgets with everyone else.

A real ``onceflow api`` holds the permits for the claims of a Python ``PullWorker`` (this
process) and of the JS ``PullWorker`` (Node, ``js_permits.mjs``), while threads of this
process take permits of the same provider directly (``provider.permit``): one set of
limits in Redis, one Redis clock. Checked here:

- never more than ``rpm`` grants within any window, across the three kinds of client;
- a budget's refusal reaches the JS body as ``BudgetExceeded`` (and the Python body), and
  the stage is dead with that error;
- a tab killed holding a permit frees its concurrency slot at the permit's TTL (counted as
  ``expired``);
- a foreign claim token, or another tenant's key with the right token, is refused
  (409 lease_lost) and changes nothing: no grant, no reservation, the permit still held.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from onceflow.errors import BudgetExceeded, PermitTimeout
from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullContext, PullWorker
from onceflow.models import Request
from onceflow.spend import Provider, Usage, set_budget
from tests.acceptance.permit_stages import JS, PY, flow
from tests.acceptance.procs import ROOT, api_server, wait_for

pytestmark = pytest.mark.slow

APP = "tests.acceptance.permit_stages:flow"
KEY = "of_test_worker_key_permits_0123456789"
OTHER_KEY = "of_test_worker_key_permits_elsewhere_01"
SDK = ROOT / "onceflow" / "sdk" / "js" / "index.js"
SCRIPT = Path(__file__).with_name("js_permits.mjs")
NODE = shutil.which("node")

RUN = uuid.uuid4().hex[:8]  # provider state is shared Redis state: one name per run
RPM = f"pp-rpm-{RUN}"
HOLD = f"pp-hold-{RUN}"
PAUSE = f"pp-pause-{RUN}"
BUDGETED = f"pp-budget-{RUN}"
SHARED_ID = f"pp-shared-id-{RUN}"
SLOW = f"pp-slow-{RUN}"
DECLARED: dict[str, dict[str, Any]] = {
    RPM: {"rpm": 4, "window_seconds": 1},
    HOLD: {"concurrency": 1, "permit_ttl": 2},
    PAUSE: {"rpm": 1, "window_seconds": 4},
    BUDGETED: {"rpm": 1000, "input_per_million": "1", "output_per_million": "2"},
    SHARED_ID: {"tpm": 1000},
    SLOW: {"rpm": 1, "window_seconds": 60},
}
ENV = {
    "ONCEFLOW_PROVIDERS": json.dumps(DECLARED),
    "ONCEFLOW_WORKER_KEYS": json.dumps({
        hash_key(KEY): {"worker_classes": [PY, JS], "workspaces": ["pp-*"]},
        hash_key(OTHER_KEY): {"worker_classes": [PY, JS], "workspaces": ["elsewhere-*"]},
    }),
}  # fmt: skip


def provider(name: str) -> Provider:
    """The provider as the API declares it: the same limits, the same Redis state."""
    spec = dict(DECLARED[name])
    spec.pop("input_per_million", None)
    spec.pop("output_per_million", None)
    return Provider(name, **spec)


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    with api_server(tmp_path_factory.mktemp("permits"), ENV, app=APP) as (url, _):
        yield url


@pytest.fixture(autouse=True)
def no_request_left(engine: Engine) -> None:
    """Each test's pull workers claim whatever of their class is due: a request an earlier
    test left queued or running (a killed tab's, a refused one's retry) is ended first, so
    a test claims only what it enqueued."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE workspace_process_requests SET status = 'cancelled', "
                "lease_expires_at = NULL, claim_token = NULL "
                "WHERE worker_class IN (:py, :js) AND status IN ('queued', 'running')"
            ),
            {"py": PY, "js": JS},
        )


def enqueue(stage: str, ws: str, wc: str) -> str:
    made = flow.enqueue(stage, ws, f"j-{uuid.uuid4().hex[:8]}", "main", {}, worker_class=wc)
    return str(made.request_id)


def ended(rid: str, status: str) -> Request:
    def check() -> Request | None:
        row = flow.queue.get(rid)
        return row if row.status.value == status and row.lease_expires_at is None else None

    row = wait_for(check, timeout=60, what=f"request {rid} {status}")
    assert row is not None
    return row


def node(*args: str) -> subprocess.Popen[str]:
    if NODE is None:
        pytest.skip("node is not installed")
    return subprocess.Popen(
        [NODE, str(SCRIPT), SDK.as_uri(), *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def most_in_any_window(grants: list[int], window_ms: int) -> int:
    grants = sorted(grants)
    return max(
        sum(1 for t in grants[i:] if t < start + window_ms) for i, start in enumerate(grants)
    )


def test_python_js_and_direct_clients_never_exceed_rpm_together(api: str) -> None:
    per_client = 8
    shared = provider(RPM)
    direct: list[int] = []
    done = threading.Barrier(3)

    def take_directly() -> None:
        done.wait()
        for _ in range(per_client):
            with shared.permit("pp-direct", tokens=1, timeout=60) as permit:
                permit.settle(Usage(1, 0))
                direct.append(permit.granted_at_ms)

    def pull_body(ctx: PullContext) -> Any:
        granted = []
        for i in range(per_client):
            with ctx.permit(RPM, tokens=1, cell_key=f"py:{i}") as permit:
                permit.settle(Usage(1, 0), model="py-model")
                granted.append(permit.granted_at_ms)
        return {"granted": granted}

    py_rid = enqueue("pp_py", "pp-rpm-py", PY)
    js_rid = enqueue("pp_js", "pp-rpm-js", JS)
    threads = [threading.Thread(target=take_directly) for _ in range(2)]
    for t in threads:
        t.start()
    js = node(api, KEY, JS, "rpm", RPM, str(per_client))
    done.wait()
    with PullWorker(api, KEY, PY, lease_seconds=30) as worker:
        assert worker.run_once(pull_body, wait=5) == "succeeded"
    out, err = js.communicate(timeout=90)
    for t in threads:
        t.join(timeout=60)
    assert js.returncode == 0, err
    assert lines(out)[-1] == {"outcome": "succeeded"}

    py_granted = ended(py_rid, "succeeded").result["granted"]
    js_granted = ended(js_rid, "succeeded").result["granted"]
    grants = direct + py_granted + js_granted
    assert len(grants) == 4 * per_client  # every client was served
    # Never over the limit within any window of the Redis clock, whoever asked.
    assert most_in_any_window(grants, 1000) <= 4
    assert shared.stats()["granted"] == 4 * per_client


def test_a_budget_refusal_reaches_the_js_and_python_bodies(api: str, engine: Engine) -> None:
    set_budget("pp-poor", "day", limit_tokens=10, allow_new=True)
    js_rid = enqueue("pp_js", "pp-poor", JS)
    js = node(api, KEY, JS, "budget", BUDGETED)
    out, err = js.communicate(timeout=90)
    assert js.returncode == 0, err
    seen = lines(out)
    assert seen[0] == {"caught": "BudgetExceeded", "budget": True, "onExceeded": "fail",
                       "period": "day"}  # fmt: skip
    assert seen[-1] == {"outcome": "dead"}
    row = ended(js_rid, "dead")
    assert row.error["type"] == "BudgetExceeded"
    assert row.attempts == 1

    py_rid = enqueue("pp_py", "pp-poor", PY)
    caught: list[BaseException] = []

    def body(ctx: PullContext) -> Any:
        try:
            with ctx.permit(BUDGETED, tokens=100):
                raise AssertionError("a refused permit runs no body")
        except BudgetExceeded as exc:
            caught.append(exc)
            raise

    with PullWorker(api, KEY, PY, lease_seconds=30) as worker:
        assert worker.run_once(body, wait=5) == "dead"
    assert caught and caught[0].on_exceeded == "fail" and caught[0].period == "day"
    assert ended(py_rid, "dead").error["type"] == "BudgetExceeded"
    # Refused before anything was reserved or granted.
    assert provider(BUDGETED).stats().get("granted", 0) == 0
    with engine.connect() as conn:
        held = conn.execute(
            text("SELECT count(*) FROM spend_reservations WHERE workspace_id = 'pp-poor'")
        ).scalar_one()
    assert held == 0


def test_a_waiting_budget_retries_the_stage_when_the_period_turns(api: str) -> None:
    """Under either pull worker: queued again, due at the next UTC day (at most the
    server's longest retry delay, 600 s by default), the error BudgetExceeded. A budget of
    0 tokens refuses even a call estimated at 0, and a next period can take that call (a
    call larger than the whole budget could never wait for room: it is dead at once)."""
    set_budget("pp-patient", "day", limit_tokens=0, on_exceeded="wait", allow_new=True)
    js_rid = enqueue("pp_js_wait", "pp-patient", JS)
    js = node(api, KEY, JS, "budget", BUDGETED, "0")
    out, err = js.communicate(timeout=90)
    assert js.returncode == 0, err
    assert lines(out)[0]["onExceeded"] == "wait"
    assert lines(out)[-1] == {"outcome": "retry"}

    py_rid = enqueue("pp_py_wait", "pp-patient", PY)

    def body(ctx: PullContext) -> Any:
        with ctx.permit(BUDGETED, tokens=0):
            raise AssertionError("a refused permit runs no body")

    with PullWorker(api, KEY, PY, lease_seconds=30) as worker:
        assert worker.run_once(body, wait=5) == "retry"
    for rid in (js_rid, py_rid):
        row = ended(rid, "queued")
        assert row.error["type"] == "BudgetExceeded"
        assert row.error["on_exceeded"] == "wait"
        assert row.attempts == 0  # the wait gave its attempt back
        retry_in = (row.run_after - row.updated_at).total_seconds()
        assert 0 < retry_in <= 600


def test_a_killed_tab_frees_its_permit_at_the_ttl(api: str) -> None:
    held = provider(HOLD)
    enqueue("pp_js", "pp-hold", JS)
    js = node(api, KEY, JS, "hold", HOLD)
    assert js.stdout is not None
    first = json.loads(js.stdout.readline())
    assert first["expiresInMs"] == 2000
    try:
        with pytest.raises(PermitTimeout), held.permit("pp-direct", timeout=0.5):
            pass  # the tab's permit holds the one slot
        # A Python pull worker asking meanwhile is told "not yet" (429) and why.
        enqueue("pp_py", "pp-hold", PY)
        refused: list[PermitTimeout] = []

        def body(ctx: PullContext) -> Any:
            try:
                with ctx.permit(HOLD, tokens=1, timeout=1):
                    raise AssertionError("the slot is the tab's")
            except PermitTimeout as exc:
                refused.append(exc)
                raise

        with PullWorker(api, KEY, PY, lease_seconds=30) as worker:
            assert worker.run_once(body, wait=5) == "dead"  # retryable, but one attempt
        assert refused[0].reason == "concurrency"
    finally:
        js.send_signal(signal.SIGKILL)  # the tab is closed: no settle, no release
        js.communicate(timeout=30)
    with held.permit("pp-direct", timeout=10) as permit:
        permit.settle(Usage(1, 0))
    # Freed by its TTL on the Redis clock, not before.
    assert permit.granted_at_ms >= first["granted"] + 2000
    assert held.stats()["expired"] == 1


def test_a_foreign_claim_token_is_refused_and_changes_nothing(api: str, engine: Engine) -> None:
    foreign = provider(BUDGETED)
    enqueue("pp_py", "pp-tenant", PY)
    with (
        PullWorker(api, KEY, PY, lease_seconds=30) as worker,
        httpx.Client(base_url=api, timeout=10) as client,
    ):
        claim = worker.claim(wait=5)
        assert claim is not None
        permit_id = uuid.uuid4().hex
        url = f"/v1/claims/{claim.request_id}/permits"
        ask = {"provider": BUDGETED, "tokens": 5, "permit_id": permit_id, "wait_seconds": 0}

        def post(path: str, key: str, token: str, body: dict[str, Any]) -> httpx.Response:
            body = {"claim_token": token, "workspace_id": "pp-tenant", **body}
            return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

        before = foreign.stats()
        wrong = post(url, KEY, "not-the-token", ask)
        other_tenant = post(url, OTHER_KEY, claim.token, ask)
        for refused in (wrong, other_tenant):
            assert refused.status_code == 409, refused.text
            assert refused.json()["code"] == "lease_lost"
        assert foreign.stats() == before  # no grant, no wait, no denial counted
        with engine.connect() as conn:
            reserved = conn.execute(
                text("SELECT count(*) FROM spend_reservations WHERE workspace_id = 'pp-tenant'")
            ).scalar_one()
        assert reserved == 0

        granted = post(url, KEY, claim.token, ask)
        assert granted.status_code == 200, granted.text
        again = post(url, KEY, claim.token, ask)  # a repeated POST: the same permit
        assert again.json() == granted.json()
        assert foreign.stats()["in_flight"] == 1

        settle = f"{url}/{permit_id}/settle"
        usage = {"usage": {"input_tokens": 3, "output_tokens": 1}}
        for key, token in ((KEY, "not-the-token"), (OTHER_KEY, claim.token)):
            refused = post(settle, key, token, usage)
            assert refused.status_code == 409, refused.text
        assert foreign.stats()["in_flight"] == 1  # still held: nothing settled
        assert post(settle, KEY, claim.token, usage).status_code == 200
        assert post(settle, KEY, claim.token, usage).status_code == 200  # a repeat
        other_usage = {"usage": {"input_tokens": 9, "output_tokens": 9}}
        assert post(settle, KEY, claim.token, other_usage).status_code == 422
        stats = foreign.stats()
        assert stats["in_flight"] == 0 and stats["settled_ok"] == 1
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT input_tokens, output_tokens, outcome, fenced FROM spend_ledger "
                    "WHERE workspace_id = 'pp-tenant'"
                )
            ).all()
        assert [tuple(r) for r in rows] == [(3, 1, "ok", True)]
        worker.complete(claim, {"ok": True})


def test_a_budget_held_by_calls_in_flight_is_not_yet_over_http(
    api: str, engine: Engine, database_url: str
) -> None:
    """A budget that only the reservations of calls in flight fill answers 429
    ``budget_in_flight`` (ask again; nothing reserved), and grants once they settle lower."""
    from onceflow.spend import LedgerHooks

    set_budget("pp-busy", "day", limit_tokens=10, allow_new=True)
    direct = Provider(BUDGETED, rpm=1000, hooks=LedgerHooks(database_url))
    enqueue("pp_py", "pp-busy", PY)

    def reserved() -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM spend_reservations WHERE workspace_id = 'pp-busy'")
                ).scalar_one()
            )

    with (
        PullWorker(api, KEY, PY, lease_seconds=30) as worker,
        httpx.Client(base_url=api, timeout=10) as client,
    ):
        claim = worker.claim(wait=5)
        assert claim is not None
        url = f"/v1/claims/{claim.request_id}/permits"
        ask = {
            "provider": BUDGETED, "tokens": 6, "permit_id": uuid.uuid4().hex,
            "wait_seconds": 0.3, "claim_token": claim.token, "workspace_id": "pp-busy",
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {KEY}"}
        with direct.permit("pp-busy", 6) as held:
            assert reserved() == 1
            busy = client.post(url, json=ask, headers=headers)
            assert busy.status_code == 429, busy.text
            assert busy.json()["reason"] == "budget_in_flight"
            assert "Retry-After" in busy.headers
            assert reserved() == 1  # the refused ask reserved nothing
            held.settle(Usage(2, 1))  # 3 spent: 3 + 6 fits the 10
        granted = client.post(url, json=ask, headers=headers)
        assert granted.status_code == 200, granted.text
        assert reserved() == 1
        worker.complete(claim, {"ok": True})


def test_a_budget_refusal_the_server_did_not_answer_counts_its_attempt(api: str) -> None:
    """A worker that reports a budget wait the server never refused gets an ordinary
    failure: counted, dead at max_attempts (one here), not queued again for ever."""
    rid = enqueue("pp_py_wait", "pp-forger", PY)

    def body(ctx: PullContext) -> Any:
        raise BudgetExceeded("pp-forger", "day", "said by the worker", "wait", None, 1.0)

    with PullWorker(api, KEY, PY, lease_seconds=30) as worker:
        assert worker.run_once(body, wait=5) == "dead"
    row = ended(rid, "dead")
    assert row.error["type"] == "BudgetExceeded"
    assert row.attempts == 1


class FirstSettleUnanswered(httpx.HTTPTransport):
    """The network between the worker and the API: the first settle is answered 503 (a
    proxy's blip) without reaching the API; every request passes on otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.settles: list[dict[str, Any]] = []
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path.endswith("/settle"):
            self.settles.append(json.loads(request.content)["usage"])
            if len(self.settles) == 1:
                return httpx.Response(503, json={"detail": "blip", "code": "unavailable"})
        return super().handle_request(request)


def test_a_settle_without_an_answer_is_sent_again_on_leaving(api: str, engine: Engine) -> None:
    """A settle that got a 503 past the worker's retries is sent again, the same usage,
    when the block is left: the ledger has the call's real usage, not a release."""
    rid = enqueue("pp_py", "pp-blip", PY)
    network = FirstSettleUnanswered()

    def body(ctx: PullContext) -> Any:
        with ctx.permit(BUDGETED, tokens=5) as permit:
            permit.settle(Usage(3, 1), model="m-blip")

    client = httpx.Client(base_url=api, timeout=10, transport=network)
    with PullWorker(api, KEY, PY, lease_seconds=30, retries=1, client=client) as worker:
        assert worker.run_once(body, wait=5) == "dead"  # the body saw the 503; one attempt
    client.close()
    assert ended(rid, "dead").error["type"] == "TransportError"
    assert network.settles == [{"input_tokens": 3, "output_tokens": 1}] * 2
    assert not [p for p in network.paths if p.endswith("/release")]
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT input_tokens, output_tokens, outcome, model FROM spend_ledger "
                "WHERE workspace_id = 'pp-blip'"
            )
        ).all()
    assert [tuple(r) for r in rows] == [(3, 1, "ok", "m-blip")]


def test_a_python_pull_worker_asks_again_within_a_second_of_a_long_hint(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused by a request limit whose window frees in seconds, the worker asks again at
    most a second after each answer (so its workspace keeps counting as waiting for its
    fair share) instead of sleeping out the hint. Its server-side long poll is made short
    here, so that the pauses between asks show."""
    from onceflow.integrations import pull_permits

    monkeypatch.setattr(pull_permits, "ASK_SECONDS", 0.2)
    paced = provider(PAUSE)
    with paced.permit("pp-direct") as taken:  # the window's one request
        taken.settle(Usage(1, 0))
    enqueue("pp_py", "pp-pause", PY)
    asked: list[float] = []

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/permits"):
                asked.append(time.monotonic())
            return super().handle_request(request)

    def body(ctx: PullContext) -> Any:
        with ctx.permit(PAUSE, tokens=1, timeout=10) as permit:
            permit.settle(Usage(1, 0))
        return {"ok": True}

    client = httpx.Client(base_url=api, timeout=10, transport=Counting())
    with PullWorker(api, KEY, PY, lease_seconds=30, client=client) as worker:
        assert worker.run_once(body, wait=5) == "succeeded"
    client.close()
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert len(asked) >= 3, asked
    assert max(gaps) < 0.2 + 1.0 + 0.5, gaps


def test_one_permit_id_under_two_claims_is_two_permits(api: str) -> None:
    """A key that holds claims in two workspaces sends the same permit id under each: two
    grants, each counted and each holding its slot; settling one frees only its own slot and
    corrects only its own workspace's tokens."""
    shared = provider(SHARED_ID)
    for ws in ("pp-same-a", "pp-same-b"):
        enqueue("pp_py", ws, PY)
    with (
        PullWorker(api, KEY, PY, lease_seconds=30) as worker,
        httpx.Client(base_url=api, timeout=10) as client,
    ):
        claims = [worker.claim(wait=5) for _ in range(2)]
        assert all(c is not None for c in claims)
        by_ws = {c.workspace_id: c for c in claims if c is not None}
        assert set(by_ws) == {"pp-same-a", "pp-same-b"}
        permit_id = uuid.uuid4().hex
        headers = {"Authorization": f"Bearer {KEY}"}

        def post(ws: str, path: str, body: dict[str, Any]) -> httpx.Response:
            claim = by_ws[ws]
            body = {"claim_token": claim.token, "workspace_id": ws, **body}
            url = f"/v1/claims/{claim.request_id}/permits{path}"
            return client.post(url, json=body, headers=headers)

        ask = {"provider": SHARED_ID, "tokens": 100, "permit_id": permit_id, "wait_seconds": 0}
        for ws in by_ws:
            granted = post(ws, "", ask)
            assert granted.status_code == 200, granted.text
        stats = shared.stats()
        assert (stats["granted"], stats["in_flight"], stats["window_tokens"]) == (2, 2, 200)

        usage = {"usage": {"input_tokens": 5, "output_tokens": 5}}
        assert post("pp-same-a", f"/{permit_id}/settle", usage).status_code == 200
        stats = shared.stats()
        assert (stats["in_flight"], stats["window_tokens"]) == (1, 110)
        assert post("pp-same-b", f"/{permit_id}/release", {"outcome": "unused"}).status_code == 200
        stats = shared.stats()
        assert (stats["in_flight"], stats["window_tokens"]) == (0, 10)
        for claim in by_ws.values():
            worker.complete(claim, {"ok": True})


def test_the_busy_hint_and_a_reported_cooling_are_capped(api: str) -> None:
    """A refusal for the rest of a minute answers "ask again within a second" (the next long
    poll does the waiting); a reported Retry-After of a day cools the provider for its
    max_cooldown at most."""
    slow = provider(SLOW)
    enqueue("pp_py", "pp-slow", PY)
    with (
        PullWorker(api, KEY, PY, lease_seconds=30) as worker,
        httpx.Client(base_url=api, timeout=10) as client,
    ):
        claim = worker.claim(wait=5)
        assert claim is not None
        url = f"/v1/claims/{claim.request_id}/permits"
        headers = {"Authorization": f"Bearer {KEY}"}

        def ask(permit_id: str) -> httpx.Response:
            body = {
                "provider": SLOW, "permit_id": permit_id, "wait_seconds": 0,
                "claim_token": claim.token, "workspace_id": "pp-slow",
            }  # fmt: skip
            return client.post(url, json=body, headers=headers)

        first = uuid.uuid4().hex
        assert ask(first).status_code == 200
        busy = ask(uuid.uuid4().hex)  # rpm 1: the next permit is a minute away
        assert busy.status_code == 429, busy.text
        assert busy.json()["reason"] == "rpm"
        assert 0 < busy.json()["retry_after_ms"] <= 1000
        assert busy.headers["Retry-After"] == "1"

        cooled = client.post(
            f"{url}/{first}/rate-limited", headers=headers,
            json={"claim_token": claim.token, "workspace_id": "pp-slow", "retry_after": 86_400},
        )  # fmt: skip
        assert cooled.status_code == 200, cooled.text
        assert 0 < slow.stats()["cooling_ms"] <= 300_000
        worker.complete(claim, {"ok": True})
