"""htmx after the session ends (the whole window goes to sign-in) and refused htmx requests (said, form kept)."""

from __future__ import annotations

import re

import pytest
from django.contrib.sessions.models import Session
from playwright.sync_api import expect

from reservations.models import Reservation
from tests.browser.conftest import open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_heatmap_poll_after_the_session_ends_goes_to_sign_in(world, live_server, new_page, sign_in):
    """The heatmap polls every few seconds; once the session is gone it must send the user to the sign-in
    page, not paste the whole sign-in page (header, nav and all) into the middle of the heatmap."""
    page = sign_in(new_page(), "alpha-viewer")
    page.goto(f"{live_server.url}/availability/?refresh=2")
    expect(page.locator("#heatmap")).to_be_visible()
    Session.objects.all().delete()  # the session expires (or is signed out elsewhere)
    page.wait_for_url(re.compile(r"/accounts/login/"), timeout=8_000)
    expect(page.locator("header.top")).to_have_count(1)
    expect(page.get_by_label("Username")).to_have_count(1)


def test_opening_the_booking_form_after_the_session_ends_goes_to_sign_in(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    Session.objects.all().delete()
    page.get_by_role("button", name="New booking").click()
    page.wait_for_url(re.compile(r"/accounts/login/\?next=/calendar/"), timeout=8_000)
    expect(page.locator("header.top")).to_have_count(1)
    expect(page.locator("#side-panel")).to_have_count(0)


def test_a_refused_htmx_post_says_so_and_keeps_the_form(world, live_server, new_page, sign_in, day):
    """Signing in again in another tab rotates the CSRF token: the old tab's Book answers 403. The user must
    be told (and keep what they typed), not face a button that silently does nothing."""
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    page.get_by_role("button", name="New booking").click()
    page.get_by_label(re.compile("^Start")).fill(f"{day.isoformat()}T06:00")
    page.get_by_label(re.compile("^End")).fill(f"{day.isoformat()}T08:00")
    page.get_by_label("Name").fill("typed before the 403")

    # What signing in again in another tab does to this one: the CSRF cookie gets a new secret.
    page.context.add_cookies([{"name": "csrftoken", "value": "R" * 32, "url": live_server.url}])

    with page.expect_response(re.compile(r"/reservations/new/")) as answer:
        page.get_by_role("button", name="Book", exact=True).click()
    assert answer.value.status == 403
    alert = page.locator("#side-panel > [role=alert]")
    expect(alert).to_contain_text(re.compile("reload|sign in", re.I))
    expect(alert).to_be_focused()
    expect(page.get_by_label("Name")).to_have_value("typed before the 403")
    assert not Reservation.objects.filter(name="typed before the 403").exists()


def test_calendar_says_signed_out_when_its_feed_answers_401(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    Session.objects.all().delete()
    page.get_by_role("button", name="Next day").click()  # the next day's reservations: a fetch without a session
    expect(page.locator("#calendar-status")).to_contain_text("signed out")
