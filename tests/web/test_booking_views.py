"""The htmx booking form and its live preview; they call the booking service and never bypass it."""

from __future__ import annotations

import re
import zoneinfo
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from portal.core.exceptions import QuotaExceeded
from reservations import selectors, services
from reservations.forms import parse_zoned
from reservations.models import Reservation
from tests.conftest import iso, next_fall_back

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def _data(world, t0, **over):
    data = {"tenant": "alpha", "pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=2)),
            "name": "web run", "orchestrator": "kubernetes", "cuda_version": "12.6"}
    data.update(over)
    return data


def test_form_is_prefilled_from_a_calendar_selection_in_the_users_zone(world, web, t0):
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Europe/Berlin"})
    page = client.get("/reservations/new/", {"start": iso(t0), "end": iso(t0 + timedelta(hours=3)), "pool": "h100"},
                      **HTMX).content.decode()
    local = t0.astimezone(zoneinfo.ZoneInfo("Europe/Berlin"))
    assert f'value="{local:%Y-%m-%dT%H:%M}"' in page
    assert '<label for="id_start">Start <span class="muted">(Europe/Berlin)</span></label>' in page
    assert "<html" not in page  # an htmx request gets the fragment only
    assert "<html" in client.get("/reservations/new/").content.decode()  # a plain request gets the page


def test_booking_through_the_form_uses_the_service(world, web, t0):
    response = web("alpha-member").post("/reservations/new/", _data(world, t0), **HTMX)
    assert response.status_code == 200
    r = Reservation.objects.get(name="web run")
    assert (r.tenant.slug, r.node_count, r.start, r.end) == ("alpha", 1, t0, t0 + timedelta(hours=2))
    assert (r.orchestrator, r.cuda_version, r.created_by) == ("kubernetes", "12.6", world.users["alpha-member"])
    assert f"Booked #{r.pk}" in response.content.decode()
    assert "reservation-changed" in response["HX-Trigger"]
    # Without htmx: post/redirect/get to the reservation page.
    response = web("alpha-lead").post("/reservations/new/", _data(world, t0, name="plain"))
    plain = Reservation.objects.get(name="plain")
    assert response.status_code == 302 and response["Location"] == f"/reservations/{plain.pk}/"


@pytest.mark.parametrize("on", ["t0", "fall-back day"])
def test_local_wall_clock_input_is_converted_to_utc(world, web, t0, settings, on):
    """Noon New York time, typed as the form's wall-clock fields, is booked as its UTC instant. The window was
    t0's own hour in New York: run at 05:00 or 06:00 UTC the day before New York's clocks went back (or 06:00
    before they went forward) t0 fell in the repeated (or skipped) hour, the typed time was refused as
    ambiguous, and the test failed. Noon is never in a clock change, on that day or any other."""
    ny = zoneinfo.ZoneInfo("America/New_York")
    if on == "t0":
        day = t0.astimezone(ny).date()  # t0 is a day ahead: noon that day is at least half a day ahead
    else:
        settings.PORTAL_BOOKING_HORIZON_DAYS = 400  # the next fall-back day may be a year and a few days away
        day = next_fall_back(ny)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "America/New_York"})
    start_local = datetime(day.year, day.month, day.day, 12, tzinfo=ny)
    client.post("/reservations/new/", _data(world, t0, start=f"{start_local:%Y-%m-%dT%H:%M}",
                                             end=f"{start_local + timedelta(hours=1):%Y-%m-%dT%H:%M}", name="ny"))
    r = Reservation.objects.get(name="ny")
    assert (r.start, r.end) == (start_local.astimezone(UTC), start_local.astimezone(UTC) + timedelta(hours=1))


def test_a_capacity_refusal_gives_its_window_as_the_rest_of_the_page_does(world, web, book, t0):
    """The page's refusal said "from 2026-12-11 09:00 CET to ..." where every other time on it reads
    "Fri 11 Dec 09:00 CET". It uses the UI's format in the reader's zone; the API keeps its UTC text."""
    book("beta-lead", t0, nodes=4, hours=4)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Europe/Berlin"})
    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    lo, hi = t0.astimezone(berlin), (t0 + timedelta(hours=2)).astimezone(berlin)
    page = client.post("/reservations/new/", _data(world, t0), **HTMX).content.decode()
    assert (f"Only 0 of 4 available h100 nodes are free from {lo:%a} {lo.day} {lo:%b %H:%M %Z} "
            f"to {hi:%a} {hi.day} {hi:%b %H:%M %Z}; 1 requested.") in page
    response = client.post("/api/v1/reservations/", {"tenant": "alpha", "pool": "h100", "node_count": 1,
                                                     "start": iso(t0), "end": iso(t0 + timedelta(hours=2))},
                           content_type="application/json")
    assert response.status_code == 409
    assert response.json()["detail"] == (f"Only 0 of 4 available h100 nodes are free from {t0:%Y-%m-%d %H:%M}Z to "
                                         f"{t0 + timedelta(hours=2):%Y-%m-%d %H:%M}Z; 1 requested.")


def test_conflict_shows_suggestions_that_each_book_their_window(world, web, book, t0):
    book("beta-lead", t0, nodes=3, hours=4)
    book("beta-member", t0, nodes=1, hours=4)
    client = web("alpha-lead")
    page = client.post("/reservations/new/", _data(world, t0, name="wanted"), **HTMX).content.decode()
    assert "Only 0 of 4" in page and not Reservation.objects.filter(name="wanted").exists()
    later = iso(t0 + timedelta(hours=4))
    assert f'data-start="{later}"' in page and "Nearest windows with 1 free node" in page
    # A suggestion button is its own form carrying every field; posting it books that window.
    response = client.post("/reservations/new/", _data(world, t0, name="wanted", start=later,
                                                       end=iso(t0 + timedelta(hours=6))), **HTMX)
    assert "Booked #" in response.content.decode()
    r = Reservation.objects.get(name="wanted")
    assert (r.start, r.end) == (t0 + timedelta(hours=4), t0 + timedelta(hours=6))


def test_service_refusals_are_shown_next_to_the_fields(world, web, t0):
    client = web("alpha-lead")
    page = client.post("/reservations/new/", _data(world, t0, start=iso(t0 + timedelta(minutes=30))),
                       **HTMX).content.decode()
    assert "slot grid" in page  # the service's InvalidInput, under the Start field
    page = client.post("/reservations/new/", _data(world, t0, node_count=5), **HTMX).content.decode()
    assert "only 4 nodes" in page
    page = client.post("/reservations/new/", _data(world, t0, end=iso(t0 - timedelta(hours=1))),
                       **HTMX).content.decode()
    assert "Must be after the start." in page
    assert Reservation.objects.count() == 0


def test_quota_refusal_is_shown_and_nothing_is_stored(world, web, book, t0):
    book("alpha-lead", t0, nodes=3, hours=2)
    page = web("alpha-lead").post("/reservations/new/", _data(world, t0, node_count=2), **HTMX).content.decode()
    assert "exceeds the limit of 4" in page
    assert Reservation.objects.count() == 1


def test_viewers_and_foreign_tenants_cannot_book(world, web, t0):
    assert web("alpha-viewer").post("/reservations/new/", _data(world, t0)).status_code == 403
    assert web("alpha-viewer").get("/reservations/new/").status_code == 403
    assert web("alpha-viewer").post("/reservations/preview/", _data(world, t0)).status_code == 403
    # alpha's lead naming beta in the hidden field: not one of their tenants, so not a valid choice.
    page = web("alpha-lead").post("/reservations/new/", _data(world, t0, tenant="beta"), **HTMX).content.decode()
    assert "Select a valid choice" in page
    assert Reservation.objects.count() == 0


def test_preview_shows_free_nodes_quota_billing_and_burst_cost(world, web, book, t0):
    client = web("alpha-lead")
    page = client.post("/reservations/preview/", _data(world, t0, node_count=2)).content.decode()
    assert "4 of 4 available h100 nodes" in page and "2 of 3 guaranteed + 1 burst" in page
    assert "Committed" in page and "Burst cost" not in page
    book("alpha-member", t0, nodes=2, hours=2)
    page = client.post("/reservations/preview/", _data(world, t0, node_count=2)).content.decode()
    # 2 held + 2 asked = 4: one node above the guarantee of 3, for 2 h × 8 GPUs at 2.50.
    assert "2 of 4 available" in page and "4 of 3 guaranteed + 1 burst" in page
    assert "1 node above the guarantee" in page
    assert "<strong>40.00</strong> = 16.00 GPU-hours × 2.50 per GPU-hour" in page
    page = client.post("/reservations/preview/", _data(world, t0, node_count=3)).content.decode()
    assert "You would hold up to 5 nodes at once; your limit is 4 (3 guaranteed + 1 burst): 1 over." in page
    assert "Only 2 of 4" in page and 'class="preview bad"' in page
    page = client.post("/reservations/preview/", _data(world, t0, start="", end="")).content.decode()
    assert "Fill in pool, nodes, start and end" in page


def test_an_over_quota_preview_says_the_peak_the_limit_and_how_far_over(world, web, book, t0):
    """The quota line read "5 of 3 guaranteed + 1 burst" over the limit: a reader had to work out what the
    numbers meant. It says what the tenant would hold, its limit and by how much it is over."""
    book("alpha-member", t0, nodes=3, hours=2)
    page = web("alpha-lead").post("/reservations/preview/", _data(world, t0, node_count=2)).content.decode()
    assert ("You would hold up to 5 nodes at once; your limit is 4 (3 guaranteed + 1 burst): 1 over."
            in page)
    assert "5 of 3 guaranteed" not in page


def test_an_over_quota_preview_states_the_quota_fact_once(world, web, book, t0):
    """Over the limit, the preview showed the plain sentence in the quota row and, below it, the older
    problem line "Over quota: up to 3 already held, 2 more exceeds 4." saying the same thing again in
    harder words. The quota fact is stated once, as the plain sentence; the preview is still marked bad."""
    book("alpha-member", t0, nodes=3, hours=2)
    page = web("alpha-lead").post("/reservations/preview/", _data(world, t0, node_count=2)).content.decode()
    sentence = "You would hold up to 5 nodes at once; your limit is 4 (3 guaranteed + 1 burst): 1 over."
    assert page.count(sentence) == 1
    assert "Over quota" not in page and "exceeds" not in page
    assert 'class="preview bad"' in page


def test_the_over_quota_sentence_counts_in_words(world, t0):
    pool = world.pool
    preview = selectors.BookingPreview(pool=pool, node_count=1, start=t0, end=t0 + timedelta(hours=1),
                                       available_nodes=4, free_nodes=4, has_quota=True, max_nodes=0,
                                       burst_nodes=2, burst_enabled=False)
    assert preview.over_limit_text == "You would hold up to 1 node at once; your limit is 0 (0 guaranteed): 1 over."
    within = selectors.BookingPreview(pool=pool, node_count=1, start=t0, end=t0 + timedelta(hours=1),
                                      available_nodes=4, free_nodes=4, has_quota=True, max_nodes=1)
    assert within.over_limit_text == ""


def test_preview_counts_a_maintenance_window_as_taking_its_node(world, web, t0):
    """The preview left out allocations without a reservation (maintenance windows): it said every
    node was free while the booking itself was refused for want of them."""
    for node in world.nodes[:3]:
        services.maintenance_window_create(actor=world.users["staff"], node=node, start=t0,
                                           end=t0 + timedelta(hours=2), note="firmware")
    page = web("alpha-lead").post("/reservations/preview/", _data(world, t0, node_count=2)).content.decode()
    assert "1 of 4 available h100 nodes" in page and "Only 1 of 4" in page
    preview = selectors.booking_preview(tenant=world.tenants["alpha"], pool=world.pool, node_count=1, start=t0,
                                        end=t0 + timedelta(hours=2), exclude_reservation_id=12345)
    assert preview.free_nodes == 1


@pytest.mark.parametrize("held,asked,burst_enabled", [(0, 1, True), (2, 1, True), (3, 1, True), (3, 1, False),
                                                      (2, 2, True), (0, 3, True)])
def test_preview_billing_agrees_with_the_booking_service(world, book, t0, held, asked, burst_enabled):
    alpha = world.tenants["alpha"]
    alpha.burst_enabled = burst_enabled
    alpha.save()
    if held:
        book("alpha-lead", t0, nodes=held)
    preview = selectors.booking_preview(tenant=alpha, pool=world.pool, node_count=asked, start=t0,
                                        end=t0 + timedelta(hours=2))
    try:
        r = services.reservation_create(actor=world.users["alpha-lead"], tenant=alpha, pool=world.pool,
                                        node_count=asked, start=t0, end=t0 + timedelta(hours=2))
    except QuotaExceeded:
        assert preview.billing is None and preview.over_limit_text and not preview.ok
    else:
        assert preview.billing == r.billing and preview.ok
        if r.billing == "burst":
            assert preview.burst_cost == Decimal(preview.burst_part_nodes * 8 * 2) * Decimal("2.5")


def test_zoned_parsing_refuses_times_a_dst_change_skips_or_repeats():
    ny = zoneinfo.ZoneInfo("America/New_York")
    assert parse_zoned("2027-03-14T01:00", ny) == datetime(2027, 3, 14, 6, tzinfo=UTC)
    assert parse_zoned("2027-03-14T03:00", ny) == datetime(2027, 3, 14, 7, tzinfo=UTC)  # an hour later, real time
    with pytest.raises(ValueError, match="skipped or repeated"):
        parse_zoned("2027-03-14T02:30", ny)  # does not exist
    with pytest.raises(ValueError, match="skipped or repeated"):
        parse_zoned("2027-11-07T01:30", ny)  # happens twice
    # With an offset there is no ambiguity at all.
    assert parse_zoned("2027-11-07T01:30:00-05:00", ny) == datetime(2027, 11, 7, 6, 30, tzinfo=UTC)
    assert parse_zoned("2027-11-07T06:30:00Z", ny) == datetime(2027, 11, 7, 6, 30, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_zoned("next tuesday", ny)


def test_ambiguous_local_time_is_a_form_error_not_a_guess(world, web):
    client = web("alpha-lead")
    client.post("/account/", {"tz": "America/New_York"})
    page = client.post("/reservations/new/", {
        "tenant": "alpha", "pool": "h100", "node_count": 1, "start": "2027-11-07T01:30", "end": "2027-11-07T05:00",
        "orchestrator": "slurm", "cuda_version": "12.8"}, **HTMX).content.decode()
    assert "skipped or repeated in America/New_York" in page
    assert Reservation.objects.count() == 0


def test_the_booking_form_and_its_panel_fragment_are_cached_apart(world, web, t0):
    """GET /reservations/new/ is the whole booking page, or (HX-Request) the calendar side panel's fragment:
    without Vary: HX-Request a browser's cache could hand one for the other."""
    from django.utils.cache import cc_delim_re

    client = web("alpha-lead")
    for headers in ({}, HTMX):
        response = client.get("/reservations/new/", {"pool": "h100"}, **headers)
        assert response.status_code == 200
        assert "hx-request" in {h.strip().lower() for h in cc_delim_re.split(response.get("Vary", ""))}


def test_preview_warns_of_a_window_the_service_will_refuse(world, web, t0):
    """A window in the past (a calendar selection yesterday) or beyond the booking horizon: the preview
    showed free nodes and 'Committed' on a calm blue box, and only the Book button told the truth."""
    from django.conf import settings

    client = web("alpha-lead")
    past = t0 - timedelta(days=3)
    page = client.post("/reservations/preview/", _data(world, past, end=iso(past + timedelta(hours=2)))).content
    assert b"Cannot start in the past" in page and b'class="preview bad"' in page
    far = t0 + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS + 1)
    page = client.post("/reservations/preview/", _data(world, far, end=iso(far + timedelta(hours=2)))).content
    assert b"Beyond the booking horizon" in page and b'class="preview bad"' in page
    page = client.post("/reservations/preview/", _data(world, t0)).content  # a good window: no warning
    assert b'class="preview ok"' in page and b"data-problem" not in page
    # … and the service refuses exactly what the preview warned of.
    response = client.post("/reservations/new/", _data(world, past, end=iso(past + timedelta(hours=2))), **HTMX)
    assert b"Cannot start in the past" in response.content and not Reservation.objects.exists()


def test_a_capacity_refusal_gives_the_window_in_the_readers_zone(world, web, book, t0):
    """Every time on the page is in the user's zone; the "no capacity" sentence was the one in UTC ("…Z")."""
    book("beta-lead", t0, nodes=4, hours=4)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Kolkata"})
    ist = zoneinfo.ZoneInfo("Asia/Kolkata")
    start_local = t0.astimezone(ist)
    page = client.post("/reservations/new/", _data(
        world, t0, name="wanted", start=f"{start_local:%Y-%m-%dT%H:%M}",
        end=f"{start_local + timedelta(hours=1):%Y-%m-%dT%H:%M}"), **HTMX).content.decode()
    lo, hi = start_local, start_local + timedelta(hours=1)  # as the page writes times: "Thu 3 Dec 22:30 IST"
    assert f"free from {lo:%a} {lo.day} {lo:%b %H:%M} IST to {hi:%a} {hi.day} {hi:%b %H:%M} IST" in page, page[:3000]
    # A time written for people in UTC ("00:00Z"), not the machine-readable values of the suggestions' hidden
    # inputs ("…T23:00:00Z", whose minutes and seconds read "00:00Z" when t0 falls at midnight).
    assert not re.search(rf"(?<![\d:]){t0:%H:%M}Z", page) and not Reservation.objects.filter(name="wanted").exists()


def test_the_booking_forms_suggestions_and_confirmation_name_the_zone_of_each_time(world, web, book, t0):
    """A suggestion said "Book Thu 3 Dec 23:00 – Fri 4 Dec 01:00 JST" and the confirmation "…, Thu 3 Dec 19:00 –
    Thu 3 Dec 21:00 JST": the start had no zone (and across a DST change it is not the end's)."""
    from tests.zoned import unzoned_times

    book("beta-lead", t0, nodes=4, hours=4)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Tokyo"})
    tokyo = zoneinfo.ZoneInfo("Asia/Tokyo")
    later = (t0 + timedelta(hours=4)).astimezone(tokyo)
    page = client.post("/reservations/new/", _data(world, t0, name="wanted"), **HTMX).content.decode()
    assert f"Book {later:%a %-d %b %H:%M} JST – " in page, page[:3000]
    assert not unzoned_times(page), unzoned_times(page)
    window = {"start": f"{later:%Y-%m-%dT%H:%M}", "end": f"{later + timedelta(hours=2):%Y-%m-%dT%H:%M}"}
    done = client.post("/reservations/new/", _data(world, t0, name="wanted", **window), **HTMX).content.decode()
    assert f"{later:%a %-d %b %H:%M} JST – {later + timedelta(hours=2):%a %-d %b %H:%M} JST" in done, done
    assert not unzoned_times(done), unzoned_times(done)


def test_quota_refusal_counts_one_node_in_the_singular(world, web, book, t0):
    """With one node held the refusal read "alpha already holds up to 1 h100 nodes in that window"."""
    book("alpha-lead", t0, nodes=1, hours=2)
    page = web("alpha-lead").post("/reservations/new/", _data(world, t0, node_count=4), **HTMX).content.decode()
    assert "already holds up to 1 h100 node in that window; 4 more exceeds the limit of 4" in page, page
    assert Reservation.objects.count() == 1


def test_quota_refusal_with_nothing_held_and_no_burst_says_just_the_limit(world, web, t0):
    """In a pool without burst, asking for too many nodes with none held read "alpha already holds up to 0
    h100 nodes in that window; 3 more exceeds the limit of 2 (2 guaranteed + 0 burst).": nothing held, and a
    burst of nothing, spelled out."""
    world.tenants["alpha"].quotas.filter(pool=world.pool).update(max_nodes=2, burst_nodes=0)
    page = web("alpha-lead").post("/reservations/new/", _data(world, t0, node_count=3), **HTMX).content.decode()
    assert "3 h100 nodes exceed alpha&#x27;s limit of 2." in page, page
    assert "holds up to 0" not in page and "+ 0 burst" not in page
    assert Reservation.objects.count() == 0
