"""An outbox event's notification fan-out survives a Redis restart.

The outbox (portal/core/events.py) deletes the event once its background subscribers returned, so the
notifications subscriber fans out itself (creating the Delivery rows) instead of queueing
notifications.fanout: a queued fan-out lost with Redis left nothing — no outbox row, no Delivery — that
the relay or the sweeper could find.
"""

from __future__ import annotations

import time

import pytest
import redis

from notifications.choices import DeliveryStatus
from notifications.models import Delivery
from notifications.services import deliveries_requeue_stuck
from notifications.slack import Event
from portal.core import events
from portal.core.models import OutboxEvent

from .conftest import start_worker, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


def test_booking_notification_survives_a_redis_restart_after_the_outbox_event_ran(
        world, t0, book, receiver, webhook_for, private_redis, tmp_path, settings):
    settings.PORTAL_EVENTS_INLINE = False  # production: background subscribers through the outbox
    channel, _ = webhook_for("alpha", receiver.url("/hook"))
    # The outbox worker (queue default) is up; the notifications workers are busy or restarting.
    dispatcher = start_worker(tmp_path, private_redis.url, "default")
    try:
        reservation = book("alpha", t0, name="must-be-told")
        wait_for(lambda: not OutboxEvent.objects.exists(), timeout=30,
                 what=f"the outbox event dispatched; log:\n{dispatcher.output()[-3000:]}")
        broker = redis.Redis.from_url(private_redis.url)
        assert broker.llen("notifications") >= 1  # the fan-out message waits in Redis, and only there
        broker.close()
    finally:
        dispatcher.kill()

    private_redis.stop()  # Redis restarts (no persistence, as in the suite's own fault tests)
    time.sleep(0.5)
    private_redis.start()

    worker = start_worker(tmp_path, private_redis.url, "notifications,default")
    try:
        # Everything beat would run to repair lost messages, a few times over.
        for _ in range(3):
            events.outbox_relay()
            deliveries_requeue_stuck(grace_s=0)
            time.sleep(1)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not receiver.requests:
            time.sleep(0.2)
        assert Delivery.objects.filter(channel=channel, event=Event.RESERVATION_CONFIRMED).exists(), (
            f"reservation {reservation.pk}: its confirmation was never fanned out, and nothing will retry it")
        wait_for(lambda: Delivery.objects.filter(channel=channel, status=DeliveryStatus.DELIVERED).exists(),
                 timeout=15, what="the confirmation delivered")
    finally:
        worker.kill()
