"""Role-aware UI and tenant isolation as the browser sees it (DOM and every response it loads)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect

from reservations import services

from .conftest import at, drag, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_viewer_sees_no_booking_controls(world, live_server, new_page, sign_in, day):
    booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                          name="lead-run")
    page = sign_in(new_page(), "alpha-viewer")
    expect(page.locator(".badge.role")).to_have_text("viewer")
    expect(page.get_by_role("link", name="Book nodes")).to_have_count(0)

    open_day(page, live_server, day)
    expect(page.get_by_role("button", name="New booking")).to_have_count(0)
    event = page.locator(f".fc-event[data-reservation-id='{booking.pk}']")
    expect(event).to_be_visible()
    event.hover()
    expect(page.locator(".fc-event-resizer")).to_have_count(0)
    drag(page, day, "14:00", "15:00")  # selecting does nothing for a viewer
    page.wait_for_timeout(300)
    expect(page.locator("#booking-form")).to_have_count(0)
    expect(page.locator(".fc-highlight")).to_have_count(0)

    event.click()
    panel = page.locator("#side-panel [data-reservation-id]")
    expect(panel).to_contain_text("lead-run")
    expect(panel.locator("[data-cancel]")).to_have_count(0)
    expect(panel.get_by_role("button", name="+1 slot")).to_have_count(0)

    page.goto(f"{live_server.url}/reservations/{booking.pk}/")
    expect(page.get_by_role("heading", name="Nodes")).to_be_visible()
    expect(page.get_by_role("heading", name="Change")).to_have_count(0)
    assert page.request.get(f"{live_server.url}/reservations/new/").status == 403


SECRETS = ("beta-secret", "Team Beta", "beta-lead", "beta-member")


def test_tenant_a_never_sees_tenant_b_in_the_dom_or_any_json(world, live_server, new_page, sign_in, day):
    for hour in (8, 12, 16):
        services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                    node_count=1, start=at(day, hour), end=at(day, hour + 2),
                                    name=f"beta-secret-{hour}")
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                       name="alpha-visible")
    page = new_page()
    bodies: list[tuple[str, str]] = []

    def record(response):
        kind = response.headers.get("content-type", "")
        if response.url.startswith(live_server.url) and ("json" in kind or "html" in kind or "calendar" in kind):
            try:
                bodies.append((response.url, response.text()))
            except PlaywrightError:  # a redirect has no body to read
                pass

    page.on("response", record)
    sign_in(page, "alpha-lead")
    open_day(page, live_server, day)
    expect(page.locator(f".fc-event[data-reservation-id='{mine.pk}']")).to_be_visible()
    page.locator(f".fc-event[data-reservation-id='{mine.pk}']").click()
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("alpha-visible")
    dom = [page.content()]
    page.goto(f"{live_server.url}/calendar/?view=dayGridMonth&date={day.isoformat()}")
    page.wait_for_selector("#calendar[data-ready='1']")
    dom.append(page.content())
    page.goto(f"{live_server.url}/calendar/?view=timeGridWeek&date={day.isoformat()}")
    page.wait_for_selector("#calendar[data-ready='1']")
    dom.append(page.content())
    for path in ("/", "/availability/", "/account/", f"/reservations/{mine.pk}/"):
        page.goto(live_server.url + path)
        dom.append(page.content())

    loaded_json = [url for url, _ in bodies if "events.json" in url or "availability.json" in url]
    alpha_ids = {str(pk) for pk in world.tenants["alpha"].reservations.values_list("pk", flat=True)}
    for url, text in bodies:
        if "events.json" in url:
            assert {e["id"] for e in json.loads(text)} <= alpha_ids, url
    assert any("events.json" in u for u in loaded_json) and any("availability.json" in u for u in loaded_json)
    for url, text in bodies:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} leaked in {url}"
    for html in dom:
        for secret in SECRETS:
            assert secret not in html
    # The shading still counts beta's nodes as busy: free capacity is aggregated, never attributed.
    assert any('"free": 3' in t for u, t in bodies if "availability.json" in u)
    # And beta's reservations are unreachable by id.
    for r in world.tenants["beta"].reservations.all():
        assert page.request.get(f"{live_server.url}/reservations/{r.pk}/").status == 404
        assert page.request.get(f"{live_server.url}/reservations/{r.pk}/panel/").status == 404


def test_heatmap_refreshes_itself(world, live_server, new_page, sign_in):
    page = sign_in(new_page(), "alpha-viewer")
    page.goto(f"{live_server.url}/availability/?refresh=2")
    heatmap = page.locator("table.heat[data-pool='h100']")
    expect(heatmap).to_be_visible()
    assert heatmap.locator("td[data-free='1']").count() == 0
    # Someone books three nodes for the whole of tomorrow; within a poll or two the grid shows it.
    tomorrow = (timezone.localdate() + timedelta(days=1))
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=3, start=at(tomorrow, 0), end=at(tomorrow, 24 - 1))
    expect(heatmap.locator("td[data-free='1']").first).to_be_visible(timeout=10_000)
    assert "beta" not in heatmap.inner_html()
