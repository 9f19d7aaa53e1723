"""Who may change a tenant's team is decided under the team lock on every path (found in a review: the API's
POST /memberships/ read the lead's role without a lock, so a lead demoted or removed while the request ran still
added members, a new lead included). Real threads on the real database."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from tenants.choices import Role
from tenants.models import Membership

from .conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)


def _demote_and_hold(membership_pk: int, role: str | None, locked: threading.Event, release: threading.Event):
    """Another transaction demoting (role) or removing (None) a lead, not yet committed: the lock the team
    services take (the tenant's lead rows, FOR UPDATE) is held until release."""
    try:
        with transaction.atomic():
            membership = Membership.objects.select_for_update().get(pk=membership_pk)
            list(Membership.objects.select_for_update().filter(tenant_id=membership.tenant_id, role=Role.LEAD))
            if role is None:
                membership.delete()
            else:
                membership.role = role
                membership.save(update_fields=["role"])
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def _post_in_thread(client, result: dict, body: dict):
    try:
        result["response"] = client.post("/api/v1/memberships/", body, format="json")
    finally:
        connection.close()


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query ILIKE %s AND pid <> pg_backend_pid()", ["%tenants_membership%"])
        return bool(cur.fetchone()[0])


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_adding_a_member_by_api_is_refused(change):
    world = make_world()
    tenant = world.tenants["alpha"]
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)  # stays a lead
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_demote_and_hold, args=(lead.pk, change, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    poster = threading.Thread(target=_post_in_thread, args=(world.client("alpha-lead"), result,
                                                              {"tenant": "alpha", "user": "beta-lead", "role": "lead"}))
    poster.start()
    # Either the request queues on the team lock (then the demotion commits first), or it ran past it.
    while poster.is_alive() and not _waiting_on_a_lock():
        poster.join(0.02)
    release.set()
    holder.join(30)
    poster.join(30)
    response = result["response"]
    assert response.status_code == 403, response.json()
    assert response.json()["code"] == "permission_denied"
    assert not Membership.objects.filter(tenant=tenant, user=world.users["beta-lead"]).exists()


def _rotate_in_thread(client, result: dict):
    try:
        result["response"] = client.post("/tenant/calendar-feed/rotate/")
    finally:
        connection.close()


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_rotating_the_feed_is_refused(change):
    from django.test import Client

    world = make_world()
    tenant = world.tenants["alpha"]
    tenant.ical_token = "alpha-feed-secret-0123456789"
    tenant.save(update_fields=["ical_token"])
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)
    client = Client()
    client.force_login(world.users["alpha-lead"])
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_demote_and_hold, args=(lead.pk, change, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    rotator = threading.Thread(target=_rotate_in_thread, args=(client, result))
    rotator.start()
    while rotator.is_alive() and not _waiting_on_a_lock():
        rotator.join(0.02)
    release.set()
    holder.join(30)
    rotator.join(30)
    assert result["response"].status_code == 403
    tenant.refresh_from_db()
    assert tenant.ical_token == "alpha-feed-secret-0123456789"  # every member's address still works
