"""Django: the request row rides the app's transaction; the wake-up waits for the commit.

The example project (``examples/django_app``) runs for real: Django on the run's
onceflow database (pytest-django, transactional tests — no ``test_`` copy, since a
Celery worker in another process must see the committed rows), Redis as the
broker, and a real ``onceflow worker`` that sets Django up and runs the stage.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from onceflow import InvalidRequest, NotFound, Status
from onceflow.errors import UnknownStage
from onceflow.keys import queue_name
from tests.acceptance.procs import ROOT, wait_for
from tests.conftest import env

EXAMPLE = ROOT / "examples" / "django_app"
QUEUE = "orders"  # the example stage's worker class: its Celery queue is this Redis list


def _configure_django() -> None:
    """Set Django up from the example's settings, at collection (before pytest-django looks)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    # DJANGO_SETTINGS_MODULE only while Django reads it: the workers other tests start inherit
    # os.environ, and Celery's Django fix-up would set Django up in each of them.
    os.environ["DJANGO_SETTINGS_MODULE"] = "exampleproject.settings"
    try:
        django.setup()
    finally:
        del os.environ["DJANGO_SETTINGS_MODULE"]


_configure_django()

from django.db import connections, transaction  # noqa: E402 - after the settings

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="session")
def django_db_setup(database_url: str, redis_url: str, django_db_blocker: Any) -> None:
    """Django on this run's onceflow database, with the example's tables migrated."""
    from django.conf import settings
    from django.core.management import call_command

    from onceflow.integrations.django import database_settings

    settings.DATABASES["default"].update(database_settings(database_url))
    connections["default"].close()
    with django_db_blocker.unblock():
        call_command("migrate", verbosity=0)


@pytest.fixture()
def shop(clean_db: Any, redis_url: str) -> Iterator[Any]:
    """The example's modules, on an empty request table and an empty ``orders`` queue."""
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    redis_lib.Redis.from_url(redis_url).delete(queue_name(QUEUE))
    from orders import models, services, stages

    yield type("Shop", (), {"Order": models.Order, "services": services, "flow": stages.flow})
    get_settings.cache_clear()


def wake_ups(redis_url: str) -> int:
    """Celery messages waiting in the ``orders`` queue (no worker consumes it here)."""
    return int(redis_lib.Redis.from_url(redis_url).llen(queue_name(QUEUE)))


def enqueued(outcome: str = "created") -> float:
    """``onceflow_requests_enqueued_total`` of the example's stage in this process."""
    from prometheus_client import REGISTRY

    labels = {"worker_class": QUEUE, "stage": "confirm_order", "outcome": outcome}
    return REGISTRY.get_sample_value("onceflow_requests_enqueued_total", labels) or 0.0


class PaymentDeclined(Exception):
    pass


def test_rollback_leaves_no_row_and_sends_nothing(shop: Any, redis_url: str) -> None:
    before = enqueued()
    with pytest.raises(PaymentDeclined), transaction.atomic():
        order, result = shop.services.place_order("w-dj", "A-1")
        assert result.created and order.pk
        raise PaymentDeclined
    assert not shop.Order.objects.exists()
    with pytest.raises(NotFound):
        shop.flow.queue.get(result.request_id)
    assert shop.flow.queue.counts() == {}
    assert wake_ups(redis_url) == 0
    assert enqueued() == before  # a rolled-back enqueue never happened


def test_row_is_invisible_until_commit_then_one_wake_up(shop: Any, redis_url: str) -> None:
    from onceflow.integrations.django import enqueue

    before = enqueued(), enqueued("duplicate")
    with transaction.atomic():
        order, result = shop.services.place_order("w-dj", "A-2")
        # Another connection (onceflow's own engine) sees neither row yet; nothing was sent.
        with pytest.raises(NotFound):
            shop.flow.queue.get(result.request_id)
        assert wake_ups(redis_url) == 0
        # The same request again in this transaction collapses onto the row it just wrote.
        again = enqueue(shop.flow, "confirm_order", "w-dj", f"order-{order.pk}", "",
                        {"order_id": order.pk})  # fmt: skip
        assert (again.request_id, again.created) == (result.request_id, False)
        assert (enqueued(), enqueued("duplicate")) == before  # counted at the commit
    row = shop.flow.queue.get(result.request_id)
    assert (row.status, row.input, row.worker_class) == (
        Status.QUEUED, {"order_id": order.pk}, QUEUE,
    )  # fmt: skip
    assert shop.Order.objects.get(pk=order.pk).status == "placed"
    assert wake_ups(redis_url) == 1
    assert (enqueued(), enqueued("duplicate")) == (before[0] + 1, before[1] + 1)


def test_commit_runs_the_stage_on_a_celery_worker(
    shop: Any, redis_url: str, tmp_path: Path
) -> None:
    from django.test import Client

    from onceflow.demo import procs

    worker = procs.start_worker(
        tmp_path, "exampleproject.worker:flow", QUEUE,
        env={"PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(ROOT)])}, cwd=ROOT,
    )  # fmt: skip
    try:
        response = Client().post(
            "/orders/", {"workspace_id": "w-dj", "sku": "A-3"}, content_type="application/json"
        )
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["created"] and body["status"] == "placed"
        wait_for(
            lambda: shop.flow.queue.get(body["request_id"]).status is Status.SUCCEEDED,
            what="confirm_order succeeded",
        )
        row = shop.flow.queue.get(body["request_id"])
        assert row.result == {"order_id": body["order_id"], "confirmed": True}
        assert row.attempts == 1
        assert shop.Order.objects.get(pk=body["order_id"]).status == "confirmed"
    finally:
        worker.stop()


def test_bad_input_is_refused_before_anything_is_written(shop: Any, redis_url: str) -> None:
    from django.test import Client

    from onceflow.integrations.django import enqueue

    with transaction.atomic():
        order = shop.Order.objects.create(workspace_id="w-dj", sku="A-4")
        with pytest.raises(InvalidRequest, match="confirm_order"):
            enqueue(shop.flow, "confirm_order", "w-dj", "j", "", {"order_id": "not a number"})
        with pytest.raises(UnknownStage):
            enqueue(shop.flow, "no_such_stage", "w-dj", "j", "", {})
        with pytest.raises(InvalidRequest, match="workspace_id"):
            enqueue(shop.flow, "confirm_order", "", "j", "", {"order_id": 1})
        # Refused before any SQL: the caller's transaction is intact and commits its order.
    assert shop.Order.objects.filter(pk=order.pk).exists()
    assert shop.flow.queue.counts() == {}
    assert wake_ups(redis_url) == 0
    # Through the view: a workspace id onceflow refuses (a control character) is a 400, and
    # the order written before the enqueue in the same transaction rolled back too.
    response = Client().post(
        "/orders/", {"workspace_id": "w\nx", "sku": "A-5"}, content_type="application/json"
    )
    assert response.status_code == 400 and "workspace_id" in response.json()["error"]
    assert shop.Order.objects.count() == 1
    assert shop.flow.queue.counts() == {}
    assert wake_ups(redis_url) == 0


def test_outside_a_transaction_it_commits_and_sends_at_once(shop: Any, redis_url: str) -> None:
    from onceflow.integrations.django import enqueue

    assert connections["default"].get_autocommit()
    result = enqueue(shop.flow, "confirm_order", "w-dj", "order-x", "", {"order_id": 1})
    assert result.created
    assert shop.flow.queue.get(result.request_id).status is Status.QUEUED  # committed
    assert wake_ups(redis_url) == 1
    message = json.loads(redis_lib.Redis.from_url(redis_url).lindex(queue_name(QUEUE), 0) or b"{}")
    assert message["headers"]["task"] == "onceflow.stage.confirm_order"


def test_onceflow_migrate_command_and_the_same_database_check(shop: Any) -> None:
    from django.core.management import call_command

    from onceflow.integrations.django.apps import check_same_database
    from onceflow.settings import get_settings

    call_command("onceflow_migrate", verbosity=0)  # already at head: changes nothing
    assert check_same_database() == []
    with env(ONCEFLOW_DATABASE_URL="postgresql+psycopg://db.example:5432/elsewhere"):
        get_settings.cache_clear()
        [warning] = check_same_database()
    get_settings.cache_clear()
    assert warning.id == "onceflow.W001"


def test_strict_mismatch_discards_only_its_own_write_inside_atomic(
    shop: Any, redis_url: str
) -> None:
    """strict=True through Django's connector writes the batch under a savepoint: a mismatch
    discards the whole batch, the caller's atomic block stays usable and commits the rest."""
    from onceflow import InputMismatch, NewRequest
    from onceflow.integrations.django import DjangoConnector, enqueue

    first = enqueue(shop.flow, "confirm_order", "w-dj", "order-s", "", {"order_id": 1})
    batch = [
        shop.flow.new_request("confirm_order", "w-dj", "order-new", "", {"order_id": 3}),
        shop.flow.new_request("confirm_order", "w-dj", "order-s", "", {"order_id": 2}),
    ]
    assert all(isinstance(item, NewRequest) for item in batch)
    with transaction.atomic():
        order = shop.Order.objects.create(sku="S-1")
        with pytest.raises(InputMismatch):
            shop.flow.queue.enqueue_many(batch, strict=True, connection=DjangoConnector())
        shop.Order.objects.filter(pk=order.pk).update(status="kept")  # the block still works
    assert shop.Order.objects.get(pk=order.pk).status == "kept"
    assert [r.job_id for r in shop.flow.queue.list(workspace_id="w-dj")] == ["order-s"]
    assert shop.flow.queue.get(first.request_id).input == {"order_id": 1}


def test_an_enqueue_in_a_view_keeps_the_trace_of_the_applications_span(
    shop: Any, redis_url: str, clean_db: Any, trace_spans: Any
) -> None:
    """The application's own instrumentation (OpenTelemetry's Django instrumentation makes a
    server span current around the view) is all it takes: the enqueue in the view's
    transaction goes under that span, and the row keeps its trace for the stage's run."""
    from django.test import Client
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    from sqlalchemy import text

    from onceflow import tracing

    tracer = trace.get_tracer("the-application")
    with tracer.start_as_current_span("POST /orders/", kind=SpanKind.SERVER) as server:
        response = Client().post(
            "/orders/", {"workspace_id": "w-dj", "sku": "A-9"}, content_type="application/json"
        )
    assert response.status_code == 201, response.content
    request_id = response.json()["request_id"]
    (enqueue,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert enqueue.parent is not None
    assert enqueue.parent.span_id == server.get_span_context().span_id
    with clean_db.connect() as conn:  # committed with the order: another connection sees it
        stored = conn.execute(
            text("SELECT trace_context FROM workspace_process_requests WHERE request_id = :r"),
            {"r": request_id},
        ).scalar_one()
    kept = tracing.span_context_from(stored)
    assert kept is not None
    assert (kept.trace_id, kept.span_id) == (enqueue.context.trace_id, enqueue.context.span_id)
    assert kept.trace_id == server.get_span_context().trace_id
    assert wake_ups(redis_url) == 1  # sent on commit, as without tracing
