"""Find the times a page shows without their zone: every time a reader sees names the zone it is in."""

from __future__ import annotations

import re

__all__ = ["unzoned_times"]

# A clock time in the page's text ("19:00", "19:00:05") not followed by a zone ("JST", "+0530").
# Not inside an ISO instant (2026-12-03T19:00:00+09:00 in a datetime attribute), which names its offset.
_TIME = re.compile(r"(?<![\dT:+\-])\d\d:\d\d(?::\d\d)?(?![:\d])(?! [A-Z]{2,5}\b| [+-]\d{2,4}\b)")
_SCRIPT = re.compile(r"<script\b.*?</script>", re.S)


def unzoned_times(html: str) -> list[str]:
    """Each time shown without a zone, with the text just before it (to say where it is)."""
    text = _SCRIPT.sub("", html)
    return [text[max(0, m.start() - 60):m.end() + 8] for m in _TIME.finditer(text)]
