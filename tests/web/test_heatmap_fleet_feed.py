"""The 14-day heatmap, the staff fleet timeline and the per-tenant iCalendar feed."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, date, datetime, timedelta

import pytest
from django.utils import timezone
from icalendar import Calendar

from reservations import services
from reservations.forms import FleetWindowForm
from reservations.models import Node, Pool
from reservations.selectors import Slot
from reservations.views import heatmap_rows
from tests.conftest import iso

pytestmark = pytest.mark.django_db

NY = zoneinfo.ZoneInfo("America/New_York")


def test_heatmap_covers_every_pool_for_14_days_and_polls(world, web, book, t0):
    book("beta-lead", t0, nodes=3)
    page = web("alpha-viewer").get("/availability/").content.decode()
    assert 'data-pool="h100"' in page and "4 available nodes" in page
    assert page.count("<th scope=\"row\">") == 14
    assert 'hx-get="/availability/grid/?refresh=30"' in page and 'hx-trigger="every 30s"' in page
    assert 'data-free="1"' in page  # beta's 3 nodes are busy in some hour: aggregated, not attributed
    assert "beta" not in page.split("<main")[1]
    grid = web("alpha-viewer").get("/availability/grid/", HTTP_HX_REQUEST="true").content.decode()
    assert grid.startswith('<div id="heatmap"') and "<html" not in grid


def _slots(start_local: datetime, hours: int) -> list[Slot]:
    start = start_local.astimezone(UTC)
    return [Slot(start=start + timedelta(hours=i), end=start + timedelta(hours=i + 1), free_nodes=i % 5)
            for i in range(hours)]


def test_heatmap_rows_are_dst_safe():
    now = datetime(2000, 1, 1, tzinfo=UTC)
    # Spring forward: 2027-03-14 has 23 hours in New York; 02:00 does not exist.
    spring = date(2027, 3, 14)
    rows = heatmap_rows(slots=_slots(datetime(2027, 3, 14, tzinfo=NY), 23), tz=NY, first_day=spring, days=1,
                        now=now, total=4)
    cells = rows[0]["cells"]
    assert len(cells) == 24 and cells[2] is None and all(c is not None for i, c in enumerate(cells) if i != 2)
    assert cells[3]["start"] == datetime(2027, 3, 14, 7, tzinfo=UTC)  # 03:00 EDT
    # Fall back: 2027-11-07 has 25 hours; 01:00 happens twice and shows the lower count of the two.
    fall = date(2027, 11, 7)
    rows = heatmap_rows(slots=_slots(datetime(2027, 11, 7, tzinfo=NY), 25), tz=NY, first_day=fall, days=1,
                        now=now, total=4)
    cells = rows[0]["cells"]
    assert all(c is not None for c in cells)
    assert cells[1]["twice"] and cells[1]["free"] == min(1, 2)
    assert cells[23]["free"] == 24 % 5


def test_fleet_window_is_whole_local_days_even_across_dst():
    with timezone.override(NY):
        lo, hi = FleetWindowForm({"start": "2027-03-14", "days": "1"}).window()
        assert (lo, hi - lo) == (datetime(2027, 3, 14, 5, tzinfo=UTC), timedelta(hours=23))
        lo, hi = FleetWindowForm({"start": "2027-11-07", "days": "1"}).window()
        assert hi - lo == timedelta(hours=25)


def test_fleet_page_keeps_the_valid_filters_and_names_the_invalid_one(world, web, book, t0):
    other = Pool.objects.create(name="a100", gpu_model="A100", gpus_per_node=8)
    Node.objects.create(hostname="a100-001", pool=other)
    page = web("staff").get("/fleet/", {"start": "0999-01-01", "pool": "a100"})
    assert page.status_code == 200
    body = page.content.decode()
    assert 'data-node="a100-001"' in body and 'data-node="h100-001"' not in body  # the pool still filters
    assert "From: Must be a date between 1970 and 8999 (UTC). Showing the default instead." in body
    assert "Showing the default" not in web("staff").get("/fleet/").content.decode()
    bad_pool = web("staff").get("/fleet/", {"pool": "nope", "days": "7"}).content.decode()
    assert "Pool: " in bad_pool and 'data-node="h100-001"' in bad_pool


def test_the_fleet_pages_filter_shows_the_window_the_page_shows(world, web):
    """Opened without a query, the page showed three days from today while its Span box read "1 day" (the first
    option) and From was empty: pressing Show then changed the window to one day, unasked."""
    import re

    client = web("staff")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    body = client.get("/fleet/").content.decode()
    (selected,) = re.findall(r'<option value="(\d+)" selected>', body)
    assert selected == "3", selected
    today = timezone.now().astimezone(zoneinfo.ZoneInfo("Asia/Tokyo")).date()
    assert re.search(rf'<input type="date" name="start" value="{today.isoformat()}"', body), \
        re.findall(r'<input type="date"[^>]*>', body)
    seven = client.get("/fleet/", {"days": "7"}).content.decode()  # what was asked stays asked
    assert re.findall(r'<option value="(\d+)" selected>', seven) == ["7"]
    # … and From, left out of that query, still shows the day the window starts on (it was empty)
    assert re.search(rf'<input type="date" name="start" value="{today.isoformat()}"', seven)


@pytest.mark.parametrize("days", ["1", "3", "7", "14"])
def test_the_fleet_timelines_time_labels_do_not_run_into_each_other(world, web, days):
    """Over 7 or 14 days the head kept a label every 6 hours: at the timeline's narrowest (960 px) they ran into
    one another ("Thu 3 Dec06:0012:00…"), unreadable. Labels now sit at least their own width apart."""
    import itertools
    import re

    body = web("staff").get("/fleet/", {"days": days}).content.decode()
    head = body[body.index('class="fleet-row fleet-head"'):]
    head = head[:head.index('class="fleet-row state-')]
    ticks = [(float(left), re.sub(r"<[^>]+>", "", text).strip())
             for left, text in re.findall(r'<span class="tick[^"]*" style="left: ([\d.]+)%">(.*?)</span>', head)]
    labelled = sorted((left, text) for left, text in ticks if text)
    assert len(labelled) >= int(days), ticks  # at least every day is named
    for (left, text), (right, _) in itertools.pairwise(labelled):
        room_px = (right - left) / 100 * 960  # .fleet-inner's min-width
        assert room_px >= 7.5 * len(text), (days, text, round(room_px))  # ~7 px a character at .7rem


def test_fleet_timeline_shows_nodes_reservations_maintenance_and_state(world, web, book, t0):
    book("alpha-lead", t0, name="alpha-run")
    book("beta-lead", t0, name="beta-run")
    node = world.nodes[3]
    services.maintenance_window_create(actor=world.users["staff"], node=node, start=t0 + timedelta(hours=5),
                                       end=t0 + timedelta(hours=7), note="bios")
    services.node_update(actor=world.users["staff"], node=world.nodes[2], state="failed", reason="xid 79")
    page = web("staff").get("/fleet/", {"start": t0.date().isoformat(), "days": 3}).content.decode()
    for n in world.nodes:
        assert f'data-node="{n.hostname}"' in page
    assert 'data-tenant="alpha"' in page and 'data-tenant="beta"' in page  # staff see tenant names
    assert "alpha · alpha-run" in page and "maintenance: bios" in page
    assert 'class="fleet-row state-failed"' in page
    assert web("alpha-lead").get("/fleet/").status_code == 403


def _feed(client, tenant, world=None, who="alpha-viewer"):
    from tests.conftest import feed_path

    return client.get(feed_path(tenant, tenant.memberships.get(user__username=who).user))


def test_ical_feed_parses_has_stable_uids_and_only_the_tenants_events(world, client, book, t0):
    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-feed-secret-0123456789"
    alpha.save()
    first = book("alpha-lead", t0, nodes=2, name="pretrain, phase; 1")
    second = book("alpha-member", t0 + timedelta(hours=3))
    book("beta-lead", t0, name="beta-secret")

    response = _feed(client, alpha)  # no session: the token is the credential
    assert response.status_code == 200 and response["Content-Type"] == "text/calendar; charset=utf-8"
    assert b"beta-secret" not in response.content
    cal = Calendar.from_ical(response.content)
    events = {str(e["UID"]): e for e in cal.walk("VEVENT")}
    assert set(events) == {f"reservation-{first.pk}@gpu-portal", f"reservation-{second.pk}@gpu-portal"}
    ev = events[f"reservation-{first.pk}@gpu-portal"]
    assert ev.decoded("DTSTART") == t0 and ev.decoded("DTEND") == t0 + timedelta(hours=2)
    assert str(ev["SUMMARY"]).startswith("pretrain, phase; 1")
    assert "Nodes: h100-" in str(ev["DESCRIPTION"]) and str(ev["STATUS"]) == "CONFIRMED"
    assert b"\r\n" in response.content  # RFC 5545 line endings

    # Extending keeps the UID and raises SEQUENCE; cancelling marks the same event cancelled.
    seq_before = int(ev["SEQUENCE"])
    services.reservation_update(actor=world.users["alpha-lead"], reservation=first, end=t0 + timedelta(hours=3))
    services.reservation_cancel(actor=world.users["alpha-member"], reservation=second)
    events = {str(e["UID"]): e for e in Calendar.from_ical(_feed(client, alpha).content).walk("VEVENT")}
    ev = events[f"reservation-{first.pk}@gpu-portal"]
    assert ev.decoded("DTEND") == t0 + timedelta(hours=3) and int(ev["SEQUENCE"]) >= seq_before
    assert str(events[f"reservation-{second.pk}@gpu-portal"]["STATUS"]) == "CANCELLED"


def test_ical_feed_refuses_wrong_or_missing_tokens(world, client, book, t0):
    from tests.conftest import feed_path

    alpha, beta = world.tenants["alpha"], world.tenants["beta"]
    viewer = world.users["alpha-viewer"]
    member_id = alpha.memberships.get(user=viewer).pk
    assert client.get(f"/ical/alpha/{member_id}-{'0' * 32}.ics").status_code == 404  # no secret issued: no feed
    alpha.ical_token, beta.ical_token = "alpha-token-aaaaaaaaaaaa", "beta-token-bbbbbbbbbbbbb"
    alpha.save()
    beta.save()
    good = feed_path(alpha, viewer)
    assert client.get(good).status_code == 200
    token = good.rsplit("/", 1)[1].removesuffix(".ics")
    tampered = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert client.get(f"/ical/alpha/{tampered}.ics").status_code == 404
    assert client.get(f"/ical/beta/{token}.ics").status_code == 404  # alpha's address, beta's slug
    for junk in ("alpha-token-aaaaaaaaaaaa", "x-" + "0" * 32, f"{member_id}-short", "-" * 40, "９-" + "0" * 32):
        assert client.get(f"/ical/alpha/{junk}.ics").status_code == 404, junk
    # Another member's MAC on this member's id opens nothing either.
    lead_token = feed_path(alpha, world.users["alpha-lead"]).rsplit("/", 1)[1].removesuffix(".ics")
    assert client.get(f"/ical/alpha/{member_id}-{lead_token.split('-', 1)[1]}.ics").status_code == 404


def test_a_member_who_leaves_loses_the_feed_and_the_others_keep_theirs(world, client):
    """The feed address is personal: it dies with the membership (or the account), not the tenant's."""
    from tenants.services import membership_delete
    from tests.conftest import feed_path

    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-token-aaaaaaaaaaaa"
    alpha.save()
    leaving, staying = feed_path(alpha, world.users["alpha-member"]), feed_path(alpha, world.users["alpha-viewer"])
    assert client.get(leaving).status_code == client.get(staying).status_code == 200
    membership_delete(actor=world.users["alpha-lead"], membership=alpha.memberships.get(user__username="alpha-member"))
    assert client.get(leaving).status_code == 404
    assert client.get(staying).status_code == 200
    viewer = world.users["alpha-viewer"]
    viewer.is_active = False
    viewer.save()
    assert client.get(staying).status_code == 404


def test_dashboard_offers_each_member_their_own_feed_address(world, web):
    from tests.conftest import feed_path

    alpha = world.tenants["alpha"]
    assert b"No calendar feed" in web("alpha-lead").get("/").content
    alpha.ical_token = "alpha-token-aaaaaaaaaaaa"
    alpha.save()
    viewer_page = web("alpha-viewer").get("/").content.decode()
    assert feed_path(alpha, world.users["alpha-viewer"]) in viewer_page
    assert feed_path(alpha, world.users["alpha-lead"]) not in viewer_page
    assert alpha.ical_token not in viewer_page  # the tenant's secret itself is never shown


def test_event_times_are_sent_in_utc(world, web, book, t0):
    r = book("alpha-lead", t0)
    events = web("alpha-lead").get("/calendar/events.json", {"start": iso(t0), "end": iso(r.end)}).json()
    assert events[0]["start"].endswith("Z") and events[0]["start"] == iso(t0)


def test_heatmap_hours_in_the_past_and_beyond_the_horizon_are_not_bookable(world, web, book, t0, settings):
    # The heatmap showed free counts past the booking horizon and in the hours gone by, as if they could be
    # booked, though the service (and the calendar's shading, by services.bookable_span) refuses them. Every
    # hour cell is bookable exactly when a booking of its slot would be accepted now; the others say why.
    import re

    settings.PORTAL_BOOKING_HORIZON_DAYS = 2
    page = web("alpha-viewer").get("/availability/").content.decode()
    section = page.split('data-pool="h100"')[1]
    cells = re.findall(r"<td ([^>]*)>(.*?)</td>", section)
    seen = {"bookable": 0, "past": 0, "horizon": 0}
    for attrs, text in cells:
        if "skipped" in attrs:
            continue
        start = datetime.fromisoformat(re.search(r'data-start="([^"]+)"', attrs).group(1))
        refused = services.booking_window_problems(pool=world.pool, start=start, end=start + timedelta(hours=1))
        reason = re.search(r'data-not-bookable="(\w+)"', attrs)
        if not refused:
            seen["bookable"] += 1
            assert reason is None and re.search(r'data-free="\d"', attrs) and "not-bookable" not in attrs, attrs
            continue
        assert reason, (attrs, refused)
        seen[reason.group(1)] += 1
        assert "data-free" not in attrs and "not-bookable" in attrs, attrs  # no free count to book
        assert not re.search(r"\d", text), text
        if reason.group(1) == "horizon":
            assert "booking horizon of 2 days" in attrs and start >= timezone.now() + timedelta(days=2) - \
                timedelta(hours=1), attrs
        else:
            assert "past" in attrs and "past" in text and start < timezone.now(), attrs
    assert seen["bookable"] >= 47 and seen["horizon"] >= 11 * 24
    assert seen["past"] == timezone.now().hour  # the world's users see UTC: today's hours before this one
