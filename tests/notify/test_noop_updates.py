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
