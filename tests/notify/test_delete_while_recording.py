"""A channel deleted while a worker records a send's outcome to it: the two queue, neither fails.

Found in a review: channel_delete locked the channel's row and then (on_delete=SET_NULL) its deliveries' rows,
while the worker recording an outcome (_record) locks the delivery's row and then, to flag the channel broken
(a permanent error) or repaired (a delivered message to a broken channel), the channel's. Met halfway, each
waited on the other until PostgreSQL broke the deadlock (40P01): the lead's delete failed (a 500 on the page)
or the worker's recording did (the task failed, the attempt stayed "sending" until its lease ran out).

Real threads on the real database, both sides the real service code. A third transaction (the gate) holds the
channel's row; the delete is started first and queues behind it, then the recording, so that when the gate
commits, the delete is first in line for the channel while the recording already holds what it locks first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone

from notifications import services, transport
from notifications.choices import ChannelKind, DeliveryStatus
from notifications.models import Channel, Delivery
from tenants.services import tenant_slack_webhook_set

from ..conftest import make_world
from ..racing import in_turn

URL = "https://93.184.216.34/hook"


def _sending(world, *, broken: bool) -> tuple[Channel, Delivery, Any]:
    """An alpha webhook with a test message claimed by a worker (the POST made): (channel, delivery, claim)."""
    staff, tenant = world.users["staff"], world.tenants["alpha"]
    channel, _ = services.webhook_create(actor=staff, tenant=tenant, url=URL, name="ci")
    if broken:
        Channel.objects.filter(pk=channel.pk).update(broken_at=timezone.now(), broken_error="http_500",
                                                     broken_status=500, broken_url_fp="old")
    delivery = services.channel_send_test(actor=staff, channel=channel)
    claim = services._claim(delivery.pk, now=timezone.now(), worker="test-worker")
    assert claim is not None
    return channel, delivery, claim


def _gate(channel_pk: int) -> Callable[[], None]:
    def hold() -> None:
        list(Channel.objects.select_for_update(of=("self",)).filter(pk=channel_pk))
    return hold


OUTCOMES = {
    # A permanent error flags the channel broken (_mark_broken).
    "gone": (False, transport.Outcome(verdict=transport.Verdict.PERMANENT, status=410, error="http_410"),
             DeliveryStatus.FAILED),
    # A delivered message to a broken channel marks it repaired (_mark_repaired).
    "delivered": (True, transport.Outcome(verdict=transport.Verdict.DELIVERED, status=200),
                  DeliveryStatus.DELIVERED),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_a_channel_deleted_while_a_send_outcome_is_recorded_is_deleted_and_the_outcome_kept(outcome,
                                                                                           notify_settings):
    broken, result, status = OUTCOMES[outcome]
    world = make_world()
    channel, delivery, (token, attempt) = _sending(world, broken=broken)
    lead = world.users["alpha-lead"]
    deleted, recorded = in_turn(_gate(channel.pk), [
        lambda: services.channel_delete(actor=lead, channel=channel),
        lambda: services._record(delivery.pk, token=token, attempt=attempt, url=URL, outcome=result),
    ])
    assert not isinstance(deleted, Exception), f"the delete failed: {deleted!r}"
    assert not isinstance(recorded, Exception), f"the recording failed: {recorded!r}"
    assert recorded.status == status
    assert not Channel.objects.filter(pk=channel.pk).exists()
    row = Delivery.objects.get(pk=delivery.pk)
    assert (row.status, row.channel_id, row.lease_until, row.claim) == (status, None, None, None)
    assert [a.verdict for a in row.attempt_log.all()] == [str(result.verdict)]


@pytest.mark.django_db(transaction=True)
def test_the_tenant_slack_channel_deleted_while_a_send_outcome_is_recorded(notify_settings):
    """The Slack channel's delete (which first clears the tenant's Slack URL) takes the same locks."""
    world = make_world()
    staff, tenant = world.users["staff"], world.tenants["alpha"]
    tenant = tenant_slack_webhook_set(actor=staff, tenant=tenant, url="https://hooks.slack.com/services/T0/B0/a")
    channel = services.slack_channel_ensure(tenant)
    assert channel is not None and channel.kind == ChannelKind.SLACK
    delivery = services.channel_send_test(actor=staff, channel=channel)
    token, attempt = services._claim(delivery.pk, now=timezone.now(), worker="test-worker")
    result = transport.Outcome(verdict=transport.Verdict.PERMANENT, status=404, error="channel_not_found")
    deleted, recorded = in_turn(_gate(channel.pk), [
        lambda: services.channel_delete(actor=world.users["alpha-lead"], channel=channel),
        lambda: services._record(delivery.pk, token=token, attempt=attempt, url=channel.target_url(),
                                 outcome=result),
    ])
    assert not isinstance(deleted, Exception), f"the delete failed: {deleted!r}"
    assert not isinstance(recorded, Exception), f"the recording failed: {recorded!r}"
    assert not Channel.objects.filter(pk=channel.pk).exists()
    assert Delivery.objects.values_list("status", "channel_id").get(pk=delivery.pk) == (DeliveryStatus.FAILED, None)
