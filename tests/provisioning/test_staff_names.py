"""A tenant reads that platform staff acted, never which staff account; staff read the username.

Every history a tenant sees: the audit log page (its lead), the dashboard's recent activity, a
reservation's page (timeline, "booked by"), panel and the list, a cluster's history, and the API's
reservation (created_by, status_reason).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from provisioning import services
from provisioning.models import VirtualCluster
from reservations.services import reservation_create, reservation_update

pytestmark = pytest.mark.django_db

STAFF_NAME = "ops-jane"  # not a substring of "platform staff", so a leak cannot hide in the words


@pytest.fixture
def acted_by_staff(world, t0):
    """ops-jane (staff) books for alpha, renames it, and tears its cluster down early."""
    ops = get_user_model().objects.create_user(username=STAFF_NAME, password="pw-Long-enough-1", is_staff=True)
    reservation = reservation_create(actor=ops, tenant=world.tenants["alpha"], pool=world.pool, node_count=1,
                                     start=t0, end=t0 + timedelta(hours=2), name="staff-booked")
    reservation_update(actor=ops, reservation=reservation, name="staff-renamed")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    services.cluster_request_teardown(actor=ops, cluster=cluster)
    return ops, reservation, cluster


def _session(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _pages(reservation, cluster) -> list[str]:
    return ["/audit/", "/", "/reservations/", f"/reservations/{reservation.pk}/",
            f"/reservations/{reservation.pk}/panel/", f"/clusters/{cluster.pk}/"]


def test_tenant_pages_and_api_say_platform_staff_not_the_staff_username(world, acted_by_staff):
    ops, reservation, cluster = acted_by_staff
    lead = _session(world.users["alpha-lead"])
    for url in _pages(reservation, cluster):
        response = lead.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert STAFF_NAME not in html, url
    assert "platform staff" in lead.get("/audit/").content.decode()
    detail = lead.get(f"/reservations/{reservation.pk}/").content.decode()
    assert "by platform staff" in detail  # the timeline
    assert "platform staff" in lead.get(f"/clusters/{cluster.pk}/").content.decode()
    for who in ("alpha-lead", "alpha-viewer"):
        api = world.client(who)
        body = api.get(f"/api/v1/reservations/{reservation.pk}/").json()
        assert body["created_by"] == "platform", who
        assert STAFF_NAME not in str(body), who
        listed = api.get("/api/v1/reservations/").json()
        assert STAFF_NAME not in str(listed), who
        assert STAFF_NAME not in str(api.get(f"/api/v1/clusters/{cluster.pk}/").json()), who


def test_staff_still_see_the_username(world, acted_by_staff):
    ops, reservation, cluster = acted_by_staff
    staff = _session(world.users["staff"])
    assert STAFF_NAME in staff.get("/audit/").content.decode()
    assert f"by {STAFF_NAME}" in staff.get(f"/reservations/{reservation.pk}/").content.decode()
    assert STAFF_NAME in staff.get(f"/clusters/{cluster.pk}/").content.decode()
    body = world.client("staff").get(f"/api/v1/reservations/{reservation.pk}/").json()
    assert body["created_by"] == STAFF_NAME


def test_a_teammates_name_is_still_shown_to_the_tenant(world, t0):
    reservation = reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                     pool=world.pool, node_count=1, start=t0, end=t0 + timedelta(hours=2))
    assert world.client("alpha-viewer").get(f"/api/v1/reservations/{reservation.pk}/").json()["created_by"] \
        == "alpha-member"
    assert "by alpha-member" in _session(world.users["alpha-lead"]).get(
        f"/reservations/{reservation.pk}/").content.decode()


def test_a_node_drained_in_the_admin_does_not_name_the_staff_account_to_the_tenant(world, t0):
    """The admin's drain wrote "drained by <staff username>" as the node's state_reason, which the tenant
    holding the node reads in GET /api/v1/nodes/. The audit row keeps the account (for staff)."""
    from django.urls import reverse

    from portal.core.models import AuditLog
    from reservations.models import Node

    ops = get_user_model().objects.create_user(username=STAFF_NAME, password="pw-Long-enough-1", is_staff=True)
    booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=len(world.nodes), start=t0, end=t0 + timedelta(hours=2))
    node = world.nodes[0]
    response = _session(ops).post(reverse("admin:reservations_node_changelist"),
                                  {"action": "drain", "_selected_action": [node.pk]})
    assert response.status_code == 302
    node = Node.objects.get(pk=node.pk)
    assert node.state == "draining" and node.state_reason == "drained by platform staff"
    listed = world.client("alpha-lead").get("/api/v1/nodes/").json()
    assert node.hostname in [n["hostname"] for n in listed["results"]], (booked.pk, listed)
    assert STAFF_NAME not in str(listed)
    assert AuditLog.objects.filter(action="node.update", actor=ops).exists()
