"""With the broker (Redis) down, a write that committed still answers normally: the delivery task is published
in an on_commit callback (notifications.services._enqueue) that logs a broker error instead of raising it; the
delivery row is there and the sweeper sends it later. Before, the user got "Server Error" and retried, queueing a
second test message. Booking, provisioning and the outbox guard their publishes the same way."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from notifications.choices import DeliveryStatus
from notifications.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True)]


def _lead(world) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(world.users["alpha-lead"])
    return client


def test_send_test_message_with_the_broker_down_is_not_a_500(world, receiver, webhook_for, private_redis):
    channel, _ = webhook_for("alpha", receiver.url("/hook"))
    private_redis.stop()  # Redis restarting / unreachable
    response = _lead(world).post(reverse("notifications:channel-test", args=[channel.pk]))
    assert Delivery.objects.filter(channel=channel).count() == 1  # committed: the sweeper will send it
    assert response.status_code == 302, f"{response.status_code}: the user saw an error for a queued message"


def test_retry_now_with_the_broker_down_is_not_a_500(world, receiver, webhook_for, private_redis):
    channel, _ = webhook_for("alpha", receiver.url("/hook"))
    delivery = Delivery.objects.create(
        key="chaos:failed", channel=channel, channel_label=channel.label, kind=channel.kind, tenant=channel.tenant,
        event="reservation.changed", message_id="msg_chaos", payload={}, body="{}",
        status=DeliveryStatus.FAILED, last_error="http_500",
    )
    private_redis.stop()
    response = _lead(world).post(reverse("notifications:delivery-retry", args=[delivery.pk]))
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.PENDING  # committed: the sweeper will send it
    assert response.status_code == 302, f"{response.status_code}: the user saw an error for a requeued delivery"
