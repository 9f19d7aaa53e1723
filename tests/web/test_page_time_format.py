"""Every time a page writes goes through the site's one format (portal.core.times, the ``when`` filter): the
dashboard, the reservation panel, the cancel page and the booking answer show "Sun 6 Dec 17:00 CET" in the
reader's zone, and no template spells the format out by hand (a copy that would drift when the site's changes)."""

from __future__ import annotations

import re
from datetime import timedelta
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
