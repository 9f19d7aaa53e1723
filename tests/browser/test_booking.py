"""Booking in a real browser: drag-select, the htmx form, suggestions, drag/resize refusals."""

from __future__ import annotations

import re
import zoneinfo
from datetime import timedelta

import pytest
from playwright.sync_api import expect

from reservations import services
from reservations.models import Reservation

from .conftest import at, drag, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_drag_select_books_and_the_api_shows_it(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    drag(page, day, "10:00", "12:00")

    form = page.locator("#booking-form")
    expect(form).to_be_visible()
    expect(page.get_by_label(re.compile("^Start"))).to_have_value(f"{day.isoformat()}T10:00")
    expect(page.get_by_label(re.compile("^End"))).to_have_value(f"{day.isoformat()}T13:00")
    page.get_by_label("Nodes").fill("2")
    page.get_by_label("Name").fill("drag-booked run")
    expect(page.locator("#booking-preview [data-field='billing']")).to_contain_text("Committed")
    expect(page.locator("#booking-preview [data-field='free']")).to_contain_text("4 of 4")
    page.get_by_role("button", name="Book", exact=True).click()

    done = page.locator("#side-panel [data-reservation-id]")
    expect(done).to_contain_text("Booked #")
    pk = int(done.get_attribute("data-reservation-id"))
    expect(page.locator(f".fc-event[data-reservation-id='{pk}']")).to_be_visible()

    api = page.request.get(f"{live_server.url}/api/v1/reservations/{pk}/")
    assert api.ok, api.text()
    body = api.json()
    assert body["start"] == f"{day.isoformat()}T10:00:00Z" and body["end"] == f"{day.isoformat()}T13:00:00Z"
    assert body["node_count"] == 2 and body["name"] == "drag-booked run" and body["tenant"] == "alpha"
    assert len(body["nodes"]) == 2 and body["billing"] == "committed"
    assert page.errors == []


def test_conflict_offers_suggestions_and_one_click_books_it(world, live_server, new_page, sign_in, day):
    # beta holds every node from 10:00 to 14:00: alpha's 10:00-12:00 request cannot fit.
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=3, start=at(day, 10), end=at(day, 14), name="beta-wall")
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=1, start=at(day, 10), end=at(day, 14), name="beta-wall-2")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    drag(page, day, "10:00", "11:00")
    expect(page.locator("#booking-preview [data-problem]")).to_contain_text("Only 0 of 4")
    page.get_by_role("button", name="Book", exact=True).click()

    expect(page.locator("#booking-error")).to_contain_text("Only 0 of 4")
    suggestions = page.locator(".suggestions button")
    expect(suggestions.first).to_be_visible()
    starts = [suggestions.nth(i).get_attribute("data-start") for i in range(suggestions.count())]
    assert f"{day.isoformat()}T14:00:00Z" in starts, starts  # the earliest fit after the wall
    chosen = suggestions.filter(has_text="14:00")
    chosen.click()

    done = page.locator("#side-panel [data-reservation-id]")
    expect(done).to_contain_text("Booked #")
    booked = Reservation.objects.get(pk=int(done.get_attribute("data-reservation-id")))
    assert (booked.start, booked.end) == (at(day, 14), at(day, 16))
    assert booked.tenant == world.tenants["alpha"] and booked.node_count == 1
    expect(page.locator(f".fc-event[data-reservation-id='{booked.pk}']")).to_be_visible()


def _resize(page, pk: int, slots: int) -> None:
    event = page.locator(f".fc-event[data-reservation-id='{pk}']")
    event.hover()
    handle = event.locator(".fc-event-resizer-end")
    box = handle.bounding_box()
    lane = page.locator("td.fc-timegrid-slot-lane").first.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x, y + lane["height"] * slots / 2, steps=4)
    page.mouse.move(x, y + lane["height"] * slots, steps=4)
    page.mouse.up()


def test_drag_to_extend_into_a_conflict_is_refused_and_snaps_back(world, live_server, new_page, sign_in, day):
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=2, start=at(day, 10), end=at(day, 12),
                                       name="alpha-run")
    # From 12:00 every node is taken by beta, so alpha cannot grow past 12:00.
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=3, start=at(day, 12), end=at(day, 15), name="beta-after")
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=1, start=at(day, 12), end=at(day, 15), name="beta-after-2")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    event = page.locator(f".fc-event[data-reservation-id='{mine.pk}']")
    before = event.bounding_box()

    with page.expect_response(lambda r: f"/api/v1/reservations/{mine.pk}/" in r.url
                              and r.request.method == "PATCH") as answer:
        _resize(page, mine.pk, 2)
    assert answer.value.status == 409
    assert answer.value.json()["code"] == "capacity_unavailable"
    expect(page.locator("#calendar-status")).to_contain_text("Not changed")
    expect(page.locator("#calendar-status")).to_have_attribute("data-kind", "error")
    # The API's text has its window in UTC ("…10:00Z"); the page says it the way it says every time.
    utc_time = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}Z")
    assert utc_time.search(answer.value.json()["detail"])
    status = page.locator("#calendar-status").inner_text()
    assert not utc_time.search(status), status
    # The window the refusal names starts at the booking's start, 10:00 on that day, shown in the page's zone and
    # in the site's one format ("Tue 8 Dec 10:00 UTC"), whatever the browser's language.
    tz = zoneinfo.ZoneInfo(page.evaluate("() => JSON.parse(document.getElementById('calendar-config').textContent).tz"))
    start = at(day, 10).astimezone(tz)
    start_shown = f"{start:%a} {start.day} {start:%b} {start:%H:%M} "
    assert start_shown in status, (start_shown, status)
    page.wait_for_timeout(200)
    after = event.bounding_box()
    assert abs(after["height"] - before["height"]) < 2, (before, after)  # snapped back
    mine.refresh_from_db()
    assert mine.end == at(day, 12)

    # Shortening is allowed: the same gesture upwards goes through and sticks.
    with page.expect_response(lambda r: f"/api/v1/reservations/{mine.pk}/" in r.url
                              and r.request.method == "PATCH") as answer:
        _resize(page, mine.pk, -1)
    assert answer.value.status == 200, answer.value.text()
    expect(page.locator("#calendar-status")).to_contain_text("shortened")
    mine.refresh_from_db()
    assert mine.end == at(day, 11)


def test_drag_moves_a_booking_that_has_not_begun(world, live_server, new_page, sign_in, day):
    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    page = sign_in(new_page(), "alpha-member")
    open_day(page, live_server, day)
    event = page.locator(f".fc-event[data-reservation-id='{mine.pk}']")
    box = event.bounding_box()
    lane = page.locator("td.fc-timegrid-slot-lane").first.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + 8
    with page.expect_response(lambda r: f"/api/v1/reservations/{mine.pk}/" in r.url
                              and r.request.method == "PATCH") as answer:
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x, y + lane["height"], steps=4)
        page.mouse.move(x, y + lane["height"] * 3, steps=4)
        page.mouse.up()
    assert answer.value.status == 200, answer.value.text()
    mine.refresh_from_db()
    assert (mine.start, mine.end) == (at(day, 13), at(day, 15))
    expect(page.locator("#calendar-status")).to_contain_text("moved")
    assert timedelta(hours=2) == mine.end - mine.start


def test_cancel_asks_for_confirmation_first(world, live_server, new_page, sign_in, day):
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                       name="to-cancel")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    page.locator(f".fc-event[data-reservation-id='{mine.pk}']").click()
    cancel = page.locator("#side-panel [data-cancel]")

    page.once("dialog", lambda dialog: dialog.dismiss())
    cancel.click()
    page.wait_for_timeout(300)
    mine.refresh_from_db()
    assert mine.status == "confirmed"  # said no: nothing happened

    messages = []

    def accept(dialog):
        messages.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    cancel.click()
    expect(page.locator("#side-panel .badge.st-cancelled")).to_be_visible()
    assert "Cancel reservation" in messages[0] and "released immediately" in messages[0]
    mine.refresh_from_db()
    assert mine.status == "cancelled"
    expect(page.locator(f".fc-event[data-reservation-id='{mine.pk}']")).to_have_count(0)


def test_a_crowded_month_day_links_to_its_day_view(world, live_server, new_page, sign_in, day):
    for hour in range(6):  # six one-node bookings on one day: four are shown, "+2 more" leads to the rest
        services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=world.pool, node_count=1, start=at(day, 8 + 2 * hour),
                                    end=at(day, 9 + 2 * hour), name=f"run-{hour}")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=dayGridMonth&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    cell = page.locator(f".fc-daygrid-day[data-date='{day.isoformat()}']")
    expect(cell.locator(".fc-event[data-reservation-id]")).to_have_count(4)
    more = cell.locator(".fc-event.more-link")
    expect(more).to_have_text("+2 more")
    more.click()
    page.wait_for_selector("#calendar[data-ready='1']")
    expect(page.locator(".fc-timegrid-col .fc-event[data-reservation-id]")).to_have_count(6)


def test_keyboard_only_booking_and_event_details(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(), "alpha-member")
    open_day(page, live_server, day)
    page.get_by_role("button", name="New booking").focus()
    page.keyboard.press("Enter")
    start = page.get_by_label(re.compile("^Start"))
    expect(start).to_be_visible()
    start.fill(f"{day.isoformat()}T06:00")
    page.get_by_label(re.compile("^End")).fill(f"{day.isoformat()}T08:00")
    page.get_by_label("Name").fill("typed run")
    page.get_by_label("Name").press("Enter")  # submits the form like any other
    done = page.locator("#side-panel [data-reservation-id]")
    expect(done).to_contain_text("Booked #")
    pk = done.get_attribute("data-reservation-id")
    event = page.locator(f".fc-event[data-reservation-id='{pk}']")
    event.focus()  # events are links: reachable with Tab
    page.keyboard.press("Enter")
    expect(page.locator("#side-panel h2")).to_contain_text("typed run")


def test_a_half_hour_zone_books_on_the_pools_grid_by_dragging(world, live_server, new_page, sign_in, day):
    """In Asia/Kolkata (+05:30) an hourly pool's slots start at :30 local time: the calendar's slots and
    snapping follow the pool's grid, so a dragged selection books (it was refused as off the grid)."""
    import zoneinfo

    kolkata = zoneinfo.ZoneInfo("Asia/Kolkata")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/account/")
    page.locator("select#id_tz").select_option("Asia/Kolkata")
    page.get_by_role("button", name="Save").click()
    open_day(page, live_server, day)
    expect(page.locator("td.fc-timegrid-slot-lane[data-time='10:30:00']")).to_have_count(1)
    expect(page.locator("td.fc-timegrid-slot-lane[data-time='10:00:00']")).to_have_count(0)
    drag(page, day, "10:30", "11:30")
    expect(page.get_by_label(re.compile("^Start"))).to_have_value(f"{day.isoformat()}T10:30")
    expect(page.get_by_label(re.compile("^End"))).to_have_value(f"{day.isoformat()}T12:30")
    page.get_by_label("Name").fill("ist-run")
    page.get_by_role("button", name="Book", exact=True).click()
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("Booked #")
    booked = Reservation.objects.get(name="ist-run")
    start = at(day, 10, tz=kolkata).replace(minute=30)
    assert (booked.period.lower, booked.period.upper) == (start, start + timedelta(hours=2))
    assert page.errors == []


def test_a_refused_new_end_keeps_what_was_typed_with_the_reason_beside_it(world, live_server, new_page, sign_in, day):
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=2, start=at(day, 10), end=at(day, 12),
                                       name="alpha-run")
    services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                                node_count=3, start=at(day, 13), end=at(day, 15), name="beta-after")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/reservations/{mine.pk}/")
    field = page.get_by_label(re.compile("^New end"))
    expect(field).to_have_value(f"{day.isoformat()}T13:00")  # end + one slot
    field.fill(f"{day.isoformat()}T14:00")
    page.get_by_role("button", name="Change end").click()
    field = page.get_by_label(re.compile("^New end"))
    expect(field).to_have_value(f"{day.isoformat()}T14:00")  # what was typed, not end + one slot again
    expect(field).to_have_attribute("aria-invalid", "true")
    reason = page.locator(f"#{field.get_attribute('aria-describedby')}")
    expect(reason).to_contain_text("Not changed:")
    expect(reason).to_be_visible()
    mine.refresh_from_db()
    assert mine.end == at(day, 12)
    assert page.errors == []


def test_a_whole_day_picked_in_the_month_view_opens_on_the_pools_grid(world, live_server, new_page, sign_in, day):
    """In Asia/Kolkata (+05:30) an hourly pool's slots start at :30 local time. Picking a day in the month
    view opened the form at local midnight (18:30 UTC, off the grid), so booking it was refused."""
    import zoneinfo

    kolkata = zoneinfo.ZoneInfo("Asia/Kolkata")
    page = sign_in(new_page(tz="Asia/Kolkata"), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=dayGridMonth&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    page.locator(f".fc-daygrid-day[data-date='{day.isoformat()}'] .fc-daygrid-day-frame").click()
    expect(page.get_by_label(re.compile("^Start"))).to_have_value(f"{day.isoformat()}T00:30")
    expect(page.get_by_label(re.compile("^End"))).to_have_value(f"{(day + timedelta(days=1)).isoformat()}T00:30")
    page.get_by_label("Name").fill("whole-day")
    page.get_by_role("button", name="Book", exact=True).click()
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("Booked #")
    booked = Reservation.objects.get(name="whole-day")
    start = at(day, 0, tz=kolkata).replace(minute=30)
    assert (booked.period.lower, booked.period.upper) == (start, start + timedelta(days=1))
    assert page.errors == []


def test_the_extend_buttons_name_the_end_they_would_give(world, live_server, new_page, sign_in, day):
    """"+4 hours" did not say what the new end would be; each button's accessible name now does."""
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                       name="alpha-run")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/reservations/{mine.pk}/")
    for label, end in (("+4 hours", at(day, 16)), ("+1 day", at(day, 12) + timedelta(days=1))):
        name = f"{label} (ends {end:%a} {end.day} {end:%b %H:%M} UTC)"
        expect(page.get_by_role("button", name=name, exact=True)).to_have_count(1)
    assert page.errors == []


def test_a_drag_on_a_stale_calendar_never_undoes_someone_elses_change(world, live_server, new_page, sign_in, day):
    # The calendar shows 10:00-12:00; meanwhile another lead extends the booking to 15:00. Dragging the stale
    # box's end down one slot (to 13:00, "extend") used to PATCH end=13:00 and say "extended" while cutting two
    # hours off the booking.
    mine = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12),
                                       name="alpha-run")
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    services.reservation_update(actor=world.users["alpha-lead"], reservation=mine, end=at(day, 15))
    patches = []
    page.on("request", lambda r: patches.append(r.url) if r.method == "PATCH" else None)
    _resize(page, mine.pk, 1)
    expect(page.locator("#calendar-status")).to_contain_text("changed since")
    expect(page.locator("#calendar-status")).to_have_attribute("data-kind", "error")
    assert patches == []
    mine.refresh_from_db()
    assert mine.end == at(day, 15)
    # The calendar now shows the booking as it is: 10:00-15:00, five slots tall.
    page.wait_for_selector("#calendar[data-ready='1']")
    lane = page.locator("td.fc-timegrid-slot-lane").first.bounding_box()
    expect(page.locator(f".fc-event[data-reservation-id='{mine.pk}']")).to_have_count(1)
    box = page.locator(f".fc-event[data-reservation-id='{mine.pk}']").bounding_box()
    assert abs(box["height"] - 5 * lane["height"]) < lane["height"] / 2, (box, lane)


def test_time_beyond_the_booking_horizon_is_shaded_as_not_bookable(world, live_server, new_page, sign_in, settings):
    """Free capacity was shaded past the booking horizon, as if those slots could be booked."""
    from django.utils import timezone

    settings.PORTAL_BOOKING_HORIZON_DAYS = 2
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=timeGridWeek&date={timezone.localdate().isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    beyond = page.locator(".fc-bg-event.not-bookable-horizon")
    expect(beyond.first).to_be_visible()
    expect(beyond.first).to_have_attribute("title", re.compile("booking horizon of 2 days"))
    expect(page.locator(".legend .sw.not-bookable")).to_be_visible()
    assert page.errors == []


def test_a_drag_across_the_past_or_beyond_the_horizon_makes_no_selection_and_says_why(
        world, live_server, new_page, sign_in, day, settings):
    """Dragging across time no booking may take (before the slot running now, beyond the booking horizon)
    still opened the booking form, whose preview then refused it. The calendar does not make such a
    selection (FullCalendar's selectAllow, by the not-bookable shading's bounds), and its status line says why."""
    settings.PORTAL_BOOKING_HORIZON_DAYS = 1  # day (two days ahead) lies wholly beyond it
    page = sign_in(new_page(), "alpha-lead")
    forms = []
    page.on("request", lambda r: forms.append(r.url) if "/reservations/new/" in r.url else None)
    open_day(page, live_server, day)
    drag(page, day, "10:00", "12:00")
    status = page.locator("#calendar-status")
    expect(status).to_contain_text("booking horizon of 1 day")
    expect(status).to_have_attribute("data-kind", "error")
    # was "Not bookable: Beyond the booking horizon of 1 days: not bookable yet." — said twice, "1 days"
    assert status.inner_text() == "Not bookable yet: beyond the booking horizon of 1 day.", status.inner_text()
    expect(page.locator(".fc-highlight, .fc-event-mirror")).to_have_count(0)
    yesterday = day - timedelta(days=3)
    open_day(page, live_server, yesterday)
    drag(page, yesterday, "10:00", "12:00")
    expect(page.locator("#calendar-status")).to_contain_text("past")
    # was "Not bookable: Past: a booking starts at the slot running now at the earliest."
    assert status.inner_text() == ("Not bookable: this time is past; a booking starts at the slot running now "
                                   "at the earliest."), status.inner_text()
    expect(page.locator("#booking-form")).to_have_count(0)
    assert forms == []
    # Bookable time still opens the form.
    settings.PORTAL_BOOKING_HORIZON_DAYS = 365
    open_day(page, live_server, day)
    drag(page, day, "10:00", "12:00")
    expect(page.locator("#booking-form")).to_be_visible()
    assert page.errors == []


def test_a_moved_booking_is_reported_with_its_zone(world, live_server, new_page, sign_in, day):
    """After a drag the status line said "Reservation #64 moved: Wed 9 Dec, 12:00 – Wed 9 Dec, 13:00." with
    no zone, where every other time on the pages names it ("12:00 CET")."""
    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    page = sign_in(new_page(tz="Europe/Berlin"), "alpha-member")
    open_day(page, live_server, day)
    event = page.locator(f".fc-event[data-reservation-id='{mine.pk}']")
    box = event.bounding_box()
    lane = page.locator("td.fc-timegrid-slot-lane").first.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + 8
    with page.expect_response(lambda r: f"/api/v1/reservations/{mine.pk}/" in r.url
                              and r.request.method == "PATCH") as answer:
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x, y + lane["height"], steps=4)
        page.mouse.move(x, y + lane["height"] * 2, steps=4)
        page.mouse.up()
    assert answer.value.status == 200, answer.value.text()
    mine.refresh_from_db()
    expect(page.locator("#calendar-status")).to_contain_text("moved")
    status = page.locator("#calendar-status").inner_text()
    zone = mine.start.astimezone(berlin).strftime("%Z")  # CET (CEST in summer)
    assert f"{mine.start.astimezone(berlin):%H:%M} {zone}" in status, status
    assert f"{mine.end.astimezone(berlin):%H:%M} {zone}" in status, status
