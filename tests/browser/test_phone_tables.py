"""Wide tables on a phone: a booking's status and a row's Retry / Revoke button are on screen, not scrolled away.

At 390 px the dashboard's and the reservation list's Status column sat about 133 px out of sight inside the
table's own scrolling box, the cluster list's about 130 px, the delivery log's Retry button about 294 px and the
account page's Revoke buttons 160-200 px: a lead on a phone saw no status and no button unless they guessed the
table scrolled sideways. Below the phone breakpoint such a table (``table.stack-narrow``) shows each row as a
block of "label value" lines; at desktop width it is the same table as before.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from reservations import services

from .conftest import PHONE, at

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# How far an element sticks out of the window and out of its table's scroll box (px; > 0 is out of sight), and
# how far that box (and the page) scrolls sideways.
_OUT_OF_SIGHT = """(el) => {
  const r = el.getBoundingClientRect(), wrap = el.closest('.table-wrap');
  const w = wrap.getBoundingClientRect(), width = document.documentElement.clientWidth;
  return {left: Math.max(-r.left, w.left - r.left, 0),
          right: Math.max(r.right - width, r.right - w.right, 0),
          width: r.width,
          box_scrolls: wrap.scrollWidth - wrap.clientWidth,
          page_scrolls: document.documentElement.scrollWidth - window.innerWidth};
}"""


def _assert_in_sight(locator, what: str) -> None:
    expect(locator).to_be_visible()
    out = locator.evaluate(_OUT_OF_SIGHT)
    assert out["width"] > 0, (what, out)
    assert out["left"] <= 0.5 and out["right"] <= 0.5, f"{what} is out of sight: {out}"
    assert out["box_scrolls"] <= 1, f"{what}'s table still scrolls sideways by {out['box_scrolls']}px"
    assert out["page_scrolls"] <= 1, f"the page scrolls sideways by {out['page_scrolls']}px ({what})"


def _assert_a_plain_table(page, table, header: str) -> None:
    """At desktop width: a real table, its header row on screen, cells side by side."""
    head = table.locator("thead th", has_text=header)
    expect(head).to_be_visible()
    assert table.evaluate("t => getComputedStyle(t).display") == "table"
    assert table.locator("tbody tr").first.evaluate("r => getComputedStyle(r).display") == "table-row"
    assert table.locator("tbody td").first.evaluate("c => getComputedStyle(c).display") == "table-cell"
    box = head.bounding_box()
    first = table.locator("thead th").first.bounding_box()
    assert abs(box["y"] - first["y"]) <= 1 and box["x"] > first["x"], "the header cells are not on one row"


def _booking(world, day, name="nightly-llama-finetune"):
    return services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12), name=name)


@pytest.mark.parametrize("path, table, status", [("/", "#upcoming-title ~ .table-wrap table", 5),
                                                 ("/reservations/", "section[aria-labelledby=list-title] table", 5),
                                                 ("/clusters/", "main table", 6)])
def test_a_bookings_status_is_on_screen_on_a_phone(world, live_server, new_page, sign_in, day, path, table, status):
    booking = _booking(world, day)
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(live_server.url + path)
    rows = page.locator(table).locator("tbody tr")
    row = rows.filter(has_text="nightly-llama-finetune")
    expect(row).to_have_count(1)
    expect(page.locator(table).locator(f"thead th:nth-child({status})")).to_have_text("Status")
    cell = row.locator(f"td:nth-child({status})")
    _assert_in_sight(cell.locator(".badge").first, f"{path}: the status of #{booking.pk}")
    # Each value says what it is: the column's name is drawn beside it (the header row itself is hidden).
    label = cell.evaluate("c => getComputedStyle(c, '::before').content")
    assert "Status" in label, label

    desktop = sign_in(new_page(), "alpha-lead")
    desktop.goto(live_server.url + path)
    _assert_a_plain_table(desktop, desktop.locator(table), "Status")


def test_the_delivery_logs_retry_button_is_on_screen_on_a_phone(world, live_server, new_page, sign_in, day,
                                                                settings):
    from notifications import services as notify
    from notifications.choices import DeliveryStatus
    from notifications.models import Delivery
    from tenants.services import tenant_slack_webhook_set

    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = ""
    settings.PORTAL_DEMO_WEBHOOK_URL = ""
    tenant = tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                      url="https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX")
    notify.slack_channel_ensure(tenant)
    booking = _booking(world, day)
    deliveries = list(Delivery.objects.filter(tenant=tenant))  # the booking's own "confirmed" message
    if not deliveries:
        deliveries = notify.event_fanout(event="reservation.confirmed", payload={"reservation_id": booking.pk})
    assert deliveries
    Delivery.objects.filter(pk__in=[d.pk for d in deliveries]).update(
        status=DeliveryStatus.FAILED, last_status_code=404, last_error="channel_not_found", attempts=3)

    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/notifications/deliveries/")
    row = page.locator(f"tr[data-delivery='{deliveries[0].pk}']")
    _assert_in_sight(row.get_by_role("button", name="Retry"), "the Retry button")
    _assert_in_sight(row.locator(".badge"), "the delivery's status")

    desktop = sign_in(new_page(), "alpha-lead")
    desktop.goto(f"{live_server.url}/notifications/deliveries/")
    _assert_a_plain_table(desktop, desktop.locator("table.deliveries"), "Status")


def test_the_api_tokens_revoke_buttons_are_on_screen_on_a_phone(world, live_server, new_page, sign_in):
    from tenants.services import token_issue_own

    user = world.users["alpha-member"]
    laptop, _ = token_issue_own(user=user, name="laptop", expires_in_days=90)
    ci, _ = token_issue_own(user=user, name="ci-" + "x" * 90, expires_in_days=None)
    page = sign_in(new_page(viewport=PHONE), "alpha-member")
    page.goto(f"{live_server.url}/account/")
    table = page.locator("[aria-label='Your tokens'] table")
    buttons = table.get_by_role("button", name="Revoke")
    names = buttons.evaluate_all("bs => bs.map(b => b.textContent.replace(/\\s+/g, ' ').trim())")
    assert {f"Revoke {laptop.prefix}", f"Revoke {ci.prefix}"} <= set(names), names
    for name in names:
        _assert_in_sight(table.get_by_role("button", name=name, exact=True), name)

    desktop = sign_in(new_page(), "alpha-member")
    desktop.goto(f"{live_server.url}/account/")
    _assert_a_plain_table(desktop, desktop.locator("[aria-label='Your tokens'] table"), "Last used")


def test_the_audit_log_fits_a_phone_without_a_sideways_scroll(world, live_server, new_page, sign_in, day):
    _booking(world, day)
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/audit/")
    row = page.locator("table.audit tbody tr").first
    _assert_in_sight(row.locator("td").last, "the audit entry's before → after")

    desktop = sign_in(new_page(), "alpha-lead")
    desktop.goto(f"{live_server.url}/audit/")
    _assert_a_plain_table(desktop, desktop.locator("table.audit"), "Action")


# Chromium's own accessibility tree (what a screen reader gets), not Playwright's reading of the markup.
def _ax_cells(page) -> list[dict]:
    cdp = page.context.new_cdp_session(page)
    nodes = cdp.send("Accessibility.getFullAXTree")["nodes"]
    return [{"role": n["role"]["value"], "name": n.get("name", {}).get("value", "")} for n in nodes
            if n.get("role", {}).get("value") in ("table", "columnheader", "cell", "row")]


def test_a_stacked_table_is_still_a_table_with_headers_for_a_screen_reader(world, live_server, new_page, sign_in,
                                                                         day):
    _booking(world, day)
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/reservations/")
    expect(page.locator("td[data-label=Status]").first).to_be_visible()
    assert page.locator("thead").evaluate("h => getComputedStyle(h).display") != "none"
    tree = _ax_cells(page)
    roles = {n["role"] for n in tree}
    assert {"table", "row", "columnheader", "cell"} <= roles, tree
    assert any(n["role"] == "columnheader" and n["name"] == "Status" for n in tree), tree
