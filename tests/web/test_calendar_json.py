"""The calendar's JSON feeds: tenant scope, edit rights per role, and a constant number of queries."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from reservations import services
from reservations.timeutil import slot_floor
from tests.conftest import iso, now_clear_of_the_hour

pytestmark = pytest.mark.django_db


def _window(t0, days=3):
    return {"start": iso(t0 - timedelta(days=1)), "end": iso(t0 + timedelta(days=days))}


def test_events_are_the_current_tenants_only(world, web, book, t0):
    mine = book("alpha-lead", t0, name="alpha-run")
    theirs = book("beta-lead", t0, name="beta-secret")
    events = web("alpha-member").get("/calendar/events.json", _window(t0)).json()
    assert [e["id"] for e in events] == [str(mine.pk)]
    assert "beta-secret" not in str(events)
    assert events[0]["start"] == iso(mine.start) and events[0]["end"] == iso(mine.end)
    staff_events = web("staff").get("/calendar/events.json", _window(t0)).json()
    assert [e["id"] for e in staff_events] == [str(mine.pk)]  # staff see the tenant they are working as
    assert str(theirs.pk) not in [e["id"] for e in staff_events]


def test_edit_rights_follow_the_role(world, web, book, t0):
    leads = book("alpha-lead", t0)
    members = book("alpha-member", t0 + timedelta(hours=3))

    def flags(who):
        return {e["id"]: (e.get("editable", False), e.get("startEditable", False), e.get("durationEditable", False))
                for e in web(who).get("/calendar/events.json", _window(t0)).json()}

    assert flags("alpha-lead") == {str(leads.pk): (True, True, True), str(members.pk): (True, True, True)}
    assert flags("alpha-member") == {str(leads.pk): (False, False, False), str(members.pk): (True, True, True)}
    assert flags("alpha-viewer") == {str(leads.pk): (False, False, False), str(members.pk): (False, False, False)}


def test_cancelled_bookings_leave_the_calendar(world, web, book, t0):
    gone = book("alpha-lead", t0)
    services.reservation_cancel(actor=world.users["alpha-lead"], reservation=gone)
    assert web("alpha-lead").get("/calendar/events.json", _window(t0)).json() == []


def test_bad_windows_get_the_error_envelope(world, web):
    client = web("alpha-lead")
    body = client.get("/calendar/events.json", {"start": "yesterday", "end": "2030-01-01T00:00:00Z"}).json()
    assert body["code"] == "invalid" and "start" in body["fields"]
    body = client.get("/calendar/events.json", {"start": "2030-01-01T00:00:00Z", "end": "2030-06-01T00:00:00Z"})
    assert body.status_code == 400 and "end" in body.json()["fields"]
    body = client.get("/calendar/availability.json", {"start": "2030-01-01T00:00:00Z", "end": "2030-01-02T00:00Z"})
    assert body.status_code == 400 and "pool" in body.json()["fields"]


def test_naive_window_bounds_are_read_in_the_users_zone(world, web, book, t0):
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Tokyo"})  # UTC+9, no DST
    r = book("alpha-lead", t0, hours=1)
    local = (t0 + timedelta(hours=9)).replace(tzinfo=None)
    hit = client.get("/calendar/events.json", {"start": local.isoformat(), "end": (local + timedelta(hours=1))
                                               .isoformat()}).json()
    miss = client.get("/calendar/events.json", {"start": t0.replace(tzinfo=None).isoformat(),
                                                "end": (t0 + timedelta(hours=1)).replace(tzinfo=None).isoformat()})
    assert [e["id"] for e in hit] == [str(r.pk)] and miss.json() == []


def test_events_feed_uses_a_constant_number_of_queries(world, web, book, t0, django_assert_max_num_queries):
    client = web("alpha-lead")
    book("alpha-lead", t0)
    params = {**_window(t0, days=40), "pool": "h100"}
    with django_assert_max_num_queries(6) as one:
        assert len(client.get("/calendar/events.json", params).json()) == 1
    for i in range(1, 40):  # sequential one-node bookings: 40 events in the window
        book("alpha-lead" if i % 2 else "alpha-member", t0 + timedelta(hours=2 * i), hours=2)
    with django_assert_max_num_queries(6) as many:
        assert len(client.get("/calendar/events.json", params).json()) == 40
    assert len(many.captured_queries) == len(one.captured_queries)


def test_availability_feed_uses_a_constant_number_of_queries(world, web, book, django_assert_max_num_queries):
    # The window opens on the slot running now: once the hour rolls over, that slot is shaded as past (with a
    # reason and a hint) and the plain shape asserted below no longer holds. Start clear of the hour's end.
    t0 = slot_floor(now_clear_of_the_hour(120), 60) + timedelta(days=1)
    client = web("alpha-viewer")
    book("alpha-lead", t0)
    for granularity in ("slot", "day"):
        params = {**_window(t0, days=20), "pool": "h100", "granularity": granularity}
        with django_assert_max_num_queries(6) as one:
            client.get("/calendar/availability.json", params)
        for i in range(1, 30):
            book("beta-lead" if i % 2 else "alpha-lead", t0 + timedelta(days=i // 2, hours=(i % 2) * 3 + 100))
        with django_assert_max_num_queries(6) as many:
            body = client.get("/calendar/availability.json", params).json()
        assert len(many.captured_queries) == len(one.captured_queries)
        assert all(e["display"] == "background" and set(e["extendedProps"]) == {"free", "total", "availability"}
                   for e in body)


def test_availability_shading_matches_the_selector(world, web, book, t0):
    book("beta-lead", t0, nodes=3, hours=2)
    body = web("alpha-lead").get("/calendar/availability.json",
                                 {"pool": "h100", "start": iso(t0), "end": iso(t0 + timedelta(hours=4))}).json()
    assert [(e["start"], e["end"], e["extendedProps"]["free"]) for e in body] == [
        (iso(t0), iso(t0 + timedelta(hours=2)), 1),
        (iso(t0 + timedelta(hours=2)), iso(t0 + timedelta(hours=4)), 4),
    ]
    assert "beta" not in str(body)


def test_availability_shows_the_past_and_beyond_the_horizon_as_not_bookable(world, web, book, t0, settings):
    # Free capacity used to be shaded past the booking horizon (and before the slot running now): those slots
    # looked bookable, but the booking form's preview and the service refuse them. They are shaded as not
    # bookable (no free nodes, their own class and a hint), exactly where the service's rule says.
    settings.PORTAL_BOOKING_HORIZON_DAYS = 2
    # The page draws "past" up to the slot running now and the horizon from its own clock: an hour that rolled
    # over between this now and the requests moved both a slot away from what is asserted below.
    now = now_clear_of_the_hour()
    horizon = now + timedelta(days=2)
    client = web("alpha-lead")
    params = {"pool": "h100", "start": iso(t0 - timedelta(days=2)), "end": iso(t0 + timedelta(days=3))}
    body = client.get("/calendar/availability.json", params).json()
    assert [e["start"] for e in body[1:]] == [e["end"] for e in body[:-1]]  # the window, without gaps
    assert body[0]["start"] <= iso(t0 - timedelta(days=2)) and body[-1]["end"] >= iso(t0 + timedelta(days=3))
    bookable_seen = {True: 0, False: 0}
    for e in body:
        start, end = datetime.fromisoformat(e["start"]), datetime.fromisoformat(e["end"])
        refused = services.booking_window_problems(pool=world.pool, start=start, end=end)
        bookable = e["extendedProps"].get("bookable", True)
        bookable_seen[bookable] += 1
        assert bookable == (not refused), (e, refused)
        if not bookable:
            assert e["extendedProps"]["free"] == 0 and "not-bookable" in e["classNames"], e
            assert e["extendedProps"]["hint"]
            # Not even its first slot can be booked: the shading never shows a bookable slot as refused.
            first = start + timedelta(hours=1)
            assert services.booking_window_problems(pool=world.pool, start=start, end=first), e
    assert bookable_seen[True] and bookable_seen[False] >= 2
    past = [e for e in body if e["extendedProps"].get("reason") == "past"]
    beyond = [e for e in body if e["extendedProps"].get("reason") == "horizon"]
    assert past and past[-1]["end"] == iso(slot_floor(now, 60))
    assert beyond and beyond[0]["start"] == iso(slot_floor(horizon, 60))
    assert "horizon" in beyond[0]["extendedProps"]["hint"]
    # Per day (the month view): a day wholly beyond the horizon, or wholly past, is not bookable either.
    body = client.get("/calendar/availability.json", {**params, "granularity": "day"}).json()
    by_day = {e["start"]: e for e in body}
    tz = timezone.get_current_timezone()
    far = (horizon + timedelta(days=1)).astimezone(tz).date().isoformat()
    gone = (now - timedelta(days=1)).astimezone(tz).date().isoformat()
    today = now.astimezone(tz).date().isoformat()
    assert by_day[far]["extendedProps"]["reason"] == "horizon" and by_day[far]["extendedProps"]["free"] == 0
    assert by_day[gone]["extendedProps"]["reason"] == "past"
    assert by_day[today]["extendedProps"].get("bookable", True) and by_day[today]["extendedProps"]["free"] == 4
