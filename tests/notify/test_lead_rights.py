"""Only staff and the tenant's leads manage its notification channels, decided by the services under the team lock.

Found in a review: the services checked no rights; the lead's role was checked by the page before the service
ran, so a lead demoted or removed while the request ran still added a webhook (and so received the tenant's
events), re-pointed one or changed the Slack subscriptions. Real threads on the real database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from notifications import services
from notifications.choices import ChannelKind, DeliveryStatus
from notifications.models import Channel, Delivery
from portal.core.exceptions import InvalidState, PermissionDenied
from portal.core.models import AuditLog
from tenants.choices import Role
from tenants.models import Membership
from tenants.services import tenant_slack_webhook_set

from ..conftest import make_world
from ..racing import behind_a_lock, demoting

URL = "https://93.184.216.34/hook"
OTHER_URL = "https://93.184.216.35/elsewhere"


def _race(world, change: str | None, call: Callable[[], Any]) -> dict:
    """Run call while another transaction demotes or removes alpha-lead (alpha-member stays a lead): the call
    either queues on the team lock, so the change commits first, or ran past it."""
    tenant = world.tenants["alpha"]
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)
    outcome = behind_a_lock(demoting(lead.pk, change), call, waits_on="tenants_membership")
    return {"error": outcome} if isinstance(outcome, Exception) else {"value": outcome}


def _page(world, who: str) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


def _snapshot(tenant_id: int) -> list[tuple]:
    fields = ("pk", "kind", "name", "url", "secret", "events", "enabled", "broken_at", "broken_error")
    return sorted(Channel.objects.filter(tenant_id=tenant_id).values_list(*fields), key=lambda row: row[0])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_adding_a_webhook_on_the_page_is_refused(change, notify_settings):
    world = make_world()
    tenant = world.tenants["alpha"]
    client = _page(world, "alpha-lead")
    result = _race(world, change, lambda: client.post(
        "/notifications/webhooks/", {"name": "mine", "url": URL, "events": ["reservation.confirmed"]}))
    assert "error" not in result, result
    assert result["value"].status_code == 403
    assert not Channel.objects.filter(tenant=tenant, kind=ChannelKind.WEBHOOK).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_changing_slack_subscriptions_on_the_page_is_refused(change,
                                                                                               notify_settings):
    world = make_world()
    tenant = tenant_slack_webhook_set(actor=world.users["staff"], tenant=world.tenants["alpha"],
                                      url="https://hooks.slack.com/services/T0/B0/alpha")
    services.slack_channel_ensure(tenant)
    before = _snapshot(tenant.pk)
    client = _page(world, "alpha-lead")
    result = _race(world, change, lambda: client.post(
        "/notifications/slack/events/", {"events": ["reservation.confirmed"], "enabled": ""}))
    assert "error" not in result, result
    assert result["value"].status_code == 403
    assert _snapshot(tenant.pk) == before


def _prepared(world) -> dict[str, Any]:
    """An alpha webhook, its Slack channel and a failed delivery, made by staff."""
    staff, tenant = world.users["staff"], world.tenants["alpha"]
    tenant = tenant_slack_webhook_set(actor=staff, tenant=tenant, url="https://hooks.slack.com/services/T0/B0/a")
    slack = services.slack_channel_ensure(tenant)
    webhook, _ = services.webhook_create(actor=staff, tenant=tenant, url=URL, name="ci")
    Channel.objects.filter(pk=webhook.pk).update(broken_error="http_410")
    delivery = services.channel_send_test(actor=staff, channel=webhook)
    Delivery.objects.filter(pk=delivery.pk).update(status=DeliveryStatus.FAILED)
    return {"tenant": tenant, "slack": slack, "webhook": webhook, "delivery": delivery}


# Every service a lead calls to manage the tenant's channels, as a call by actor on what _prepared made.
CALLS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "webhook_create": lambda actor, p: services.webhook_create(actor=actor, tenant=p["tenant"], url=OTHER_URL,
                                                               name="mine"),
    "webhook_update": lambda actor, p: services.webhook_update(actor=actor, channel=p["webhook"], url=OTHER_URL,
                                                               events=["reservation.confirmed"]),
    "webhook_rotate_secret": lambda actor, p: services.webhook_rotate_secret(actor=actor, channel=p["webhook"]),
    "webhook_delete": lambda actor, p: services.channel_delete(actor=actor, channel=p["webhook"]),
    "slack_delete": lambda actor, p: services.channel_delete(actor=actor, channel=p["slack"]),
    "channel_clear_broken": lambda actor, p: services.channel_clear_broken(actor=actor, channel=p["webhook"]),
    "channel_send_test": lambda actor, p: services.channel_send_test(actor=actor, channel=p["webhook"]),
    "slack_subscriptions_update": lambda actor, p: services.slack_subscriptions_update(
        actor=actor, tenant=p["tenant"], events=["reservation.confirmed"], enabled=False),
    "delivery_requeue": lambda actor, p: services.delivery_requeue(actor=actor, delivery=p["delivery"]),
}


def _state(tenant_id: int) -> tuple:
    from tenants.models import Tenant

    return (_snapshot(tenant_id),
            sorted(Delivery.objects.filter(tenant_id=tenant_id).values_list("pk", "status", "channel_id")),
            Tenant.objects.values_list("slack_webhook_url", flat=True).get(pk=tenant_id))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", list(CALLS))
def test_a_lead_demoted_while_calling_a_notification_service_is_refused_and_nothing_changes(name, notify_settings):
    world = make_world()
    prepared = _prepared(world)
    before = _state(prepared["tenant"].pk)
    result = _race(world, Role.MEMBER, lambda: CALLS[name](world.users["alpha-lead"], prepared))
    assert isinstance(result.get("error"), PermissionDenied), result
    assert _state(prepared["tenant"].pk) == before


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer", "beta-lead"])
@pytest.mark.parametrize("name", list(CALLS))
def test_only_a_lead_of_the_tenant_may_call_a_notification_service(name, who, world, notify_settings):
    prepared = _prepared(world)
    before = _state(prepared["tenant"].pk)
    with pytest.raises(PermissionDenied):
        CALLS[name](world.users[who], prepared)
    assert _state(prepared["tenant"].pk) == before


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["alpha-lead", "staff"])
@pytest.mark.parametrize("name", list(CALLS))
def test_the_tenants_lead_and_staff_still_may(name, who, world, notify_settings):
    prepared = _prepared(world)
    before = _state(prepared["tenant"].pk)
    CALLS[name](world.users[who], prepared)
    assert _state(prepared["tenant"].pk) != before


@pytest.mark.django_db
def test_the_platform_channel_is_staffs_only(world, notify_settings):
    notify_settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T0/B0/platform"
    platform = services.platform_channel_ensure()
    for who in ("alpha-lead", "alpha-member"):
        actor = world.users[who]
        for service, extra in ((services.platform_channel_update, {"enabled": False}),
                               (services.channel_clear_broken, {}), (services.channel_send_test, {})):
            with pytest.raises(PermissionDenied):
                service(actor=actor, channel=platform, **extra)
    platform.refresh_from_db()
    assert platform.enabled and not Delivery.objects.filter(channel=platform).exists()
    services.platform_channel_update(actor=world.users["staff"], channel=platform, enabled=False)
    platform.refresh_from_db()
    assert not platform.enabled


@pytest.mark.django_db(transaction=True)
def test_a_test_message_to_a_channel_without_url_is_refused_to_a_non_lead_for_the_right_not_the_url(notify_settings):
    """The right comes first: a member is told 403, not "No webhook URL" (409), and nothing is queued or audited."""
    world = make_world()
    webhook, _ = services.webhook_create(actor=world.users["staff"], tenant=world.tenants["alpha"], url=URL,
                                         name="ci")
    Channel.objects.filter(pk=webhook.pk).update(url="")
    webhook.refresh_from_db()
    audits = AuditLog.objects.count()
    for who in ("alpha-member", "alpha-viewer", "beta-lead"):
        with pytest.raises(PermissionDenied):
            services.channel_send_test(actor=world.users[who], channel=webhook)
    assert not Delivery.objects.exists()
    assert AuditLog.objects.count() == audits
    with pytest.raises(InvalidState, match="No webhook URL"):  # a lead still hears about the URL
        services.channel_send_test(actor=world.users["alpha-lead"], channel=webhook)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_testing_a_channel_without_url_on_the_page_gets_403(change,
                                                                                          notify_settings):
    world = make_world()
    webhook, _ = services.webhook_create(actor=world.users["staff"], tenant=world.tenants["alpha"], url=URL,
                                         name="ci")
    Channel.objects.filter(pk=webhook.pk).update(url="")
    client = _page(world, "alpha-lead")
    result = _race(world, change, lambda: client.post(f"/notifications/channels/{webhook.pk}/test/"))
    assert "error" not in result, result
    assert result["value"].status_code == 403
    assert not Delivery.objects.exists()


@pytest.mark.django_db
def test_deleting_the_platform_channel_is_refused_to_a_non_staff_for_the_right_first(world, notify_settings):
    """The right comes first, as in every other channel service: a lead asking to delete the platform channel was
    told it "comes from PORTAL_PLATFORM_SLACK_WEBHOOK" (409 invalid_state), not 403."""
    notify_settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T0/B0/platform"
    platform = services.platform_channel_ensure()
    for who in ("alpha-lead", "alpha-member"):
        with pytest.raises(PermissionDenied):
            services.channel_delete(actor=world.users[who], channel=platform)
    with pytest.raises(InvalidState):
        services.channel_delete(actor=world.users["staff"], channel=platform)
    assert Channel.objects.filter(pk=platform.pk).exists()
