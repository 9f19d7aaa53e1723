"""Deleting a tenant's Slack channel: the URL and the channel go together, or neither does.

Found in a review: channel_delete cleared the tenant's Slack URL in one transaction (tenant_slack_webhook_set)
and deleted the channel's row in a second. A failure in the second left the URL gone and the channel still
there; and a new URL set between the two (another lead, or staff, pasting the new hook) was announced to a
channel row that the second transaction then deleted: the tenant had a Slack URL but no channel, and the
quota alerts sent to the new URL on its arrival went to the deleted row and were skipped.
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError

from notifications import services
from notifications.choices import ChannelKind
from notifications.models import Channel
from portal.core.models import AuditLog
from tenants.choices import Role
from tenants.models import Membership, Tenant
from tenants.services import tenant_slack_webhook_set

from ..conftest import make_world
from ..racing import in_turn

OLD = "https://hooks.slack.com/services/T0/B0/old"
NEW = "https://hooks.slack.com/services/T0/B0/new"


def _slack_channel(world) -> Channel:
    tenant = tenant_slack_webhook_set(actor=world.users["staff"], tenant=world.tenants["alpha"], url=OLD)
    channel = services.slack_channel_ensure(tenant)
    assert channel is not None and channel.kind == ChannelKind.SLACK
    return channel


@pytest.mark.django_db(transaction=True)
def test_a_new_slack_url_set_while_the_channel_is_deleted_keeps_its_channel(notify_settings):
    world = make_world()
    channel = _slack_channel(world)
    tenant_id = channel.tenant_id

    def team_lock() -> None:  # the lock both sides take first (a lead being demoted holds it, say)
        list(Membership.objects.select_for_update().filter(tenant_id=tenant_id, role=Role.LEAD))

    deleted, replaced = in_turn(team_lock, [
        lambda: services.channel_delete(actor=world.users["alpha-lead"], channel=channel),
        lambda: tenant_slack_webhook_set(actor=world.users["staff"], tenant=Tenant.objects.get(pk=tenant_id), url=NEW),
    ], waits_on="tenants_membership")

    assert not isinstance(deleted, Exception), f"the delete failed: {deleted!r}"
    assert not isinstance(replaced, Exception), f"the new URL failed: {replaced!r}"
    # Either order is a consistent outcome: deleted then replaced (the new URL with a channel of its own), or
    # replaced then deleted (no URL, no channel). The URL without its channel is neither.
    url = Tenant.objects.get(pk=tenant_id).slack_webhook_url
    channels = list(Channel.objects.filter(tenant_id=tenant_id, kind=ChannelKind.SLACK).values_list("pk", flat=True))
    assert (url, bool(channels)) in [(NEW, True), ("", False)], (url, channels)
    assert channel.pk not in channels


@pytest.mark.django_db(transaction=True)
def test_a_failed_slack_channel_delete_keeps_the_url(notify_settings, monkeypatch):
    world = make_world()
    channel = _slack_channel(world)

    def fail(*args, **kwargs):
        raise DatabaseError("the disk is full")

    monkeypatch.setattr(Channel, "delete", fail)
    with pytest.raises(DatabaseError):
        services.channel_delete(actor=world.users["alpha-lead"], channel=channel)

    assert Tenant.objects.get(pk=channel.tenant_id).slack_webhook_url == OLD
    assert Channel.objects.filter(pk=channel.pk).exists()
    assert not AuditLog.objects.filter(action__in=["tenant.slack_webhook", "notifications.channel.delete"],
                                       actor=world.users["alpha-lead"]).exists()


@pytest.mark.django_db(transaction=True)
def test_deleting_the_slack_channel_clears_the_url_audited_once(notify_settings):
    world = make_world()
    channel = _slack_channel(world)
    lead = world.users["alpha-lead"]

    services.channel_delete(actor=lead, channel=channel)

    assert Tenant.objects.get(pk=channel.tenant_id).slack_webhook_url == ""
    assert not Channel.objects.filter(pk=channel.pk).exists()
    (cleared,) = AuditLog.objects.filter(action="tenant.slack_webhook", actor=lead)
    assert cleared.after == {"slack_webhook_url": ""}
    assert AuditLog.objects.filter(action="notifications.channel.delete", actor=lead).count() == 1
