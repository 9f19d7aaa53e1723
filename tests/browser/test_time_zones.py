"""Times are stored in UTC and shown in the user's zone, across daylight-saving changes."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from reservations import services
from reservations.models import Pool

from .conftest import drag, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

NEW_YORK = zoneinfo.ZoneInfo("America/New_York")
BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")


def next_dst_change(tz: zoneinfo.ZoneInfo):
    """Return the first local day after tomorrow whose UTC offset differs from the day before's."""
    day = timezone.now().astimezone(tz).date() + timedelta(days=2)
    for _ in range(400):
        a = datetime(day.year, day.month, day.day, tzinfo=tz).utcoffset()
        nxt = day + timedelta(days=1)
        b = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz).utcoffset()
        if a != b:
            return day
        day = nxt
    raise AssertionError("no DST change within a year")


def test_booking_in_the_browsers_zone_is_stored_in_utc(world, live_server, new_page, sign_in, day):
    page = sign_in(new_page(tz="Europe/Berlin"), "alpha-lead")
    expect(page.locator("footer")).to_contain_text("Europe/Berlin")  # picked up from the browser at sign-in
    open_day(page, live_server, day)
    drag(page, day, "10:00", "10:00")
    expect(page.get_by_label("Start (Europe/Berlin)")).to_have_value(f"{day.isoformat()}T10:00")
    page.get_by_role("button", name="Book", exact=True).click()
    done = page.locator("#side-panel [data-reservation-id]")
    expect(done).to_contain_text("Booked #")
    body = page.request.get(f"{live_server.url}/api/v1/reservations/{done.get_attribute('data-reservation-id')}/")
    expected = datetime(day.year, day.month, day.day, 10, tzinfo=BERLIN).astimezone(UTC)
    assert body.json()["start"] == expected.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_booking_across_a_dst_change_shows_true_local_times(world, live_server, new_page, sign_in):
    change = next_dst_change(NEW_YORK)
    # 00:00 to 05:00 New York wall-clock time on the day the clocks change: 4 or 6 real hours.
    start = datetime(change.year, change.month, change.day, 0, tzinfo=NEW_YORK)
    end = datetime(change.year, change.month, change.day, 5, tzinfo=NEW_YORK)
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=world.pool, node_count=1, start=start.astimezone(UTC),
                                    end=end.astimezone(UTC), name="over-the-change")
    assert (r.end - r.start) in (timedelta(hours=4), timedelta(hours=6))
    page = sign_in(new_page(tz="America/New_York"), "alpha-lead")
    open_day(page, live_server, change)
    event = page.locator(f".fc-event[data-reservation-id='{r.pk}']")
    expect(event.locator(".fc-event-time")).to_have_text("00:00 - 05:00")

    page.goto(f"{live_server.url}/reservations/{r.pk}/")
    facts = page.locator("dl.facts").first
    zones = {start.strftime("%Z"), end.strftime("%Z")}
    assert zones == {"EST", "EDT"}
    expect(facts).to_contain_text(f"00:00 {start:%Z}")
    expect(facts).to_contain_text(f"05:00 {end:%Z}")


def test_the_slot_grid_follows_the_zones_offset_on_the_day_shown(world, live_server, new_page, sign_in):
    """A 2-hour pool's slots run from the UTC epoch: 01:00, 03:00 … Berlin time in winter (+01:00) and
    00:00, 02:00 … in summer (+02:00). The calendar laid its grid for the day it opened on only, so
    after paging across the clocks' change every slot it offered was an hour off the pool's grid: a
    drag gave an unaligned start and the booking was refused."""
    Pool.objects.filter(pk=world.pool.pk).update(slot_minutes=120)
    change = next_dst_change(BERLIN)
    after = change + timedelta(days=3)  # well past the change: a day whose offset differs from today's
    expected = datetime(after.year, after.month, after.day, 12, tzinfo=BERLIN).utcoffset()
    first_slot = f"{(expected.seconds // 60) % 120 // 60:02d}:00"
    page = sign_in(new_page(tz="Europe/Berlin"), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=timeGridDay&pool=h100")  # opens on today
    page.wait_for_selector("#calendar[data-ready='1']")
    page.evaluate("d => window.portalCalendar.gotoDate(d)", after.isoformat())  # what paging with › does
    expect(page.locator(f".fc-timegrid-col[data-date='{after.isoformat()}']")).to_be_visible()
    expect(page.locator("td.fc-timegrid-slot-lane").first).to_have_attribute("data-time", f"{first_slot}:00")
    slot = int(first_slot[:2])
    drag(page, after, f"{slot + 8:02d}:00", f"{slot + 8:02d}:00")
    expect(page.get_by_label("Start (Europe/Berlin)")).to_have_value(f"{after.isoformat()}T{slot + 8:02d}:00")
    page.get_by_role("button", name="Book", exact=True).click()
    expect(page.locator("#side-panel [data-reservation-id]")).to_contain_text("Booked #")
