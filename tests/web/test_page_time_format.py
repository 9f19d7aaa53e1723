"""Every time a page writes goes through the site's one format (portal.core.times, the ``when`` filter): the
dashboard, the reservation panel, the cancel page and the booking answer show "Sun 6 Dec 17:00 CET" in the
reader's zone, and no template spells the format out by hand (a copy that would drift when the site's changes)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings

from portal.core.times import page_time

pytestmark = pytest.mark.django_db

TEMPLATES = Path(settings.BASE_DIR) / "templates"
# A |date: format with a day and a clock time: a page time written by hand. (The admin keeps its own UTC
# formats; "H:i:s T" alone, beside a full time of the same day, is a deliberate short form.)
_HAND_WRITTEN = re.compile(r"""\|date:(["'])[^"']*[jd][^"']*[HG]:i[^"']*\1""")


def test_no_page_template_writes_a_time_in_a_format_of_its_own():
    found = [f"{path.relative_to(TEMPLATES)}: {m.group(0)}"
             for path in sorted(TEMPLATES.rglob("*.html")) if "admin" not in path.relative_to(TEMPLATES).parts
             for m in _HAND_WRITTEN.finditer(path.read_text())]
    assert not found, "use |when (portal.core.times) for a page time:\n" + "\n".join(found)


def test_pages_show_a_bookings_times_in_the_sites_format_in_the_readers_zone(world, web, book, t0):
    r = book("alpha-lead", t0, hours=3, name="format-run")
    client = web("alpha-lead")
    session = client.session
    session["portal_tz"] = "America/New_York"
    session.save()
    zone = ZoneInfo("America/New_York")
    start, end = page_time(r.start, zone), page_time(r.end, zone)
    assert re.fullmatch(r"\w{3} \d{1,2} \w{3} \d\d:\d\d E[SD]T", start), start
    for path in ("/", f"/reservations/{r.pk}/panel/", f"/reservations/{r.pk}/cancel/"):
        html = client.get(path).content.decode()
        assert start in html and end in html, (path, start, end)
    # An extension button's new end, on the reservation's page.
    html = client.get(f"/reservations/{r.pk}/").content.decode()
    assert f"(ends {page_time(r.end + timedelta(hours=4), zone)})" in html, "the +4 hours button's new end"


def test_the_end_of_a_window_that_crosses_new_year_names_its_year(world, web, book, t0):
    # The reservation list wrote a booking from New Year's Eve as "Thu 31 Dec 2026 22:00 UTC – Fri 1 Jan 02:00 UTC":
    # the start with its year, the end without, as if it were in the start's year. A window's end names its year
    # when it is not the start's, in the reader's zone (a window crossing midnight UTC on New Year's Eve does not
    # cross the year in Tokyo until 09:00 UTC).
    from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

    from reservations.models import Reservation

    r = book("alpha-lead", t0, hours=3, name="new-year-run")
    year = t0.year + 1
    start, end = datetime(year - 1, 12, 31, 22, tzinfo=UTC), datetime(year, 1, 1, 2, tzinfo=UTC)
    Reservation.objects.filter(pk=r.pk).update(period=DateTimeTZRange(start, end, "[)"))
    client = web("alpha-lead")
    html = client.get("/reservations/").content.decode()
    assert f"Thu 31 Dec {year - 1} 22:00 UTC" in html or f"31 Dec {year - 1} 22:00 UTC" in html, html
    assert f" 1 Jan {year} 02:00 UTC</time>" in html, "the end names its year"
    for path in (f"/reservations/{r.pk}/panel/", f"/reservations/{r.pk}/cancel/"):
        assert f" 1 Jan {year} 02:00 UTC" in client.get(path).content.decode(), path
    # in Tokyo the same window is 07:00–11:00 on 1 January: one year, written once
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    html = client.get(f"/reservations/{r.pk}/panel/").content.decode()
    assert " 1 Jan 07:00 JST – " in html and " 1 Jan 11:00 JST" in html and f"Jan {year} 11:00" not in html, html


def test_when_end_adds_the_year_only_when_the_window_crosses_one():
    from django.template import Context, Template

    tmpl = Template("{% load times %}{{ end|when_end:start }}")

    def render(start, end):
        return tmpl.render(Context({"start": start, "end": end}))

    start = datetime(2026, 12, 31, 22, tzinfo=UTC)
    assert render(start, datetime(2027, 1, 1, 2, tzinfo=UTC)) == "Fri 1 Jan 2027 02:00 UTC"
    assert render(start, datetime(2026, 12, 31, 23, tzinfo=UTC)) == "Thu 31 Dec 23:00 UTC"
    assert render(None, datetime(2026, 12, 31, 23, tzinfo=UTC)) == "Thu 31 Dec 23:00 UTC"
    assert render(start, None) == ""


def test_a_clusters_window_names_its_ends_year_when_it_crosses_new_year(world, web, book, t0):
    # The cluster list and a cluster's page wrote a New Year's Eve booking's window as
    # "Thu 31 Dec 22:00 UTC → Fri 1 Jan 02:00 UTC": the end without its year, as the reservation pages did before.
    from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

    from provisioning.services import cluster_create_for_reservation
    from reservations.models import Reservation

    r = book("alpha-lead", t0, hours=3, name="new-year-cluster")
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    year = t0.year + 1
    start, end = datetime(year - 1, 12, 31, 22, tzinfo=UTC), datetime(year, 1, 1, 2, tzinfo=UTC)
    Reservation.objects.filter(pk=r.pk).update(period=DateTimeTZRange(start, end, "[)"))
    client = web("alpha-lead")
    for path in ("/clusters/", f"/clusters/{cluster.pk}/"):
        html = client.get(path).content.decode()
        assert f"Thu 31 Dec 22:00 UTC → Fri 1 Jan {year} 02:00 UTC" in html, (path, html)


def test_when_end_reads_the_start_in_the_zone_the_end_is_written_in():
    # The end is written in the zone the template engine put it in; the start must be read in that same zone.
    # Inside {% localtime off %} (or for an end handed over in another zone) the filter compared the start's
    # year in the reader's zone with the end's in UTC: in Tokyo a window 31 Dec 16:00 – 1 Jan 02:00 UTC starts
    # on 1 January there, so "… – Fri 1 Jan 02:00 UTC" lost its year beside "Thu 31 Dec 16:00 UTC".
    from zoneinfo import ZoneInfo

    from django.template import Context, Template
    from django.utils import timezone

    tmpl = Template("{% load tz times %}{% localtime off %}"
                    "{{ start|when }} – {{ end|when_end:start }}{% endlocaltime %}")
    start, end = datetime(2026, 12, 31, 16, tzinfo=UTC), datetime(2027, 1, 1, 2, tzinfo=UTC)
    with timezone.override(ZoneInfo("Asia/Tokyo")):
        assert tmpl.render(Context({"start": start, "end": end})) == "Thu 31 Dec 16:00 UTC – Fri 1 Jan 2027 02:00 UTC"


def test_when_end_takes_a_naive_or_a_date_start():
    # A naive start (no zone to convert) is read as it is; a date start by its year. The filter dropped the year
    # for a naive start and raised AttributeError ('date' has no 'utcoffset') for a date: a 500 for the page.
    from datetime import date

    from django.template import Context, Template

    tmpl = Template("{% load times %}{{ end|when_end:start }}")
    end = datetime(2027, 1, 1, 2, tzinfo=UTC)
    assert tmpl.render(Context({"start": datetime(2026, 12, 31, 22), "end": end})) == "Fri 1 Jan 2027 02:00 UTC"
    assert tmpl.render(Context({"start": date(2026, 12, 31), "end": end})) == "Fri 1 Jan 2027 02:00 UTC"
    assert tmpl.render(Context({"start": date(2027, 1, 1), "end": end})) == "Fri 1 Jan 02:00 UTC"
