"""axe-core (WCAG 2.0/2.1 A and AA rules) on every portal page with the demo data, as a lead, a viewer and
staff, at desktop and at phone width, including what htmx swaps in: the calendar's booking form, the form
with errors, a conflict with its suggestions, the reservation panel. No serious or critical violation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axe_playwright_python.sync_playwright import Axe
from django.utils import timezone
from playwright.sync_api import expect

from reservations.models import Reservation

from .conftest import DESKTOP, PHONE, drag, seed_pages_demo

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

DEMO_PASSWORD = "demo-portal-2026"
AXE_OPTIONS = {"runOnly": {"type": "tag", "values": ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]},
               "resultTypes": ["violations"]}
BLOCKING = {"serious", "critical"}


def test_no_serious_or_critical_axe_violations(live_server, new_page):
    far, mine = seed_pages_demo("demo-feed-token-for-axe")
    example = Reservation.objects.filter(tenant__slug="research").order_by("period").first()
    soon = (timezone.now() + timedelta(days=10)).date()
    url = live_server.url
    axe = Axe()
    problems: list[str] = []

    def scan(page, state):
        page.wait_for_load_state("networkidle")
        for v in axe.run(page, options=AXE_OPTIONS).response["violations"]:
            if v["impact"] in BLOCKING:
                where = "; ".join(f"{n['target']} {n['html'][:80]}" for n in v["nodes"][:3])
                problems.append(f"{state}: {v['id']} ({v['impact']}) ×{len(v['nodes'])}: {v['help']} — {where}")

    def visit(page, state, path, ready=None):
        page.goto(url + path)
        if ready:
            page.wait_for_selector(ready)
        scan(page, state)

    def calendar(page, state, query):
        visit(page, state, f"/calendar/?{query}", ready="#calendar[data-ready='1']")

    def login(page, username):
        page.goto(f"{url}/accounts/login/")
        page.get_by_label("Username").fill(username)
        page.get_by_label("Password").fill(DEMO_PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{url}/")

    def booking_states(page, tag):
        calendar(page, f"{tag}/calendar-day", f"pool=a100-80gb&view=timeGridDay&date={far.isoformat()}")
        drag(page, far, "15:00", "17:00")
        page.get_by_label("Nodes").fill("2")
        page.get_by_label("Name").fill("ablation")
        expect(page.locator("#booking-preview [data-field='billing']")).to_be_visible()
        scan(page, f"{tag}/booking-form")
        page.get_by_label("Start (Europe/Berlin)").fill(f"{far.isoformat()}T12:00")  # end before start
        page.get_by_label("End (Europe/Berlin)").fill(f"{far.isoformat()}T10:00")
        page.get_by_role("button", name="Book", exact=True).click()
        expect(page.locator("#side-panel .error, #side-panel .errorlist").first).to_be_visible()
        scan(page, f"{tag}/booking-form-errors")
        page.get_by_label("Start (Europe/Berlin)").fill(f"{far.isoformat()}T10:00")  # 15 of 16 nodes taken
        page.get_by_label("End (Europe/Berlin)").fill(f"{far.isoformat()}T12:00")
        page.get_by_role("button", name="Book", exact=True).click()
        expect(page.locator(".suggestions button").first).to_be_visible()
        scan(page, f"{tag}/booking-conflict-suggestions")

    for viewport, width in ((DESKTOP, "desktop"), (PHONE, "phone")):
        anonymous = new_page(tz="Europe/Berlin", viewport=viewport)
        visit(anonymous, f"{width}/login", "/accounts/login/")
        for username in ("research-lead", "research-viewer", "admin"):
            page = new_page(tz="Europe/Berlin", viewport=viewport)
            login(page, username)
            tag = f"{width}/{username}"
            scan(page, f"{tag}/dashboard")
            calendar(page, f"{tag}/calendar-week", "pool=h100-sxm")
            if username == "admin":
                visit(page, f"{tag}/fleet", "/fleet/?days=3", ready=".bar[data-tenant='finetune']")
            else:
                calendar(page, f"{tag}/calendar-month",
                         f"pool=h100-sxm&view=dayGridMonth&date={soon.isoformat()}")
                calendar(page, f"{tag}/calendar-day", f"pool=a100-80gb&view=timeGridDay&date={far.isoformat()}")
                page.locator(f".fc-event[data-reservation-id='{mine.pk}']").click()
                expect(page.locator("#side-panel #panel-title")).to_be_visible()
                scan(page, f"{tag}/reservation-panel")
                visit(page, f"{tag}/reservation", f"/reservations/{example.pk}/")
            visit(page, f"{tag}/availability", "/availability/")
            visit(page, f"{tag}/account", "/account/")
            if username == "research-lead":
                page.locator("#api-tokens").get_by_label("Name").fill("laptop")
                page.get_by_role("button", name="Create token").click()
                expect(page.locator("[data-new-token]")).to_be_visible()
                scan(page, f"{tag}/account-new-token")
            visit(page, f"{tag}/team", "/team/")
            visit(page, f"{tag}/reservations", "/reservations/")
            if username != "research-viewer":
                visit(page, f"{tag}/usage", "/usage/")
            if username == "research-lead":
                booking_states(page, tag)
            assert page.errors == [], page.errors

    assert not problems, "axe found serious/critical violations:\n" + "\n".join(problems)
