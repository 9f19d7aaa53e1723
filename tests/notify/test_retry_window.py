"""The retry budget with the default policy: a delivery keeps trying for at least a day, with growing waits,
so a receiver (or Slack) that is down for an hour, or most of a day, still gets every message.

The clock is driven, not slept: after each attempt the delivery's whole history is moved back by the wait it
asked for, so the next attempt is due now and the delivery sees the time that "passed"."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from notifications import ratelimit, services
from notifications.choices import DeliveryStatus
from notifications.models import Delivery, DeliveryAttempt
from tests.notifications.receiver import Reply

from .conftest import let_time_pass as _pass

pytestmark = pytest.mark.django_db


@pytest.fixture
def defaults(notify_settings):
    """The shipped retry policy (the app's defaults), with the per-URL send slot out of the way."""
    for name in ("PORTAL_NOTIFY_BACKOFF_BASE", "PORTAL_NOTIFY_BACKOFF_CAP", "PORTAL_NOTIFY_MAX_ATTEMPTS",
                 "PORTAL_NOTIFY_RETRY_HOURS"):
        if hasattr(notify_settings, name):
            delattr(notify_settings, name)
    notify_settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.001
    return notify_settings


def _confirmed(book, t0):
    reservation = book("alpha", t0)
    (delivery,) = services.event_fanout(event="reservation.confirmed",
                                        payload={"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id})
    return delivery


def _send_until(delivery_id: int, *, stop) -> tuple[services.SendResult, float, list[float]]:
    """Attempt, wait (driven), attempt … until the result is final or stop(elapsed) says so."""
    elapsed, waits = 0.0, []
    for _ in range(1000):
        result = services.delivery_send(delivery_id=delivery_id)
        assert result.posted
        if result.retry_in is None or stop(elapsed + result.retry_in):
            return result, elapsed, waits
        waits.append(result.retry_in)
        elapsed += result.retry_in
        _pass(delivery_id, result.retry_in)
    raise AssertionError("the delivery never ended")


def test_a_failing_receiver_is_retried_for_at_least_a_day_with_growing_waits(
        world, t0, book, receiver, slack_for, defaults):
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    receiver.default = Reply.server_error()
    delivery = _confirmed(book, t0)

    result, span, waits = _send_until(delivery.pk, stop=lambda elapsed: False)

    assert result.status == DeliveryStatus.FAILED
    delivery.refresh_from_db()
    assert span >= 24 * 3600, f"gave up after {span / 3600:.1f} h and {delivery.attempts} attempts"
    # Growing waits (full jitter: each is random under a ceiling that doubles up to an hour), so a day's
    # outage costs a few dozen attempts, not thousands, and the last one is within an hour of the day.
    assert span < 25 * 3600 and delivery.attempts < 120
    assert max(waits) <= 3600 and sum(waits[-10:]) > sum(waits[:10])
    assert len(receiver.requests) == delivery.attempts == DeliveryAttempt.objects.filter(delivery=delivery).count()
    assert "gave up after" in delivery.last_error


def test_a_receiver_back_after_an_hours_outage_still_gets_the_message(
        world, t0, book, receiver, slack_for, defaults):
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    receiver.default = Reply.server_error()
    delivery = _confirmed(book, t0)

    # Down for an hour (the old budget, 12 attempts, gave up after ~18 minutes on average, 37 at the most).
    result, span, _ = _send_until(delivery.pk, stop=lambda elapsed: elapsed >= 3600)
    assert result.status == DeliveryStatus.RETRYING
    delivery.refresh_from_db()
    assert delivery.next_attempt_at is not None  # the delivery log shows when it tries next
    _pass(delivery.pk, result.retry_in)

    receiver.default = Reply.ok()
    assert services.delivery_send(delivery_id=delivery.pk).status == DeliveryStatus.DELIVERED
    assert receiver.requests[-1].json()["text"]


def test_the_retry_window_can_be_turned_off_to_count_attempts_only(
        world, t0, book, receiver, slack_for, defaults):
    defaults.PORTAL_NOTIFY_RETRY_HOURS = 0
    defaults.PORTAL_NOTIFY_MAX_ATTEMPTS = 3
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    receiver.default = Reply.server_error()
    delivery = _confirmed(book, t0)

    result, _, waits = _send_until(delivery.pk, stop=lambda elapsed: False)

    assert result.status == DeliveryStatus.FAILED and len(waits) == 2
    assert Delivery.objects.get(pk=delivery.pk).last_error == "rollup_error (gave up after 3 attempts)"


def test_a_negative_retry_window_is_refused_before_anything_is_claimed(
        world, t0, book, receiver, slack_for, defaults):
    defaults.PORTAL_NOTIFY_RETRY_HOURS = -1
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    delivery = _confirmed(book, t0)
    with pytest.raises(ImproperlyConfigured, match="PORTAL_NOTIFY_RETRY_HOURS"):
        services.delivery_send(delivery_id=delivery.pk)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, len(receiver.requests)) == (DeliveryStatus.PENDING, 0, 0)


def test_a_receiver_asking_to_retry_in_a_second_all_day_does_not_cost_an_attempt_a_second(
        world, t0, book, receiver, slack_for, defaults):
    url = receiver.url("/services/T0/B0/alpha")
    slack_for("alpha", url)
    receiver.default = Reply.rate_limited(1)
    delivery = _confirmed(book, t0)
    client = ratelimit.client_from_url(settings.REDIS_URL)
    elapsed = 0.0
    try:
        for _ in range(300):
            client.delete(ratelimit.key_for_url(url))  # the second its 429 held the URL for has passed too
            result = services.delivery_send(delivery_id=delivery.pk)
            assert result.posted
            if result.retry_in is None:
                break
            elapsed += result.retry_in
            _pass(delivery.pk, result.retry_in)
    finally:
        client.close()

    delivery.refresh_from_db()
    assert result.status == DeliveryStatus.FAILED and elapsed >= 24 * 3600
    assert delivery.attempts < 150  # the first dozen as it asks, then the backoff's waits
