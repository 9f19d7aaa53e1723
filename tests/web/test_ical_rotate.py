"""Leads issue (and re-issue) their tenant's calendar-feed address; the old one stops working."""

import pytest
from django.test import Client

from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db


def test_lead_rotates_the_feed_and_the_old_address_dies(world):
    tenant = world.tenants["alpha"]
    c = Client()
    c.force_login(world.users["alpha-lead"])
    r = c.post("/tenant/calendar-feed/rotate/", {"next": "/"})
    assert r.status_code == 302
    tenant.refresh_from_db()
    first = tenant.ical_token
    assert first
    assert c.get(f"/ical/alpha/{first}.ics").status_code == 200
    c.post("/tenant/calendar-feed/rotate/")
    tenant.refresh_from_db()
    assert tenant.ical_token != first
    assert c.get(f"/ical/alpha/{first}.ics").status_code == 404
    assert c.get(f"/ical/alpha/{tenant.ical_token}.ics").status_code == 200
    assert AuditLog.objects.filter(action="tenant.ical_token_rotate", tenant_id=tenant.pk).count() == 2


@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer"])
def test_only_leads_rotate(world, who):
    c = Client()
    c.force_login(world.users[who])
    assert c.post("/tenant/calendar-feed/rotate/").status_code == 403
    world.tenants["alpha"].refresh_from_db()
    assert world.tenants["alpha"].ical_token == ""
