"""A worker that decides to skip (or fail) a delivery leaves it alone when another worker has claimed it meanwhile.

Found in a review: delivery_send read the row, decided it must not be sent (its channel disabled, a reminder
now false, a destination now private) and marked it skipped or failed with an UPDATE that only asked "not
finished yet". Two copies of the task run (the sweeper's, a redelivered message): when the other copy had
claimed the row in between and was posting, the skip overwrote its claim. The sender's outcome was then
dropped as a lost claim's: a Slack 404 left the delivery "skipped" and the channel never flagged broken.

Real threads on the real database: the other worker's claim holds the row (uncommitted) while this worker's
skip reaches it, then commits; the skip's UPDATE re-checks its condition against the claimed row.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from notifications import services, transport
from notifications.choices import DeliveryStatus
from notifications.models import Channel, Delivery, DeliveryAttempt
from tenants.services import tenant_slack_webhook_set

from ..conftest import make_world
from ..racing import behind_a_lock

URL = "https://hooks.slack.com/services/T0/B0/alpha"


@pytest.mark.django_db(transaction=True)
def test_a_skip_does_not_overwrite_another_workers_claim(notify_settings):
    world = make_world()
    staff = world.users["staff"]
    tenant = tenant_slack_webhook_set(actor=staff, tenant=world.tenants["alpha"], url=URL)
    channel = services.slack_channel_ensure(tenant)
    delivery = services.channel_send_test(actor=staff, channel=channel)
    # A test message is sent even to a disabled channel; an ordinary one is skipped there.
    Delivery.objects.filter(pk=delivery.pk).update(event="reservation.confirmed")
    Channel.objects.filter(pk=channel.pk).update(enabled=False)
    token = uuid.uuid4()

    def other_worker_claims() -> None:  # as _claim does, in a transaction that commits once ours is waiting
        now = timezone.now()
        Delivery.objects.filter(pk=delivery.pk).update(
            status=DeliveryStatus.SENDING, claim=token, lease_until=now + timedelta(seconds=30),
            attempts=F("attempts") + 1, last_attempt_at=now)
        DeliveryAttempt.objects.create(delivery_id=delivery.pk, number=1, started_at=now, worker="other")

    result = behind_a_lock(other_worker_claims, lambda: services.delivery_send(delivery_id=delivery.pk),
                           waits_on="notifications_delivery")

    assert not isinstance(result, Exception), repr(result)
    assert not result.posted and result.retry_in is not None  # it comes back when the lease is up
    row = Delivery.objects.get(pk=delivery.pk)
    assert (row.status, row.claim) == (DeliveryStatus.SENDING, token)
    # The sender's outcome counts: Slack said the hook is gone, so the delivery failed and the channel is broken.
    attempt = DeliveryAttempt.objects.get(delivery_id=delivery.pk)
    gone = transport.Outcome(verdict=transport.Verdict.PERMANENT, status=404, error="channel_not_found")
    assert services._record(delivery.pk, token=token, attempt=attempt, url=URL, outcome=gone).status == "failed"
    assert Delivery.objects.get(pk=delivery.pk).status == DeliveryStatus.FAILED
    assert Channel.objects.get(pk=channel.pk).broken_error == "channel_not_found"
