"""The sweeper queues a stuck delivery again once, then leaves it to that message for a while (found in a review:
under a backlog a late delivery's own message still waits in the queue, and each sweep, every minute, queued one
more copy of it). A lost message is still made up for: after the hold, or at once when the delivery moved on."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from notifications import ratelimit, services
from notifications.choices import DeliveryStatus
from notifications.models import Delivery
from notifications.slack import Event
from tests.notifications.receiver import Reply

pytestmark = pytest.mark.django_db


@pytest.fixture
def redis_client():
    client = ratelimit.client_from_url(settings.REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def overdue(world, webhook_for, receiver, redis_client):
    """Make retrying deliveries whose next attempt was due 5 minutes ago (their retry message waits in a queue)."""
    channel, _ = webhook_for("alpha", receiver.url("/ci/hook"))
    made: list[Delivery] = []

    def _make(count: int = 1) -> list[Delivery]:
        rows = [Delivery.objects.create(
            key=f"late:{uuid.uuid4().hex}", channel=channel, channel_label=channel.label, kind=channel.kind,
            tenant=channel.tenant, event=Event.RESERVATION_CHANGED, message_id=f"msg_{uuid.uuid4().hex[:20]}",
            payload={}, body="{}", status=DeliveryStatus.RETRYING, attempts=1,
            next_attempt_at=timezone.now() - timedelta(minutes=5)) for _ in range(count)]
        made.extend(rows)
        return rows

    yield _make
    for row in made:
        for key in redis_client.scan_iter(f"{services.SWEEP_KEY_PREFIX}{row.pk}:*"):
            redis_client.delete(key)


def test_a_late_delivery_is_swept_once_then_left_to_that_message(overdue, redis_client):
    (late,) = overdue()
    now = timezone.now()
    assert services.deliveries_requeue_stuck(now=now) == [late.pk]
    # The next sweeps (every minute) find it still late: its message is queued already, no more copies.
    assert services.deliveries_requeue_stuck(now=now + timedelta(minutes=1)) == []
    assert services.deliveries_requeue_stuck(now=now + timedelta(minutes=2)) == []
    (key,) = list(redis_client.scan_iter(f"{services.SWEEP_KEY_PREFIX}{late.pk}:*"))
    assert 0 < redis_client.ttl(key) <= services.SWEEP_HOLD_S  # the hold ends by itself

    # That copy was lost as well: once the hold is over, the sweeper queues it again.
    redis_client.delete(key)
    assert services.deliveries_requeue_stuck(now=now + timedelta(minutes=6)) == [late.pk]


def test_a_delivery_that_moved_on_and_is_late_again_is_swept_at_once(overdue):
    (late,) = overdue()
    assert services.deliveries_requeue_stuck() == [late.pk]
    # The swept message ran: another attempt failed, and its retry is late in the queue in turn.
    Delivery.objects.filter(pk=late.pk).update(attempts=2, next_attempt_at=timezone.now() - timedelta(minutes=3))
    assert services.deliveries_requeue_stuck() == [late.pk]


def test_deliveries_left_to_their_message_do_not_keep_the_others_from_the_sweep(overdue):
    first, second, third = overdue(3)
    assert services.deliveries_requeue_stuck(limit=2) == [first.pk, second.pk]
    assert services.deliveries_requeue_stuck(limit=2) == [third.pk]
    assert services.deliveries_requeue_stuck(limit=2) == []


def test_a_message_waiting_out_its_webhooks_429_is_not_taken_for_lost(world, receiver, slack_for, book, t0,
                                                                      notify_settings, redis_client):
    """A 429 holds every message to that webhook for its Retry-After (up to PORTAL_NOTIFY_BACKOFF_CAP, an hour).
    A message that met the hold comes back by itself when it ends, but its row still read "due" (its
    next attempt long past): a minute on the sweeper took it for lost and queued a copy, and one more each time
    its hold ran out, a dozen copies in an hour for each message waiting, each alive until the message ends."""
    notify_settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.05
    notify_settings.PORTAL_NOTIFY_BACKOFF_CAP = 3600  # the default: a Retry-After of 10 minutes is kept
    url = receiver.url("/services/T0/B0/alpha")
    slack_for("alpha", url)
    receiver.script(Reply.rate_limited(600))
    reservations = [book("alpha", t0 + timedelta(hours=3 * i)) for i in range(2)]
    first, second = (services.event_fanout(event="reservation.confirmed", payload={"reservation_id": r.pk})[0]
                     for r in reservations)
    try:
        assert services.delivery_send(delivery_id=first.pk).retry_in == 600
        held = services.delivery_send(delivery_id=second.pk)
        assert not held.posted and held.retry_in > 590
        now = timezone.now()
        for minutes in (2, 5, 9):
            assert services.deliveries_requeue_stuck(now=now + timedelta(minutes=minutes)) == []
        # Lost after all (its message never came back once the hold was over): the sweeper makes up for it.
        assert second.pk in services.deliveries_requeue_stuck(now=now + timedelta(minutes=12))
    finally:
        redis_client.delete(ratelimit.key_for_url(url))
        for row in (first, second):
            for key in redis_client.scan_iter(f"{services.SWEEP_KEY_PREFIX}{row.pk}:*"):
                redis_client.delete(key)
