"""What the metrics record when the rows move in ways a run's own code does not see.

A pull worker's claim is rebuilt from the current row by the HTTP API, so nothing but the
claim's own time (``claimed_at``) may time its run; a rolled-back enqueue never happened;
a cancel already asked for is not asked again.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from onceflow.models.requests import Claim, ClaimRef, NewRequest
from onceflow.queue import Queue

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_duration_runs_from_the_claim_not_the_last_heartbeat(queue: Queue) -> None:
    queue.enqueue("s1", "w1", "j1", worker_class="wc-pull", now=T0)
    lab = {"worker_class": "wc-pull", "stage": "s1"}
    wait_before = value("onceflow_pickup_latency_seconds_sum", **lab)
    [c] = queue.claim_next("wc-pull", "pw", lease_seconds=300, now=T0 + timedelta(seconds=5))
    assert value("onceflow_pickup_latency_seconds_sum", **lab) - wait_before == 5.0
    queue.heartbeat(c, now=T0 + timedelta(seconds=50))
    queue.cancel(c.request_id, now=T0 + timedelta(seconds=55))  # moves updated_at too
    # As the HTTP API's claim_of builds a pull worker's claim: from the current row.
    found = queue.get(c.request_id)
    assert found.lease_expires_at is not None and found.heartbeat_at is not None
    lease = (found.lease_expires_at - found.heartbeat_at).total_seconds()
    http_claim = Claim(found, c.token, found.lease_expires_at, lease)
    out = {**lab, "outcome": "succeeded"}
    before = value("onceflow_stage_duration_seconds_sum", **out)
    queue.complete(http_claim, {"ok": 1}, now=T0 + timedelta(seconds=65))
    assert value("onceflow_stage_duration_seconds_sum", **out) - before == 60.0
    assert c.request.claimed_at == found.claimed_at == T0 + timedelta(seconds=5)


def test_finish_records_the_run_as_hand_off_does_by_claim_and_by_ref(queue: Queue) -> None:
    """finish reads back only the columns the run's metrics need: one attempt succeeded
    per finish, timed from the claim to the finish (database clock), its follow-ups
    counted once, whether it holds the Claim or a bare ref."""
    lab = {"worker_class": "wc-fin", "stage": "s1"}
    out = {**lab, "outcome": "succeeded"}
    for job in ("j1", "j2"):
        queue.enqueue("s1", "w1", job, worker_class="wc-fin", now=T0)
    claims = queue.claim_next("wc-fin", "w", limit=2, lease_seconds=300, now=T0)
    before = {
        k: value(f"onceflow_{k}", **out)
        for k in ("attempts_total", "stage_duration_seconds_count", "stage_duration_seconds_sum")
    }
    made_before = enqueued("wc-fin")
    then = [NewRequest("w1", "j1", "s1", branch_path="next", worker_class="wc-fin")]
    queue.finish(claims[0], {"ok": 1}, then=then, now=T0 + timedelta(seconds=7))
    ref = ClaimRef(claims[1].request_id, claims[1].token)
    queue.finish(ref, {"ok": 1}, now=T0 + timedelta(seconds=9))
    after = {k: value(f"onceflow_{k}", **out) for k in before}
    assert after["attempts_total"] - before["attempts_total"] == 2
    assert after["stage_duration_seconds_count"] - before["stage_duration_seconds_count"] == 2
    assert after["stage_duration_seconds_sum"] - before["stage_duration_seconds_sum"] == 16.0
    assert enqueued("wc-fin") - made_before == 1


def enqueued(worker_class: str, outcome: str = "created") -> float:
    labels = {"worker_class": worker_class, "stage": "s1", "outcome": outcome}
    return value("onceflow_requests_enqueued_total", **labels)


def test_enqueues_are_counted_when_their_transaction_commits(queue: Queue, engine: Engine) -> None:
    before = enqueued("wc-rb")
    with engine.connect() as conn:
        tx = conn.begin()
        queue.enqueue_many([NewRequest("w1", "j9", "s1", worker_class="wc-rb")], connection=conn)
        tx.rollback()
        # A later transaction of the same connection does not count the rolled-back rows.
        with conn.begin():
            conn.execute(text("SELECT 1"))
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM workspace_process_requests")).scalar()
    assert n == 0
    assert enqueued("wc-rb") == before
    with engine.connect() as conn, conn.begin():
        queue.enqueue_many([NewRequest("w1", "j9", "s1", worker_class="wc-rb")], connection=conn)
        assert enqueued("wc-rb") == before  # not yet committed
    assert enqueued("wc-rb") == before + 1
    queue.enqueue("s1", "w1", "j9", worker_class="wc-rb")  # pooled: committed at once
    assert enqueued("wc-rb", "duplicate") >= 1
    assert enqueued("wc-rb") == before + 1


def test_a_hand_off_counts_its_follow_ups_once(queue: Queue) -> None:
    queue.enqueue("s0", "w1", "j1", worker_class="wc-ho")
    [c] = queue.claim_next("wc-ho", "w")
    before = enqueued("wc-ho")
    queue.hand_off(c, {"ok": 1}, then=[NewRequest("w1", "j1", "s1", worker_class="wc-ho")])
    assert enqueued("wc-ho") == before + 1


def test_a_repeated_cancel_of_a_running_request_is_no_new_transition(queue: Queue) -> None:
    queue.enqueue("s1", "w1", "j2", worker_class="wc-c")
    [c] = queue.claim_next("wc-c", "w", lease_seconds=30)
    before = value("onceflow_requests_cancelled_total", worker_class="wc-c")
    first = queue.cancel(c.request_id, now=T0)
    again = queue.cancel(c.request_id, now=T0 + timedelta(seconds=1))
    assert value("onceflow_requests_cancelled_total", worker_class="wc-c") - before == 1
    assert (again.status.value, again.cancel_requested) == ("running", True)
    assert again.updated_at == first.updated_at == T0  # left as it was
