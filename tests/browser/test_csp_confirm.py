"""Under the production Content-Security-Policy (script-src 'self' + nonce, no 'unsafe-inline') the browser
ignores inline event-handler attributes: an onsubmit="return confirm(...)" never asks, the form just posts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from provisioning import services as provisioning
from provisioning.models import VirtualCluster
from reservations import services
from reservations.timeutil import slot_floor

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# What portal/settings/production.py sends (the nonce does not matter for attributes).
PRODUCTION_CSP = "default-src 'self'; script-src 'self' 'nonce-reviewnonce'; style-src 'self' 'unsafe-inline'"


def test_tear_down_asks_first_under_the_production_csp(world, live_server, new_page, sign_in, settings):
    settings.PORTAL_SIMULATED_PHASE_SECONDS = "0"
    settings.PORTAL_PROVISION_LEAD_MINUTES = "30"
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    t0 = slot_floor(timezone.now(), 60) + timedelta(days=1)
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=t0, end=t0 + timedelta(hours=2), name="csp-run")
    provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=r)
    provisioning.cluster_provision(cluster_id=cluster.pk)

    page = sign_in(new_page(), "alpha-lead")

    def with_csp(route):
        response = route.fetch()
        route.fulfill(response=response, headers={**response.headers, "content-security-policy": PRODUCTION_CSP})

    page.route(f"{live_server.url}/clusters/**", with_csp)
    asked = []
    page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
    teardown = page.get_by_role("button", name="Tear down now")
    expect(teardown).to_be_visible()
    teardown.click()
    page.wait_for_timeout(1000)
    assert asked and "Tear the cluster down" in asked[0]  # the confirmation was shown …
    r.refresh_from_db()
    assert r.status in ("provisioning", "active"), r.status  # … and "Cancel" left everything running
