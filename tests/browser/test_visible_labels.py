"""Form controls named on screen, not only to screen readers."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_webhooks_event_checkboxes_are_headed_events_on_screen(world, live_server, new_page, sign_in):
    """The add-a-webhook and edit-a-webhook forms showed a box of checkboxes ("Reservation confirmed", ...) under
    the URL with no heading: its "Events" legend was for screen readers only (WCAG 3.3.2), so a lead could
    not tell the box chose what is sent. The group is headed "Events" on screen."""
    from notifications import services as notify

    notify.webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                          url="https://ci.example.com/hooks/gpu-portal", name="ci")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/notifications/")
    page.locator("details.webhook summary").first.click()
    groups = page.get_by_role("group", name="Events")
    expect(groups).to_have_count(2)  # the webhook's and the new one's (no Slack URL: no Slack events)
    for form in (page.locator("details.webhook form").first, page.locator("form[action$='/notifications/webhooks/']")):
        legend = form.locator("fieldset > legend")
        expect(legend).to_have_text("Events")
        box = legend.bounding_box()
        assert box and box["width"] >= 30 and box["height"] >= 10, box
    assert page.errors == []
