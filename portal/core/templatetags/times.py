"""``{{ instant|when }}`` → "Sun 6 Dec 17:00 CET", ``{{ instant|when:"seconds" }}`` → "Sun 6 Dec 17:00:08 CET",
``{{ instant|when:"year" }}`` → "Sun 6 Dec 2026 17:00 CET" (where a time may be of another year than the reader's):
the site's one way to show a time, in the reader's zone (the active one), always naming the zone.
``{{ end|when_end:start }}`` → a window's end as ``when`` writes it, with the year where it is not the start's
("… – Fri 1 Jan 2027 02:00 UTC" after "Thu 31 Dec 22:00 UTC"), both read in the reader's zone.
``{{ text|zoned }}`` writes the UTC instants in a stored text ("2026-12-09T09:00:00Z") the same way."""

from __future__ import annotations

from datetime import date, datetime

from django import template
from django.template.defaultfilters import date as date_filter
from django.utils import timezone

from ..times import PAGE_TIME_FORMAT, PAGE_TIME_SECONDS_FORMAT, PAGE_TIME_YEAR_FORMAT, zoned_text

register = template.Library()


@register.filter(expects_localtime=True)
def when(value, precision: str = ""):
    if value in (None, ""):
        return ""
    formats = {"seconds": PAGE_TIME_SECONDS_FORMAT, "year": PAGE_TIME_YEAR_FORMAT}
    return date_filter(value, formats.get(precision, PAGE_TIME_FORMAT))


@register.filter(expects_localtime=True)
def when_end(value, start=None):
    if value in (None, ""):
        return ""
    if _year_as_written_with(start, value) not in (None, value.year):
        return when(value, "year")
    return when(value)


def _year_as_written_with(start, value) -> int | None:
    """The start's year in the zone the end is written in: the one the template engine put the end in (the
    reader's, but none inside {% localtime off %}), not the reader's whatever it was. A naive start or a date is
    read as it is; anything else (None, "") has no year."""
    if isinstance(start, datetime):
        if timezone.is_naive(start):
            return start.year
        if isinstance(value, datetime) and timezone.is_aware(value):
            return start.astimezone(value.tzinfo).year
        return timezone.localtime(start).year
    return start.year if isinstance(start, date) else None


@register.filter
def zoned(text):
    return zoned_text(str(text)) if text else text
