"""Which broker a URL names: AMQP (RabbitMQ) decides the redelivery bound and the config."""

from __future__ import annotations

import pytest

from onceflow.settings import Settings
from onceflow.tasks.config import celery_config, is_amqp, redelivery_bound


@pytest.mark.parametrize(
    ("url", "amqp"),
    [
        ("amqp://guest:guest@127.0.0.1:5672//", True),
        ("AMQPS://user:pw@rabbit:5671/vhost", True),
        ("pyamqp://127.0.0.1//", True),
        ("amqp://a//;amqp://b//", True),  # failover: the first decides
        ("redis://127.0.0.1:6379/0", False),
        ("rediss://127.0.0.1:6380/0", False),
        ("redis://x/0;amqp://y//", False),
        ("sqs://", False),
        ("amqp", False),  # no scheme separator
        ("", False),
        (None, False),
    ],
)
def test_is_amqp(url: str | None, amqp: bool) -> None:
    assert is_amqp(url) is amqp


def test_the_bound_and_the_config_follow_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    rabbit = Settings(broker_url="amqp://127.0.0.1//", broker_consumer_timeout_seconds=900)
    redis = Settings(broker_url=None, redis_url="redis://127.0.0.1:6379/0")
    assert redelivery_bound(rabbit, rabbit.celery_broker_url)[1] == 900
    assert redelivery_bound(redis, redis.celery_broker_url)[1] == 3600
    assert celery_config(rabbit)["broker_channel_error_retry"] is True
    assert "broker_transport_options" not in celery_config(rabbit)
    assert celery_config(redis)["broker_transport_options"] == {"visibility_timeout": 3600}
    assert "broker_channel_error_retry" not in celery_config(redis)
    # CELERY_BROKER_URL wins over onceflow's settings, as it does in Celery.
    monkeypatch.setenv("CELERY_BROKER_URL", "amqp://elsewhere//")
    assert celery_config(redis)["broker_channel_error_retry"] is True
