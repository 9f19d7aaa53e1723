"""Leads issue (and re-issue) their tenant's calendar-feed secret; every member's old address stops working."""

import pytest
from django.test import Client

from portal.core.models import AuditLog
from tests.conftest import feed_path

pytestmark = pytest.mark.django_db


def test_lead_rotates_the_feed_and_every_old_address_dies(world):
    tenant = world.tenants["alpha"]
    c = Client()
    c.force_login(world.users["alpha-lead"])
    r = c.post("/tenant/calendar-feed/rotate/", {"next": "/"})
    assert r.status_code == 302
    tenant.refresh_from_db()
    assert tenant.ical_token
    first = {who: feed_path(tenant, world.users[who]) for who in ("alpha-lead", "alpha-viewer")}
    assert all(c.get(path).status_code == 200 for path in first.values())
    c.post("/tenant/calendar-feed/rotate/")
    tenant.refresh_from_db()
    for who, path in first.items():
        assert c.get(path).status_code == 404
        assert feed_path(tenant, world.users[who]) != path
        assert c.get(feed_path(tenant, world.users[who])).status_code == 200
    assert AuditLog.objects.filter(action="tenant.ical_token_rotate", tenant_id=tenant.pk).count() == 2


@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer"])
def test_only_leads_rotate(world, who):
    c = Client()
    c.force_login(world.users[who])
    assert c.post("/tenant/calendar-feed/rotate/").status_code == 403
    world.tenants["alpha"].refresh_from_db()
    assert world.tenants["alpha"].ical_token == ""
