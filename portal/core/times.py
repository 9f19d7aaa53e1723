"""How the portal's pages write an instant: one format, in the reader's zone, always naming the zone.

"Sun 6 Dec 17:00 CET" (PAGE_TIME_FORMAT), or with seconds where they matter, "Sun 6 Dec 17:00:08 CET"
(PAGE_TIME_SECONDS_FORMAT). Templates use the ``when`` filter (``{% load times %}``); Python code that writes
a time into a page's text uses ``page_time``. The API and the admin keep UTC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.formats import date_format

__all__ = ["PAGE_TIME_FORMAT", "PAGE_TIME_SECONDS_FORMAT", "page_time"]

PAGE_TIME_FORMAT = "D j M H:i T"
PAGE_TIME_SECONDS_FORMAT = "D j M H:i:s T"


def page_time(value: datetime, tz: Any = None, *, seconds: bool = False) -> str:
    """``value`` as the pages write it, in ``tz`` (the active zone when None)."""
    local = timezone.localtime(value, tz) if timezone.is_aware(value) else value
    return date_format(local, PAGE_TIME_SECONDS_FORMAT if seconds else PAGE_TIME_FORMAT)
