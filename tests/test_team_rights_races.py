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


def _create_user(staff, name: str, barrier: threading.Barrier, results: list) -> None:
    from portal.core.exceptions import InvalidInput
    from tenants.services import user_create

    try:
        barrier.wait(30)
        results.append(user_create(actor=staff, username=name, password="Another-long-pw-9"))
    except InvalidInput as exc:
        results.append(exc)
    finally:
        connection.close()


def test_two_accounts_differing_only_in_case_cannot_be_created_at_once():
    """user_create refuses a name that differs from one in use only in case; two such creates racing must not
    both pass that check (found in a review: each checked before the other had committed, and the database's
    unique index on username is case-sensitive, so 'Racer' and 'racer' both came to exist)."""
    from django.contrib.auth import get_user_model

    from portal.core.exceptions import InvalidInput

    User = get_user_model()
    staff = User.objects.create_user(username="staff", password="pw-Long-enough-1", is_staff=True)
    for round_no in range(8):
        names = [f"Racer{round_no}", f"racer{round_no}"]
        barrier = threading.Barrier(len(names))
        results: list = []
        threads = [threading.Thread(target=_create_user, args=(staff, name, barrier, results)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(results) == 2
        assert User.objects.filter(username__iexact=names[0]).count() == 1, (round_no, results)
        refused = [r for r in results if isinstance(r, InvalidInput)]
        assert len(refused) == 1 and "username" in refused[0].fields
