"""Usability defects found walking the portal as a lead, a member and a viewer."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from reservations import services

from .conftest import PHONE, at, drag, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _empty_panel_hint(page) -> str:
    return page.evaluate(
        "getComputedStyle(document.getElementById('side-panel'), '::before').content")


def test_the_empty_side_panel_invites_only_those_who_can_book_to_book(world, live_server, new_page, sign_in, day):
    lead = sign_in(new_page(), "alpha-lead")
    open_day(lead, live_server, day)
    assert "book" in _empty_panel_hint(lead).lower()

    viewer = sign_in(new_page(), "alpha-viewer")
    open_day(viewer, live_server, day)
    hint = _empty_panel_hint(viewer)
    assert hint not in ("", "none", "normal")
    assert "book" not in hint.lower(), hint  # a viewer cannot book: dragging does nothing
    assert "reservation" in hint.lower()


def test_the_cluster_list_does_not_scroll_sideways_on_a_phone(world, live_server, new_page, sign_in, day):
    services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=1, start=at(day, 10), end=at(day, 12), name="a-rather-long-run-name")
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/clusters/")
    expect(page.locator("td", has_text="a-rather-long-run-name")).to_be_visible()
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the page scrolls sideways by {overflow}px"


def test_a_lead_sees_the_whole_members_table_at_desktop_width(world, live_server, new_page, sign_in):
    for name in ("alpha-lead", "alpha-member", "alpha-viewer"):
        user = world.users[name]
        user.email = f"{name}@research-computing.example.com"
        user.save(update_fields=["email"])
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/team/")
    wrap = page.locator(".table-wrap").filter(has=page.locator("table.team"))
    hidden = wrap.evaluate("el => el.scrollWidth - el.clientWidth")
    assert hidden <= 1, f"{hidden}px of the members table (its Remove buttons) is scrolled out of sight"
    remove = page.get_by_role("button", name="Remove alpha-viewer")
    box, frame = remove.bounding_box(), wrap.bounding_box()
    assert box["x"] + box["width"] <= frame["x"] + frame["width"] + 1


# Each button's right edge past its table's scroll box and past the window (px; > 0 is cut off).
_CUT_BUTTONS = """(table) => {
  const wrap = table.closest('.table-wrap').getBoundingClientRect();
  return Array.from(table.querySelectorAll('button')).map(b => {
    const r = b.getBoundingClientRect();
    return {name: b.textContent.replace(/\\s+/g, ' ').trim(), left: Math.max(wrap.left - r.left, 0),
            right: Math.max(r.right - wrap.right, r.right - document.documentElement.clientWidth, 0)};
  });
}"""


def test_the_members_tables_buttons_are_whole_on_a_phone(world, live_server, new_page, sign_in):
    """At 390 px the members table's Remove buttons stuck out of the table's box by about 3 px, their right
    edge (border and rounded corner) cut off. Every button of the table (Save, Remove) is whole now,
    with nothing of the table scrolled out of sight, also beside a username too long for the row."""
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    long_name = get_user_model().objects.create_user(username="research-computing-pipeline-bot", password="x" * 16)
    Membership.objects.create(user=long_name, tenant=world.tenants["alpha"], role="member")
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/team/")
    table = page.locator("table.team")
    expect(page.get_by_role("button", name="Remove alpha-viewer")).to_be_visible()
    buttons = table.evaluate(_CUT_BUTTONS)
    assert {b["name"] for b in buttons} >= {"Save role of alpha-lead", "Remove alpha-viewer",
                                             "Remove research-computing-pipeline-bot"}, buttons
    cut = [b for b in buttons if b["left"] > 0 or b["right"] > 0]
    assert cut == [], cut
    wrap = page.locator(".table-wrap").filter(has=table)
    hidden = wrap.evaluate("el => el.scrollWidth - el.clientWidth")
    assert hidden <= 0, f"{hidden}px of the members table is scrolled out of sight"
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the team page scrolls sideways by {overflow}px"


def test_a_ready_clusters_connection_and_keys_fit_a_phone(world, live_server, new_page, sign_in, day, settings):
    from datetime import timedelta

    from provisioning import services as provisioning
    from provisioning.models import VirtualCluster
    from tests.provisioning.conftest import FAST

    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    provisioning.lifecycle_tick(now=at(day, 10) - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=booking)
    provisioning.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "ready" and cluster.connection

    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    for path in (f"/reservations/{booking.pk}/", f"/clusters/{cluster.pk}/"):
        page.goto(live_server.url + path)
        expect(page.get_by_role("heading", name="Connection")).to_be_visible()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px"


def test_close_on_the_booking_page_goes_back_to_the_calendar_not_to_a_blank_card(world, live_server, new_page,
                                                                                 sign_in):
    page = sign_in(new_page(), "alpha-member")
    page.goto(f"{live_server.url}/reservations/new/")
    expect(page.locator("#booking-preview dl, #booking-preview p").first).to_be_visible()
    page.get_by_role("button", name="Close").click()
    page.wait_for_url(f"{live_server.url}/calendar/")
    page.wait_for_selector("#calendar[data-ready='1']")
    assert page.errors == []


def test_closing_the_booking_panel_puts_focus_back_where_it_came_from(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-member")
    open_day(page, live_server, day)
    opener = page.get_by_role("button", name="New booking")
    opener.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#booking-form")).to_be_visible()
    expect(page.locator("#booking-title")).to_be_focused()
    page.get_by_role("button", name="Close").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#booking-form")).to_have_count(0)
    # Not lost on <body> (the next Tab would start over at the top of the page): back on the button.
    expect(opener).to_be_focused()


def test_a_refused_booking_puts_focus_on_what_went_wrong(world, live_server, new_page, sign_in, day):
    """After a refused booking the focus went to the "New booking" heading, above the error: a keyboard or
    screen-reader user started reading from the top instead of at the reason. It lands on the error."""
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=4, start=at(day, 10), end=at(day, 14), name="beta-wall")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    drag(page, day, "10:00", "11:00")
    expect(page.locator("#booking-form")).to_be_visible()
    page.get_by_role("button", name="Book", exact=True).focus()
    page.keyboard.press("Enter")
    error = page.locator("#booking-error")
    expect(error).to_contain_text("Only 0 of 4")
    expect(error).to_be_focused()
    expect(error).to_have_attribute("tabindex", "-1")
    assert page.errors == []


# Every reservation event's time and title: how far each overflows its box, its ellipsis and its tooltip.
_EVENT_LABELS = """() => Array.from(document.querySelectorAll('.fc-event[data-reservation-id]')).map(e => {
  const time = e.querySelector('.fc-event-time'), title = e.querySelector('.fc-event-title');
  return {
    id: e.getAttribute('data-reservation-id'), tooltip: e.getAttribute('title') || '',
    time: time ? time.textContent : '',
    timeHidden: time ? Math.max(time.scrollWidth - time.clientWidth,
                                time.getBoundingClientRect().right - e.getBoundingClientRect().right) : 0,
    titleHidden: title ? title.scrollWidth - title.clientWidth : 0,
    ellipsis: title ? getComputedStyle(title).textOverflow : '',
  };
})"""


@pytest.mark.parametrize("viewport", ["desktop", "phone"])
def test_calendar_event_labels_are_not_cut_off_mid_word_and_say_it_all_on_hover(
        world, live_server, new_page, sign_in, day, viewport):
    """The month view cut a booking's start time mid-digit ("18:0", "21") and its title at the cell's edge with
    nothing to say there was more; the phone's week view cut "10:00 - 12:00" the same way. Times are never cut
    now, a title too long for its box ends in an ellipsis, and every event's tooltip says the whole of it."""
    from datetime import timedelta

    from django.utils import timezone

    from .conftest import DESKTOP

    sunday = day + timedelta(days=(6 - day.weekday()) % 7)  # a week's last column: the shortest segment
    names = {}
    for start, name in ((at(sunday, 21), "hyperparameter-sweep-for-the-long-context-model"), (at(day, 10), "eval")):
        booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                              pool=world.pool, node_count=1, start=start,
                                              end=start + timedelta(hours=2), name=name)
        names[str(booking.pk)] = name
    assert sunday > timezone.now().date()
    page = sign_in(new_page(viewport=DESKTOP if viewport == "desktop" else PHONE), "alpha-lead")
    for view, when in (("dayGridMonth", sunday), ("timeGridWeek", day)):
        page.goto(f"{live_server.url}/calendar/?view={view}&date={when.isoformat()}&pool=h100")
        page.wait_for_selector("#calendar[data-ready='1']")
        labels = page.evaluate(_EVENT_LABELS)
        assert {label["id"] for label in labels} == set(names), (view, labels)
        for label in labels:
            assert label["timeHidden"] <= 1, (view, label)  # "21:00", never "21:0"
            if label["titleHidden"] > 1:
                assert label["ellipsis"] == "ellipsis", (view, label)
            assert f"{names[label['id']]} · 1× h100" in label["tooltip"], (view, label)
            assert label["time"].replace(" ", "")[:5] in label["tooltip"].replace(" ", ""), (view, label)
    assert page.errors == []


@pytest.mark.parametrize("locale", ["en-US", "en-GB"])
def test_calendar_event_tooltips_write_times_in_the_sites_format_whatever_the_browsers_language(
        world, live_server, new_page, sign_in, day, locale):
    """An event's tooltip was written in the browser's language: a US browser read "Wed, Dec 9, 11:00 GMT+1 –
    13:00 GMT+1", a British one "Wed 9 Dec, 11:00 CET – 13:00 CET", where every page writes "Wed 9 Dec 11:00
    CET" (the week headings already did since they stopped using the browser's language)."""
    import zoneinfo

    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                          name="eval")
    page = sign_in(new_page(tz="Europe/Berlin", locale=locale), "alpha-lead")
    open_day(page, live_server, day)
    tooltip = page.locator(f".fc-event[data-reservation-id='{booking.pk}']").get_attribute("title")
    start, end = booking.start.astimezone(berlin), booking.end.astimezone(berlin)
    expected = f"{start:%a} {start.day} {start:%b} {start:%H:%M} {start:%Z} – {end:%H:%M} {end:%Z} · eval"
    assert tooltip.startswith(expected), (tooltip, expected)
    assert page.errors == []


_COVERED_COUNTS = """() => {
  const events = Array.from(document.querySelectorAll('.fc-timegrid-event-harness .fc-event'))
    .map(e => e.getBoundingClientRect());
  return Array.from(document.querySelectorAll('.fc-bg-event .fc-event-title')).flatMap(t => {
    const range = document.createRange();
    range.selectNodeContents(t);
    const r = range.getBoundingClientRect();  // the text's own box, not the full-width block's
    const hidden = events.filter(e => e.left < r.right - 0.5 && e.right > r.left + 0.5 &&
                                      e.top < r.bottom - 0.5 && e.bottom > r.top + 0.5);
    return hidden.length ? [{count: t.textContent, hiddenPx: hidden.map(e => Math.round(e.right - r.left))}] : [];
  });
}"""


def test_a_days_free_node_counts_are_not_hidden_under_its_bookings(world, live_server, new_page, sign_in, day):
    """The week view leaves a strip right of the bookings for the shading and its free count ("13/16"), but the
    strip (26% of a column) was narrower than the count: a booking covered its first digit ("3/16")."""
    from reservations.models import Node

    for i in range(5, 17):  # a pool of 16, as the demo's a100s: two-digit counts
        Node.objects.create(hostname=f"h100-{i:03d}", pool=world.pool)
    for hour in (0, 10):
        services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=world.pool, node_count=1, start=at(day, hour), end=at(day, hour + 6))
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=timeGridWeek&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    assert page.locator(".fc-bg-event .fc-event-title").count() > 0
    assert page.evaluate(_COVERED_COUNTS) == []


def test_the_week_views_day_headings_name_the_month(world, live_server, new_page, sign_in, day):
    """The week's column headings were FullCalendar's US default, "Fri 12/4": 4 December or 12 April? Every
    other date on the portal names its month ("Fri 4 Dec")."""
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=timeGridWeek&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    headings = page.locator(".fc-col-header-cell-cushion").all_inner_texts()
    assert len(headings) == 7
    assert not [h for h in headings if "/" in h], headings
    assert f"{day:%b}" in headings[0] and str(day.day) in headings[0], headings
    # Day before month, as the rest of the site writes a date ("Mon 7 Dec", not the US "Mon, Dec 7").
    assert headings[0] == f"{day:%a} {day.day} {day:%b}", headings


# Every table's scroll box (.table-wrap), whether it scrolls at this width or not.
_TABLE_BOXES = """() => Array.from(document.querySelectorAll('.table-wrap'))
  .map(w => ({table: w.querySelector('table') && w.querySelector('table').className,
              tabindex: w.getAttribute('tabindex'), role: w.getAttribute('role'),
              named: !!(w.getAttribute('aria-label') ||
                        (w.getAttribute('aria-labelledby') &&
                         document.getElementById(w.getAttribute('aria-labelledby'))))}))"""


def test_tables_that_scroll_sideways_on_a_phone_can_be_scrolled_from_the_keyboard(world, live_server, new_page,
                                                                                  sign_in, day):
    """On a phone the notifications page's recent messages, the delivery log, the cluster list and the audit
    log scroll sideways inside a box a keyboard cannot reach (axe: scrollable-region-focusable, serious): the
    other pages' tables are focusable named regions; these were plain divs.

    These tables now stack into label/value lines on a phone (test_phone_tables.py) and no longer scroll
    there, but their box still scrolls wherever a table is wider than it (a window just above the phone
    breakpoint, a long unbroken value): every table's box on these pages is a focusable named region."""
    services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=1, start=at(day, 10), end=at(day, 12), name="a-rather-long-run-name")
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    with_tables = []
    for path in ("/notifications/", "/notifications/deliveries/", "/clusters/", "/audit/", "/"):
        page.goto(live_server.url + path)
        for table in page.evaluate(_TABLE_BOXES):
            with_tables.append(path)
            assert (table["tabindex"], table["role"], table["named"]) == ("0", "region", True), (path, table)
    assert set(with_tables) == {"/notifications/", "/notifications/deliveries/", "/clusters/", "/audit/", "/"}, \
        with_tables  # the check above did run on every page


def test_the_sign_in_page_puts_the_cursor_in_the_username_field(world, live_server, new_page):
    """Reported as missing; it holds (Django's form autofocuses the username): this keeps it so, on the page
    itself, on the way to a page that needs a session, and after a refused password (username kept)."""
    page = new_page()
    for path in ("/accounts/login/", "/calendar/"):
        page.goto(live_server.url + path)
        expect(page.get_by_label("Username")).to_be_focused()
    page.get_by_label("Username").fill("alpha-lead")
    page.get_by_label("Password").fill("not-the-password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator(".login [role=alert]")).to_be_visible()
    expect(page.get_by_label("Username")).to_be_focused()
    expect(page.get_by_label("Username")).to_have_value("alpha-lead")


def test_an_events_panel_closes_with_escape_or_its_close_button_and_focus_goes_back_to_the_event(
        world, live_server, new_page, sign_in, day):
    """The reservation panel (and the "Booked #" panel) had no Close button and Escape did nothing:
    once opened, a keyboard user could not dismiss it."""
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=at(day, 6), end=at(day, 8), name="esc run")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    event = page.locator(f".fc-event[data-reservation-id='{r.pk}']")
    event.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#side-panel h2")).to_contain_text("esc run")
    page.keyboard.press("Escape")
    expect(page.locator("#side-panel [data-reservation-id]")).to_have_count(0)
    expect(event).to_be_focused()
    page.keyboard.press("Enter")
    close = page.locator("#side-panel").get_by_role("button", name="Close")
    expect(close).to_be_visible()
    close.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#side-panel [data-reservation-id]")).to_have_count(0)
    expect(event).to_be_focused()
    # The panel saying "Booked #": closable too.
    page.get_by_role("button", name="New booking").focus()
    page.keyboard.press("Enter")
    page.get_by_label(re.compile("^Start")).fill(f"{day.isoformat()}T10:00")
    page.get_by_label(re.compile("^End")).fill(f"{day.isoformat()}T12:00")
    page.get_by_label("Name").press("Enter")
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("Booked #")
    expect(page.locator("#side-panel").get_by_role("button", name="Close")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#side-panel [data-reservation-id]")).to_have_count(0)
    expect(page.get_by_role("button", name="New booking")).to_be_focused()


def test_a_booking_refused_for_a_field_takes_focus_to_that_field(world, live_server, new_page, sign_in, day):
    """A Book refused only for a field (an end before the start) has no alert in the panel, so focus went to
    the "New booking" heading: a keyboard or screen-reader user landed at the top of the form, far from
    what to fix. Focus goes to the first field marked aria-invalid, which says what is wrong next to it."""
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    page.get_by_role("button", name="New booking").click()
    page.get_by_label(re.compile("^Start")).fill(f"{day.isoformat()}T10:00")
    page.get_by_label(re.compile("^End")).fill(f"{day.isoformat()}T08:00")
    page.get_by_label("Name").fill("backwards")
    with page.expect_response(re.compile(r"/reservations/new/")):
        page.get_by_role("button", name="Book", exact=True).click()
    end = page.get_by_label(re.compile("^End"))
    expect(page.locator("#side-panel")).to_contain_text("Must be after the start.")
    expect(page.locator("#side-panel [role=alert]")).to_have_count(0)
    expect(end).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#side-panel [aria-invalid=true]")).to_have_count(1)
    expect(end).to_be_focused()
    expect(page.get_by_label("Name")).to_have_value("backwards")
    assert page.errors == []


def test_a_cluster_watched_until_ready_offers_its_key_without_a_reload(world, live_server, new_page, sign_in, day,
                                                                        settings):
    """A member watching a new cluster come up on the reservation page (or the cluster page) saw the status card
    reach Ready with its connection details, but the Credentials part still said "Issued while the network is
    configured." with no download link until they reloaded the page: only the status card was polled. The
    credentials and the actions beside them now follow each poll."""
    from datetime import timedelta

    from provisioning import services as provisioning
    from provisioning.models import VirtualCluster
    from tests.provisioning.conftest import FAST

    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    booking = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    provisioning.lifecycle_tick(now=at(day, 10) - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=booking)
    assert cluster.status not in ("ready", "failed")

    pages = []
    for path in (f"/reservations/{booking.pk}/", f"/clusters/{cluster.pk}/"):
        page = sign_in(new_page(), "alpha-member")
        page.goto(live_server.url + path)
        expect(page.get_by_text("Issued while the network is configured.")).to_be_visible()
        pages.append(page)

    provisioning.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "ready"

    for page in pages:  # no reload: the next poll brings them
        expect(page.locator("#cluster-status .badge")).to_have_text("Ready", timeout=10_000)
        download = page.get_by_role("link", name=re.compile("^download"))
        expect(download).to_have_attribute("href", f"/clusters/{cluster.pk}/credentials/ssh_key/")
        expect(page.get_by_text("Issued while the network is configured.")).to_have_count(0)
        expect(page.get_by_role("button", name="Tear down now")).to_be_visible()
        assert page.errors == []


def test_a_reservation_watched_until_its_cluster_is_ready_shows_its_new_status_without_a_reload(
        world, live_server, new_page, sign_in, day, settings):
    """A team watching its new cluster come up on the reservation page saw the cluster reach Ready, but the
    header's status badge, the lifecycle line and the actions beside the booking kept the status the page
    loaded with (Confirmed) until a reload: only the cluster part was polled. Each poll now brings the
    booking's status parts too (htmx out-of-band, when the status moved on), and polling slows down once the
    booking is under way with its cluster handed over (from every 3 s to every 15 s: only its nodes can change)."""
    from datetime import timedelta

    from provisioning import services as provisioning
    from provisioning.models import VirtualCluster
    from tests.provisioning.conftest import FAST

    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    booking = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                          pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    page = sign_in(new_page(), "alpha-lead")
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    polls: list[str] = []
    page.on("request", lambda req: polls.append(req.url) if req.headers.get("hx-request") else None)
    page.goto(f"{live_server.url}/reservations/{booking.pk}/")
    badge = page.locator("h1 + div .badge").first
    current = page.locator(".lifecycle [aria-current=step]")
    expect(badge).to_have_text("Confirmed")
    expect(current).to_have_attribute("data-status", "confirmed")

    provisioning.lifecycle_tick(now=at(day, 10) - timedelta(minutes=10))  # the window is near: it is built
    cluster = VirtualCluster.objects.get(reservation=booking)
    provisioning.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "ready"

    # no reload: the next poll brings the cluster and the booking's status together
    expect(page.locator("#cluster-status .badge")).to_have_text("Ready", timeout=10_000)
    expect(badge).to_have_text("Provisioning")
    expect(current).to_have_attribute("data-status", "provisioning")

    provisioning.lifecycle_tick(now=at(day, 10))  # the window starts: the booking is under way
    expect(badge).to_have_text("Active", timeout=10_000)
    expect(current).to_have_attribute("data-status", "active")
    expect(page.get_by_role("button", name=re.compile(r"^\+4 hours"))).to_be_visible()
    expect(page.get_by_role("button", name="Tear down now")).to_be_visible()

    # nothing more follows its status for a while: the 3 s polling has stopped; the card goes on looking, every
    # 15 s, only for a node swapped under the running booking (test_reservation_nodes_live)
    expect(page.locator("[hx-trigger='every 3s']")).to_have_count(0)
    expect(page.locator("[hx-trigger^=every]")).to_have_count(1)
    expect(page.locator("#cluster-status")).to_have_attribute("hx-trigger", "every 15s")
    seen = len(polls)
    page.wait_for_timeout(4_000)
    assert len(polls) == seen
    assert page.errors == []
    assert console_errors == []
