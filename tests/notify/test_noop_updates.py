"""A save that changes nothing is neither written nor audited (tenants' quota_update and Slack URL,
slack_subscriptions_update): the audit log lists changes, not page saves."""

from __future__ import annotations

import pytest

from notifications import services
from notifications.models import Channel
from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db

PLATFORM_URL = "https://hooks.slack.com/services/T0/B0/platform"


def test_a_platform_channel_save_that_changes_nothing_writes_no_audit_row(world, notify_settings):
    notify_settings.PORTAL_PLATFORM_SLACK_WEBHOOK = PLATFORM_URL
    channel = services.platform_channel_ensure()
    staff = world.users["staff"]
    updated_at = channel.updated_at
    # The same flag, the same events (in another order): nothing to say.
    services.platform_channel_update(actor=staff, channel=channel, enabled=channel.enabled,
                                     events=list(reversed(channel.events)))
    services.platform_channel_update(actor=staff, channel=channel)
    assert not AuditLog.objects.filter(action="notifications.platform.update").exists()
    assert Channel.objects.get(pk=channel.pk).updated_at == updated_at  # not written either
    # A real change still is, once.
    services.platform_channel_update(actor=staff, channel=channel, enabled=False)
    (audit,) = AuditLog.objects.filter(action="notifications.platform.update")
    assert audit.before["enabled"] is True and audit.after["enabled"] is False


URL = "https://93.184.216.34/hook"


def test_a_webhook_save_that_changes_nothing_writes_no_audit_row(world, notify_settings):
    """The lead's page posts every field of the webhook's form: saving it unchanged wrote an audit row whose
    before and after were the same."""
    lead = world.users["alpha-lead"]
    channel, _ = services.webhook_create(actor=lead, tenant=world.tenants["alpha"], url=URL, name="ci",
                                         events=["reservation.confirmed", "cluster.ready"])
    updated_at = Channel.objects.get(pk=channel.pk).updated_at
    services.webhook_update(actor=lead, channel=channel, name="ci", url=URL,
                            events=["cluster.ready", "reservation.confirmed"], enabled=True)
    services.webhook_update(actor=lead, channel=channel)
    assert not AuditLog.objects.filter(action="notifications.webhook.update").exists()
    assert Channel.objects.get(pk=channel.pk).updated_at == updated_at


def test_a_new_url_that_masks_the_same_is_still_a_change(world, notify_settings):
    """Compared on what is stored, not on the masked URL the audit row shows (two URLs may mask alike)."""
    lead = world.users["alpha-lead"]
    channel, _ = services.webhook_create(actor=lead, tenant=world.tenants["alpha"], url=URL, name="ci")
    other = "https://93.184.216.35/hook"
    services.webhook_update(actor=lead, channel=channel, url=other)
    assert Channel.objects.get(pk=channel.pk).url == other
    assert AuditLog.objects.filter(action="notifications.webhook.update").count() == 1
