"""Every page on the demo fleet at 1280×800 and at phone width: renders, no script errors, no sideways
scrolling. With PORTAL_SCREENSHOTS_DIR set (e.g. docs/screenshots) the screenshots are kept there:

    PORTAL_SCREENSHOTS_DIR=docs/screenshots .venv/bin/pytest tests/browser/test_pages.py
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from reservations.models import Reservation

from .conftest import DESKTOP, PHONE, drag, seed_pages_demo

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

DEMO_PASSWORD = "demo-portal-2026"


@pytest.fixture
def shots(tmp_path) -> Path:
    target = os.environ.get("PORTAL_SCREENSHOTS_DIR")
    path = Path(target) if target else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def _login(page, live_server, username):
    page.goto(f"{live_server.url}/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(DEMO_PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{live_server.url}/")


def _check(page, shots: Path, name: str):
    page.wait_for_load_state("networkidle")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"{name}: the page scrolls sideways by {overflow}px"
    assert page.errors == [], page.errors
    page.screenshot(path=str(shots / f"{name}.png"))


def test_every_page_renders_on_desktop_and_phone(live_server, new_page, shots):
    far, _ = seed_pages_demo("demo-feed-token-for-screenshots")
    example = Reservation.objects.filter(tenant__slug="research").order_by("period").first()

    page = new_page(tz="Europe/Berlin", viewport=DESKTOP)
    page.goto(f"{live_server.url}/accounts/login/")
    _check(page, shots, "login")
    _login(page, live_server, "research-lead")
    _check(page, shots, "dashboard")
    page.goto(f"{live_server.url}/calendar/?pool=h100-sxm")
    page.wait_for_selector("#calendar[data-ready='1']")
    _check(page, shots, "calendar-week")
    soon = (timezone.now() + timedelta(days=10)).date()
    page.goto(f"{live_server.url}/calendar/?pool=h100-sxm&view=dayGridMonth&date={soon.isoformat()}")
    page.wait_for_selector("#calendar[data-ready='1']")
    _check(page, shots, "calendar-month")
    page.goto(f"{live_server.url}/calendar/?pool=a100-80gb&view=timeGridDay&date={far.isoformat()}")
    page.wait_for_selector("#calendar[data-ready='1']")
    drag(page, far, "15:00", "17:00")
    page.get_by_label("Nodes").fill("2")
    page.get_by_label("Name").fill("ablation")
    expect(page.locator("#booking-preview [data-field='billing']")).to_be_visible()
    _check(page, shots, "booking-preview")
    page.get_by_role("button", name="Close").click()
    expect(page.locator("#booking-form")).to_have_count(0)
    page.get_by_role("button", name="New booking").click()
    expect(page.locator("#booking-form")).to_be_visible()
    page.get_by_label("Start (Europe/Berlin)").fill(f"{far.isoformat()}T10:00")
    page.get_by_label("End (Europe/Berlin)").fill(f"{far.isoformat()}T12:00")
    page.get_by_label("Nodes").fill("2")
    page.get_by_role("button", name="Book", exact=True).click()
    expect(page.locator(".suggestions button").first).to_be_visible()
    _check(page, shots, "booking-conflict-suggestions")
    page.goto(f"{live_server.url}/reservations/{example.pk}/")
    _check(page, shots, "reservation")
    page.goto(f"{live_server.url}/availability/")
    _check(page, shots, "availability-heatmap")
    page.goto(f"{live_server.url}/account/")
    _check(page, shots, "account")
    page.goto(f"{live_server.url}/reservations/")
    _check(page, shots, "reservations")
    page.goto(f"{live_server.url}/team/")
    _check(page, shots, "team")
    page.goto(f"{live_server.url}/usage/")
    _check(page, shots, "usage")

    staff = new_page(tz="Europe/Berlin", viewport=DESKTOP)
    _login(staff, live_server, "admin")
    staff.goto(f"{live_server.url}/fleet/?days=3")
    expect(staff.locator(".bar[data-tenant='finetune']").first).to_be_attached()
    expect(staff.locator(".fleet-row[data-node='a100-80gb-016'] .badge")).to_have_text("failed")
    _check(staff, shots, "fleet-timeline")

    phone = new_page(tz="Europe/Berlin", viewport=PHONE)
    _login(phone, live_server, "research-lead")
    _check(phone, shots, "phone-dashboard")
    phone.goto(f"{live_server.url}/calendar/?pool=h100-sxm")
    phone.wait_for_selector("#calendar[data-ready='1']")
    _check(phone, shots, "phone-calendar")
    phone.get_by_role("button", name="New booking").click()
    expect(phone.locator("#booking-form")).to_be_visible()
    phone.locator("#booking-form").scroll_into_view_if_needed()
    expect(phone.locator("#booking-preview dl, #booking-preview p").first).to_be_visible()
    _check(phone, shots, "phone-booking-form")
    phone.goto(f"{live_server.url}/reservations/{example.pk}/")
    _check(phone, shots, "phone-reservation")
    phone.goto(f"{live_server.url}/availability/")
    _check(phone, shots, "phone-availability-heatmap")
    for path, name in (("/reservations/", "phone-reservations"), ("/team/", "phone-team"), ("/usage/", "phone-usage"),
                       ("/account/", "phone-account")):
        phone.goto(f"{live_server.url}{path}")
        _check(phone, shots, name)
