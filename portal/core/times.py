"""How the portal's pages write an instant: one format, in the reader's zone, always naming the zone.

"Sun 6 Dec 17:00 CET" (PAGE_TIME_FORMAT), or with seconds where they matter, "Sun 6 Dec 17:00:08 CET"
(PAGE_TIME_SECONDS_FORMAT), or with the year where a time may be of another year than the reader's (a
booking's page, the reservation list, API tokens), "Sun 6 Dec 2026 17:00 CET" (PAGE_TIME_YEAR_FORMAT).
Templates use the ``when`` filter (``{% load times %}``); Python code that writes a time
into a page's text uses ``page_time``. The API and the admin keep UTC.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from django.utils.formats import date_format

__all__ = ["PAGE_TIME_FORMAT", "PAGE_TIME_SECONDS_FORMAT", "PAGE_TIME_YEAR_FORMAT", "page_time", "zoned_text"]

PAGE_TIME_FORMAT = "D j M H:i T"
PAGE_TIME_SECONDS_FORMAT = "D j M H:i:s T"
PAGE_TIME_YEAR_FORMAT = "D j M Y H:i T"


def page_time(value: datetime, tz: Any = None, *, seconds: bool = False) -> str:
    """``value`` as the pages write it, in ``tz`` (the active zone when None)."""
    local = timezone.localtime(value, tz) if timezone.is_aware(value) else value
    return date_format(local, PAGE_TIME_SECONDS_FORMAT if seconds else PAGE_TIME_FORMAT)


# An instant as stored text writes it (portal.core.timefmt.format_utc): "2026-12-09T09:00:00Z".
_ISO_UTC = re.compile(r"\b(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d)(?::(\d\d))?Z\b")


def zoned_text(text: str, tz: Any = None) -> str:
    """A stored text (a delivery's one-line summary) with each UTC instant in it written as the pages write
    times, in ``tz`` (the active zone when None): "… 2026-12-09T09:00:00Z → …" → "… Wed 9 Dec 10:00 CET → …"."""

    def local(m: re.Match) -> str:
        try:
            value = datetime(*(int(g or 0) for g in m.groups()), tzinfo=UTC)
        except ValueError:
            return m.group(0)
        return page_time(value, tz)

    return _ISO_UTC.sub(local, text or "")
