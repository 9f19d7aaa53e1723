"""Time on the browser pages for pools whose slots are not whole local hours (found in a review): the
availability shown and the windows offered follow the pool's own slot grid, whatever the user's zone
(+05:30) or the slot length (90 minutes, a day)."""
from __future__ import annotations

import re
import zoneinfo
from datetime import UTC, date, datetime, timedelta

import pytest

from reservations import services
from reservations.models import Node, Pool, Reservation
from reservations.selectors import Slot
from reservations.timeutil import slot_floor
from reservations.views import heatmap_rows
from tenants.models import Quota
from tests.conftest import iso, next_fall_back

pytestmark = pytest.mark.django_db
HTMX = {"HTTP_HX_REQUEST": "true"}
KOLKATA = zoneinfo.ZoneInfo("Asia/Kolkata")
NY = zoneinfo.ZoneInfo("America/New_York")


def _pool(world, name, slot):
    pool = Pool.objects.create(name=name, gpu_model="X", gpus_per_node=8, slot_minutes=slot)
    for i in range(2):
        Node.objects.create(hostname=f"{name}-{i}", pool=pool)
    Quota.objects.create(tenant=world.tenants["alpha"], pool=pool, max_nodes=2)
    return pool


def test_heatmap_90_minute_pool_has_no_dst_repeat_on_an_ordinary_utc_day():
    start = datetime(2027, 1, 5, tzinfo=UTC)
    step = timedelta(minutes=90)
    slots = [Slot(start=start + i * step, end=start + (i + 1) * step, free_nodes=i % 3) for i in range(16)]
    rows = heatmap_rows(slots=slots, tz=UTC, first_day=date(2027, 1, 5), days=1,
                        now=datetime(2000, 1, 1, tzinfo=UTC), total=4)
    twice = [h for h, c in enumerate(rows[0]["cells"]) if c and c["twice"]]
    assert twice == []  # was [1, 4, 7, …, 22]: "occurs twice: DST"


@pytest.mark.parametrize("slot", [90, 1440])
def test_default_booking_window_is_bookable(world, web, slot):
    pool = _pool(world, f"p{slot}", slot)
    client = web("alpha-lead")
    page = client.get("/reservations/new/", {"pool": pool.name}, **HTMX).content.decode()
    start = re.search(r'name="start" value="([^"]+)"', page).group(1)
    end = re.search(r'name="end" value="([^"]+)"', page).group(1)
    r = client.post("/reservations/new/", {"tenant": "alpha", "pool": pool.name, "node_count": 1, "start": start,
                                           "end": end, "orchestrator": "slurm", "cuda_version": "12.8",
                                           "name": "dflt"}, **HTMX)
    body = r.content.decode()
    assert Reservation.objects.filter(name="dflt").exists(), re.findall(r"slot grid[^<]*", body)


def test_calendar_availability_in_kolkata_follows_the_pool_slots(world, web, t0):
    for lead in ("alpha-lead",):
        services.reservation_create(actor=world.users[lead], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=4, start=t0, end=t0 + timedelta(hours=1), name="full")
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Kolkata"})
    day = t0.astimezone(KOLKATA).date()
    lo = datetime.combine(day, datetime.min.time(), tzinfo=KOLKATA)  # what FullCalendar sends
    events = client.get("/calendar/availability.json", {"pool": "h100", "start": lo.isoformat(),
                                                        "end": (lo + timedelta(days=1)).isoformat()}).json()
    busy = [(e["start"], e["end"]) for e in events if e["extendedProps"]["free"] == 0]
    # one fully booked slot [t0, t0+1h): shaded as that one slot, not as two half-filled local hours
    assert busy == [(iso(t0), iso(t0 + timedelta(hours=1)))]


def test_heatmap_in_kolkata_shows_one_full_hour_for_one_full_slot(world, web, t0):
    services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=4, start=t0, end=t0 + timedelta(hours=1), name="full")
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Kolkata"})
    page = client.get("/availability/").content.decode()
    # The booked UTC hour covers the second half of one IST hour and the first half of the next: both
    # local hours show 0 free (each is full for part of its span), and no other hour does.
    assert page.count('data-free="0"') == 2
    for t in (t0, t0 + timedelta(minutes=59)):
        local = t.astimezone(KOLKATA)
        assert f'title="{local:%a %-d %b} {local:%H}:00 IST: 0 of 4 free"' in page or \
            f'{local:%H}:00 IST: 0 of 4 free' in page


def test_daily_pool_heatmap_in_new_york_shows_one_full_day_for_one_booked_day(world, web):
    from django.utils import timezone
    pool = _pool(world, "d1440", 1440)
    T = slot_floor(timezone.now(), 1440) + timedelta(days=2)
    services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=pool,
                                node_count=2, start=T, end=T + timedelta(days=1), name="day")
    client = web("alpha-lead")
    client.post("/account/", {"tz": "America/New_York"})
    page = client.get("/availability/").content.decode()
    section = page.split('data-pool="d1440"')[1].split("data-pool=")[0]
    assert section.count('data-free="0"') == 24  # one UTC day = 24 hours; was 48



def test_calendar_selection_in_the_repeated_hour_can_be_booked(world, web, settings):
    settings.PORTAL_BOOKING_HORIZON_DAYS = 400  # the next fall-back day may be a year and a few days away
    day = next_fall_back(NY)  # New York's next fall-back day: 01:00-02:00 happens twice
    client = web("alpha-lead")
    client.post("/account/", {"tz": "America/New_York"})
    start, end = f"{day}T01:00:00-05:00", f"{day}T02:00:00-05:00"  # the second 01:00, as FullCalendar sends
    page = client.get("/reservations/new/", {"pool": "h100", "start": start, "end": end}, **HTMX).content.decode()
    shown = {m.group(1): m.group(2) for m in re.finditer(r'name="(start|end|start_offset|end_offset)" value="([^"]+)"',
                                                         page)}
    assert shown["start"] == f"{day}T01:00" and shown["start_offset"] == "-05:00"
    r = client.post("/reservations/new/", {"tenant": "alpha", "pool": "h100", "node_count": 1, **shown,
                                           "orchestrator": "slurm", "cuda_version": "12.8", "name": "fold"}, **HTMX)
    booked = Reservation.objects.get(name="fold")  # the second 01:00 (EST), as the calendar sent it
    assert booked.period.lower == datetime(day.year, day.month, day.day, 6, tzinfo=UTC)
    assert booked.period.upper == datetime(day.year, day.month, day.day, 7, tzinfo=UTC)
    # Typed by hand, without the calendar's offset, the repeated hour is still refused, not guessed.
    r = client.post("/reservations/new/", {"tenant": "alpha", "pool": "h100", "node_count": 1,
                                           "start": f"{day}T01:00", "end": f"{day}T01:30",
                                           "orchestrator": "slurm", "cuda_version": "12.8", "name": "typed"}, **HTMX)
    assert "skipped or repeated" in r.content.decode() and not Reservation.objects.filter(name="typed").exists()
