"""Production marks the CSRF cookie HttpOnly: no page script reads it, the pages carry the token themselves
(htmx's hx-headers on <body>, the calendar's <meta name="csrf-token">), so booking still works."""

from __future__ import annotations

import re

import pytest
from django.test import override_settings
from playwright.sync_api import expect

from .conftest import drag, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@override_settings(CSRF_COOKIE_HTTPONLY=True)
def test_htmx_booking_works_with_an_httponly_csrf_cookie(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    csrf = [c for c in page.context.cookies() if c["name"] == "csrftoken"]
    assert csrf and csrf[0]["httpOnly"]
    assert "csrftoken" not in page.evaluate("document.cookie")
    drag(page, day, "10:00", "12:00")
    expect(page.get_by_label(re.compile("^Start"))).to_have_value(f"{day.isoformat()}T10:00")
    expect(page.locator("#booking-preview [data-field='billing']")).to_contain_text("Committed")
    page.get_by_role("button", name="Book", exact=True).click()
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("Booked #")
    assert page.errors == []
