"""Tenants' webhook and Slack URLs reach public addresses only (portal/core/egress.py): no probing of the
platform's own network through the notifier. The suite's receivers listen on loopback, so the test
settings allow private addresses; these tests put the production default back."""

from __future__ import annotations

import pytest

from notifications import services
from notifications.choices import DeliveryStatus
from notifications.models import Channel, Delivery
from portal.core.egress import destination_problem
from portal.core.exceptions import InvalidInput
from tenants.models import Tenant
from tenants.services import tenant_slack_webhook_set

pytestmark = pytest.mark.django_db


@pytest.fixture
def public_only(settings):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    return settings


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/metrics", "http://localhost/", "http://LOCALHOST./x", "http://api.localhost/",
    "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data/",
    "http://100.64.0.1/", "http://0.0.0.0/", "http://[::1]:6379/", "http://[::ffff:127.0.0.1]/",
    "http://[fe80::1]/", "http://[fd00::1]/", "http://224.0.0.1/", "https://user:pw@127.0.0.2/",
    "http://2130706433/",  # 127.0.0.1 written as one number: caught after resolving
])
def test_private_destinations_are_named(public_only, url):
    assert destination_problem(url) is not None


@pytest.mark.parametrize("url", [
    "https://hooks.slack.com/services/T0/B0/x", "https://93.184.216.34/hook", "https://[2606:4700::1111]/",
    "https://no-such-host.invalid/hook",  # does not resolve now: the send fails and is retried
])
def test_public_destinations_pass(public_only, url):
    assert destination_problem(url) is None


@pytest.mark.parametrize("url", [
    "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/",  # NAT64 (RFC 6052) of 169.254.169.254
    "http://[64:ff9b::10.0.0.1]/", "http://[64:ff9b::7f00:1]:6379/",
    "http://[2002:a00:1::1]/",  # 6to4 (RFC 3056) of 10.0.0.1
    "http://[::10.0.0.1]/", "http://[::127.0.0.1]/",  # IPv4-compatible (deprecated, RFC 4291 2.5.5.1)
])
def test_private_ipv4_addresses_inside_ipv6_ones_are_named(public_only, url):
    """An IPv6 address that carries an IPv4 one reaches that IPv4 address where the network translates it:
    behind NAT64 (an IPv6-only cluster's way out, which may also reach the VPC's own IPv4 services)
    64:ff9b::a9fe:a9fe is the metadata service. Python calls these prefixes global, so only the
    IPv4-mapped form (::ffff:a.b.c.d) was refused; a name resolving to such an address was let through."""
    assert destination_problem(url) is not None


@pytest.mark.parametrize("url", ["https://[64:ff9b::5db8:d822]/hook", "https://[2002:5db8:d822::1]/hook"])
def test_public_ipv4_addresses_inside_ipv6_ones_pass(public_only, url):
    assert destination_problem(url) is None  # 93.184.216.34 by NAT64 and by 6to4


def test_the_setting_lets_private_addresses_through(settings):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = True
    assert destination_problem("http://127.0.0.1:1/x") is None


def test_a_lead_cannot_register_or_repoint_a_webhook_at_the_platforms_network(world, public_only):
    lead, tenant = world.users["alpha-lead"], world.tenants["alpha"]
    with pytest.raises(InvalidInput) as exc:
        services.webhook_create(actor=lead, tenant=tenant, url="http://169.254.169.254/latest/", name="x")
    assert exc.value.fields == {"url": "Give a public http(s) URL."}
    assert not Channel.objects.filter(tenant=tenant, kind="webhook").exists()
    channel, _ = services.webhook_create(actor=lead, tenant=tenant, url="https://93.184.216.34/hook", name="ok")
    with pytest.raises(InvalidInput):
        services.webhook_update(actor=lead, channel=channel, url="http://[::1]:6379/")
    channel.refresh_from_db()
    assert channel.url == "https://93.184.216.34/hook"


def test_a_lead_cannot_point_the_tenants_slack_webhook_at_loopback(world, public_only):
    lead, tenant = world.users["alpha-lead"], world.tenants["alpha"]
    with pytest.raises(InvalidInput) as exc:
        tenant_slack_webhook_set(actor=lead, tenant=tenant, url="http://localhost:6379/")
    assert "public addresses" in str(exc.value)
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == ""


def test_the_browser_form_refuses_it_and_stores_nothing(world, public_only):
    from django.test import Client

    client = Client()
    client.force_login(world.users["alpha-lead"])
    page = client.post("/notifications/webhooks/", {"url": "http://127.0.0.1:8000/metrics", "name": "probe",
                                                    "events": ["reservation.confirmed"]}, follow=True)
    assert page.status_code == 400  # re-rendered with what was typed (was: a redirect)
    assert "public addresses" in page.content.decode()
    assert not Channel.objects.filter(kind="webhook").exists()


def test_control_characters_in_a_webhook_name_or_url_are_refused(world, settings):
    lead, tenant = world.users["alpha-lead"], world.tenants["alpha"]
    for name in ("\x01ctl", "line\nbreak", "tab\there"):
        with pytest.raises(InvalidInput) as exc:
            services.webhook_create(actor=lead, tenant=tenant, url="https://93.184.216.34/hook", name=name)
        assert "name" in exc.value.fields
    with pytest.raises(InvalidInput):
        services.webhook_create(actor=lead, tenant=tenant, url="https://93.184.216.34/h\x01ook", name="x")
    with pytest.raises(InvalidInput):
        tenant_slack_webhook_set(actor=lead, tenant=tenant, url="https://x.example.com/\x01")
    assert not Channel.objects.filter(kind="webhook").exists()


def test_a_url_that_points_inside_by_send_time_is_not_posted_to(world, receiver, webhook_for, settings):
    # Saved while allowed (or a public name re-pointed since): the check at send time stops it.
    channel, _ = webhook_for("alpha", receiver.url("/hook"))
    delivery = services.channel_send_test(actor=world.users["alpha-lead"], channel=channel)
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    result = services.delivery_send(delivery_id=delivery.pk)
    assert result.status == DeliveryStatus.FAILED
    delivery = Delivery.objects.get(pk=delivery.pk)
    assert delivery.last_error.startswith("blocked_destination: 127.0.0.1 is not a public address")
    assert receiver.requests == []  # nothing left the portal


def test_the_platforms_own_slack_webhook_is_the_operators_and_not_checked(world, receiver, notify_settings):
    notify_settings.PORTAL_PLATFORM_SLACK_WEBHOOK = receiver.url("/services/T0/B0/platform")
    channel = services.platform_channel_ensure()
    delivery = services.channel_send_test(actor=world.users["staff"], channel=channel)
    notify_settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    assert services.delivery_send(delivery_id=delivery.pk).status == DeliveryStatus.DELIVERED
    assert len(receiver.requests) == 1


def test_staff_patching_the_tenants_slack_url_through_the_api_meet_the_same_checks(world, public_only):
    from portal.core.models import AuditLog

    staff = world.client("staff")
    r = staff.patch("/api/v1/tenants/alpha/", {"slack_webhook_url": "http://169.254.169.254/latest/"}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and "slack_webhook_url" in r.json()["fields"]
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == ""
    url = "https://93.184.216.34/services/T0/B0/secret-part"
    assert staff.patch("/api/v1/tenants/alpha/", {"slack_webhook_url": url}, format="json").status_code == 200
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == url
    entry = AuditLog.objects.filter(action="tenant.update").latest("id")
    assert entry.before["slack_webhook_url"] != entry.after["slack_webhook_url"]  # the change is on record …
    assert "secret-part" not in str(entry.after)  # … masked, never in full


def test_a_name_rebound_to_a_private_address_after_the_check_is_not_posted_to(world, receiver, webhook_for,
                                                                                settings, monkeypatch):
    """DNS rebinding: the name resolves to a public address for the check and to the portal's own network a
    moment later, when the HTTP client connects. The connection's own address is what gets checked."""
    import socket

    port = int(receiver.url("/hook").rsplit(":", 1)[1].split("/", 1)[0])
    url = f"http://rebind.example:{port}/hook"
    channel, _ = webhook_for("alpha", url)  # saved while private addresses were allowed (notify settings)
    delivery = services.channel_send_test(actor=world.users["alpha-lead"], channel=channel)
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    real = socket.getaddrinfo
    answers = {"count": 0}

    def rebinding(host, *args, **kwargs):
        if host == "rebind.example":
            answers["count"] += 1
            address = "93.184.216.34" if answers["count"] == 1 else "127.0.0.1"
            return real(address, *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    result = services.delivery_send(delivery_id=delivery.pk)
    assert answers["count"] >= 2  # checked, then resolved again by the client
    assert receiver.requests == []  # nothing reached the private address
    assert result.status == DeliveryStatus.FAILED
    error = Delivery.objects.get(pk=delivery.pk).last_error
    assert error.startswith("blocked_destination: rebind.example connected to 127.0.0.1"), error


def test_the_public_session_still_posts_where_private_addresses_are_allowed(receiver, settings):
    from notifications import transport
    from portal.core.egress import public_session

    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = True
    with public_session() as session:
        outcome = transport.post(receiver.url("/hook"), b"{}", session=session)
    assert outcome.delivered and len(receiver.requests) == 1
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    with public_session() as session:
        outcome = transport.post(receiver.url("/hook"), b"{}", session=session)
    assert outcome.verdict == transport.Verdict.PERMANENT and outcome.error.startswith("blocked_destination: ")
    assert len(receiver.requests) == 1


@pytest.mark.parametrize("allow_private", [True, False])
@pytest.mark.parametrize("url", ["https://hooks.example.com:99999/x", "https://hooks.example.com:http/x",
                                 "https://hooks.example.com:-1/x", "https://hooks.example.com:0/x"])
def test_a_url_whose_port_is_not_a_port_is_refused_and_not_stored(world, settings, allow_private, url):
    """Saved, such a URL failed on every send (urllib3 cannot connect to it); with private addresses
    allowed (make run, private receivers) nothing checked the port at all."""
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = allow_private
    lead, tenant = world.users["alpha-lead"], world.tenants["alpha"]
    with pytest.raises(InvalidInput) as exc:
        services.webhook_create(actor=lead, tenant=tenant, url=url, name="x")
    assert set(exc.value.fields) == {"url"}
    with pytest.raises(InvalidInput):
        tenant_slack_webhook_set(actor=lead, tenant=tenant, url=url)
    assert not Channel.objects.filter(tenant=tenant, kind="webhook").exists()
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == ""
