"""A test message checks the receiver now: a few tries within a minute, then failed with the receiver's answer.

Found in a review: test messages took the event deliveries' policy, retried for at least a day
(PORTAL_NOTIFY_RETRY_HOURS), so a lead who pressed "Send test message" for a receiver that was down saw it
"retrying" for hours and learned nothing. Real events keep the day-long policy (tests/notify/test_retry_window).

The clock is driven, not slept: after each attempt the delivery's history moves back by the wait it asked for."""

from __future__ import annotations

import time

import pytest
from django.test import Client
from django.urls import reverse

from notifications import services
from notifications.choices import DeliveryStatus
from notifications.models import Delivery
from notifications.slack import Event
from tests.notifications.receiver import Reply

from .conftest import let_time_pass as _pass

pytestmark = pytest.mark.django_db


@pytest.fixture
def defaults(notify_settings):
    """The shipped retry policy (the app's defaults), with the per-URL send slot out of the way."""
    for name in ("PORTAL_NOTIFY_BACKOFF_BASE", "PORTAL_NOTIFY_BACKOFF_CAP", "PORTAL_NOTIFY_MAX_ATTEMPTS",
                 "PORTAL_NOTIFY_RETRY_HOURS", "PORTAL_NOTIFY_TEST_RETRY_SECONDS", "PORTAL_NOTIFY_TEST_MAX_ATTEMPTS"):
        if hasattr(notify_settings, name):
            delattr(notify_settings, name)
    notify_settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.001
    return notify_settings


@pytest.fixture
def lead(world) -> Client:
    client = Client()
    client.force_login(world.users["alpha-lead"])
    return client


def _send_until_final(delivery_id: int, *, give_up_after_s: float) -> float:
    """Attempt and wait (driven) until the delivery is final or give_up_after_s have passed; the time it took."""
    elapsed = 0.0
    for _ in range(200):
        result = services.delivery_send(delivery_id=delivery_id)
        if result.retry_in is None:
            return elapsed
        if not result.posted:  # the per-URL send slot (real time, a millisecond)
            time.sleep(0.01)
            continue
        elapsed += result.retry_in
        if elapsed > give_up_after_s:
            return elapsed
        _pass(delivery_id, result.retry_in)
    raise AssertionError("the delivery never ended")


def _sent_test(lead: Client, kind: str, channel) -> Delivery:
    url = reverse("notifications:slack-test") if kind == "slack" else reverse("notifications:channel-test",
                                                                               args=[channel.pk])
    assert lead.post(url).status_code == 302
    return Delivery.objects.get(event=Event.TEST, channel=channel)


@pytest.fixture(params=["slack", "webhook"])
def channel_to(request, slack_for, webhook_for, receiver):
    def _channel():
        if request.param == "slack":
            return "slack", slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
        return "webhook", webhook_for("alpha", receiver.url("/ci/hook"))[0]

    return _channel


def test_a_test_message_to_a_receiver_that_is_down_fails_within_a_minute_and_the_page_says_why(
        world, lead, receiver, channel_to, defaults):
    kind, channel = channel_to()
    receiver.default = Reply.server_error(b"upstream is down")
    test = _sent_test(lead, kind, channel)

    took = _send_until_final(test.pk, give_up_after_s=120)

    test.refresh_from_db()
    assert test.status == DeliveryStatus.FAILED, f"still {test.status} after {took:.0f} s ({test.attempts} attempts)"
    assert took <= 60 and 1 <= test.attempts <= 3 and test.attempts == len(receiver.requests)
    assert test.last_status_code == 500 and "upstream is down" in test.last_error
    html = lead.get(reverse("notifications:settings")).content.decode()
    result = html.split('data-test-result="failed"', 1)[1].split("</p>", 1)[0]
    assert "HTTP 500" in result and "upstream is down" in result and f"{test.attempts} attempt" in result
    # The test says nothing of the channel's events: a real message to the same receiver keeps trying (a day).
    channel.refresh_from_db()
    assert not channel.is_broken


def test_a_test_message_the_receiver_answers_is_shown_delivered(world, lead, receiver, channel_to, defaults):
    kind, channel = channel_to()
    test = _sent_test(lead, kind, channel)
    html = lead.get(reverse("notifications:settings")).content.decode()
    assert 'data-test-result="pending"' in html and "reload for the result" in html

    _send_until_final(test.pk, give_up_after_s=0)

    html = lead.get(reverse("notifications:settings")).content.decode()
    result = html.split('data-test-result="delivered"', 1)[1].split("</p>", 1)[0]
    assert "HTTP 200" in result


def test_a_test_message_told_to_wait_an_hour_fails_now_saying_so(world, lead, receiver, channel_to, defaults):
    kind, channel = channel_to()
    receiver.default = Reply.rate_limited(retry_after=3600)
    test = _sent_test(lead, kind, channel)

    _send_until_final(test.pk, give_up_after_s=120)

    test.refresh_from_db()
    assert test.status == DeliveryStatus.FAILED and test.attempts == 1
    assert test.last_status_code == 429 and "rate_limited" in test.last_error
    # A second test right after finds the URL's send slot held for the hour: failed at once, not parked for it.
    second = _sent_test_again(lead, kind, channel, after=test)
    _send_until_final(second.pk, give_up_after_s=120)
    second.refresh_from_db()
    assert second.status == DeliveryStatus.FAILED and second.attempts == 0 and "Retry-After" in second.last_error
    assert len(receiver.requests) == 1


def _sent_test_again(lead: Client, kind: str, channel, *, after: Delivery) -> Delivery:
    url = reverse("notifications:slack-test") if kind == "slack" else reverse("notifications:channel-test",
                                                                               args=[channel.pk])
    assert lead.post(url).status_code == 302
    return Delivery.objects.filter(event=Event.TEST, channel=channel).exclude(pk=after.pk).get()


def test_event_deliveries_keep_the_day_long_policy(world, t0, book, receiver, slack_for, defaults):
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    receiver.default = Reply.server_error()
    reservation = book("alpha", t0)
    (delivery,) = services.event_fanout(event="reservation.confirmed",
                                        payload={"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id})

    _send_until_final(delivery.pk, give_up_after_s=300)

    assert Delivery.objects.get(pk=delivery.pk).status == DeliveryStatus.RETRYING
