"""What a screen reader is told by the pages (Django test client, the rendered HTML): every column header says
what its column is, every page has one top-level heading, a page's named regions have names of their own."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

pytestmark = pytest.mark.django_db


class _Headers(HTMLParser):
    """The text (visible or screen-reader only) of each <th> in the document."""

    def __init__(self):
        super().__init__()
        self.headers: list[str] = []
        self._open = False

    def handle_starttag(self, tag, attrs):
        if tag == "th":
            self.headers.append("")
            self._open = True

    def handle_endtag(self, tag):
        if tag == "th":
            self._open = False

    def handle_data(self, data):
        if self._open:
            self.headers[-1] += data


def _column_headers(html: str) -> list[str]:
    parser = _Headers()
    parser.feed(html)
    return [h.strip() for h in parser.headers]


def test_the_delivery_logs_button_column_has_a_header_a_screen_reader_can_say(world, web):
    """The delivery log's last column (a failed message's Retry button) had an empty header: a screen reader
    read the button's cell with no column name (axe: empty-table-header). It is "Action" to a screen reader."""
    html = web("alpha-lead").get("/notifications/deliveries/").content.decode()
    headers = _column_headers(html)
    assert headers and all(headers), headers
    assert headers[-1] == "Action", headers
