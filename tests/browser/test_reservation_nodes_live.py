"""The reservation page follows its booking's nodes while it is open: a node drained and swapped for a spare shows
in the Nodes card and the timeline without a reload."""

from __future__ import annotations

from datetime import timedelta

import pytest
from playwright.sync_api import expect

from reservations import services

from .conftest import at

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_node_swapped_under_an_active_booking_shows_on_its_page_without_a_reload(
        world, live_server, new_page, sign_in, day, settings, monkeypatch):
    """A lead watching an active booking's page while one of its nodes failed its health checks, was drained and
    replaced by a spare kept seeing the old node in the Nodes card, and no swap in the timeline, until a reload:
    the page stopped polling once the booking was active, and its poll never brought those parts. An active
    booking's page now goes on polling (slowly: 15 s, 1 s here) and each answer brings the node list and the
    timeline out-of-band when they changed; the name being typed beside them is left alone."""
    from provisioning import services as provisioning
    from provisioning.models import VirtualCluster
    from reservations import views
    from tests.provisioning.conftest import FAST

    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    monkeypatch.setattr(views, "ACTIVE_POLL_SECONDS", 1)
    booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    provisioning.lifecycle_tick(now=at(day, 10) - timedelta(minutes=10))  # the window is near: it is built
    cluster = VirtualCluster.objects.get(reservation=booking)
    provisioning.cluster_provision(cluster_id=cluster.pk)
    provisioning.lifecycle_tick(now=at(day, 10))  # the window starts: the booking is under way
    booking.refresh_from_db()
    cluster.refresh_from_db()
    assert (booking.status, cluster.status) == ("active", "ready")
    (old,) = [a.node for a in booking.allocations.filter(active=True).select_related("node")]

    page = sign_in(new_page(), "alpha-lead")
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.goto(f"{live_server.url}/reservations/{booking.pk}/")
    nodes = page.locator("#reservation-nodes")
    timeline = page.locator("#reservation-timeline")
    expect(nodes).to_have_attribute("aria-live", "polite")
    expect(nodes.locator("li")).to_have_text([old.hostname])
    expect(page.locator("#cluster-status")).to_have_attribute("hx-trigger", "every 1s")  # active: still watching
    name = page.get_by_label("Name", exact=True)
    name.fill("half-typed new na")  # a rename being typed while the node fails

    services.node_update(actor=world.users["staff"], node=old, state="draining", reason="health check failed")
    expect(nodes.locator("li")).to_have_text([f"{old.hostname} Draining"], timeout=10_000)

    (outcome,) = services.node_replace_allocations(node=old, reason="XID 79")
    assert outcome["result"] == "replaced"
    spare = outcome["spare"]
    expect(nodes.locator("li")).to_have_text([spare], timeout=10_000)  # no reload
    expect(timeline.locator("li").last).to_contain_text("Node replaced")
    expect(timeline.locator("li").last).to_contain_text(f"{old.hostname} → {spare}")
    expect(timeline).not_to_contain_text("XID")

    # the cards keep their headings and landmarks; the typing beside them was not wiped
    expect(page.get_by_role("region", name="Nodes")).to_contain_text(spare)
    expect(page.get_by_role("heading", name="Status timeline", level=2)).to_be_visible()
    expect(name).to_have_value("half-typed new na")
    expect(nodes).to_have_attribute("aria-live", "polite")
    assert page.errors == []
    assert console_errors == []
