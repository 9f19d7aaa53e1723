"""A tenant's signed webhooks are capped (PORTAL_NOTIFY_MAX_WEBHOOKS): each one is a secret, a URL checked on
every send and a delivery per event, and there was no limit at all. The cap is decided under the tenant's lock,
so two creates racing at the cap cannot both pass; the refusal is quota_exceeded and stores nothing."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from notifications import services
from notifications.choices import ChannelKind
from notifications.models import Channel
from portal.core.api import exception_handler
from portal.core.exceptions import QuotaExceeded
from portal.core.models import AuditLog
from tenants.models import Membership, Tenant
from tests.racing import behind_a_lock

from ..conftest import make_world

URL = "https://93.184.216.34/hook"


def _webhooks(tenant) -> int:
    return Channel.objects.filter(tenant=tenant, kind=ChannelKind.WEBHOOK).count()


@pytest.mark.django_db
def test_the_webhook_over_the_cap_is_refused_with_quota_exceeded_and_nothing_stored(world, settings):
    settings.PORTAL_NOTIFY_MAX_WEBHOOKS = 2
    lead, tenant = world.users["alpha-lead"], world.tenants["alpha"]
    for n in range(2):
        services.webhook_create(actor=lead, tenant=tenant, url=URL, name=f"ci-{n}")
    audits = AuditLog.objects.count()
    with pytest.raises(QuotaExceeded) as refused:
        services.webhook_create(actor=lead, tenant=tenant, url=URL, name="one-too-many")
    assert refused.value.code == "quota_exceeded" and refused.value.status == 409
    assert "2" in refused.value.detail
    assert _webhooks(tenant) == 2 and AuditLog.objects.count() == audits
    # The envelope an API would answer (notifications has no API of its own: the one handler every API error
    # goes through).
    response = exception_handler(refused.value, {})
    assert response.status_code == 409
    assert response.data == {"code": "quota_exceeded", "detail": refused.value.detail, "fields": {}}
    # Another tenant's webhooks are not counted against this one.
    services.webhook_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], url=URL, name="ci")
    # A deleted webhook frees its place.
    services.channel_delete(actor=lead, channel=Channel.objects.filter(tenant=tenant).first())
    services.webhook_create(actor=lead, tenant=tenant, url=URL, name="again")
    assert _webhooks(tenant) == 2


@pytest.mark.django_db
def test_the_page_shows_the_refusal_beside_the_form_and_stores_nothing(world, settings):
    settings.PORTAL_NOTIFY_MAX_WEBHOOKS = 1
    tenant = world.tenants["alpha"]
    services.webhook_create(actor=world.users["alpha-lead"], tenant=tenant, url=URL, name="ci")
    client = Client()
    client.force_login(world.users["alpha-lead"])
    response = client.post(reverse("notifications:webhook-create"), {"name": "more", "url": URL})
    assert response.status_code == 409
    form = response.context["webhook_form"]
    assert form.non_field_errors() and "1" in form.non_field_errors()[0]
    assert form["name"].value() == "more"  # what was typed is still there
    html = response.content.decode()
    assert "whsec_" not in html and "already has the most signed webhooks" in html
    assert _webhooks(tenant) == 1
    # The page says how many there are of how many allowed, and that the team is at the limit.
    shown = client.get(reverse("notifications:settings")).content.decode()
    assert "(1 of 1)" in shown and "as many webhooks as it may" in shown


def _create(actor, tenant, name: str):
    try:
        return services.webhook_create(actor=actor, tenant=tenant, url=URL, name=name)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_creates_racing_at_the_cap_cannot_both_pass(settings):
    """Real threads on the real database: staff adding webhooks to a tenant without leads (no lead rows to lock),
    four at once with one place left: one is stored, the others are refused."""
    world = make_world()
    settings.PORTAL_NOTIFY_MAX_WEBHOOKS = 3
    tenant, staff = world.tenants["alpha"], world.users["staff"]
    Membership.objects.filter(tenant=tenant).delete()
    for n in range(2):
        services.webhook_create(actor=staff, tenant=tenant, url=URL, name=f"ci-{n}")
    start = threading.Barrier(4)
    results: list = []

    def racer(n: int) -> None:
        start.wait(10)
        results.append(_create(staff, tenant, f"racer-{n}"))

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    made = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(made) == 1 and len(refused) == 3, results
    assert _webhooks(tenant) == 3


@pytest.mark.django_db(transaction=True)
def test_a_create_waits_for_one_in_flight_and_then_counts_it(settings):
    """Deterministic: a create in flight at the cap's last place (its row inserted, its transaction holding the
    tenant's lock, not yet committed); the second create waits for it and is refused once it commits."""
    world = make_world()
    settings.PORTAL_NOTIFY_MAX_WEBHOOKS = 1
    tenant, staff = world.tenants["alpha"], world.users["staff"]
    Membership.objects.filter(tenant=tenant).delete()

    def in_flight() -> None:
        Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        Channel.objects.create(tenant=tenant, kind=ChannelKind.WEBHOOK, name="first", url=URL,
                               secret="whsec_" + "A" * 43)

    second = behind_a_lock(in_flight, lambda: _create(staff, tenant, "second"))
    assert isinstance(second, QuotaExceeded), second
    assert _webhooks(tenant) == 1
