"""The legends on a phone (390 px): no line of a legend starts with a stray "·" separator."""

from __future__ import annotations

import pytest

from .conftest import PHONE

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Every item of every legend that begins a line (at the legend's left edge; a hidden line break aside), with what
# it shows first: its ::before's text (where it has one) and then its own.
_LINE_STARTS = """() => Array.from(document.querySelectorAll('.legend')).flatMap(legend => {
  const style = getComputedStyle(legend);
  const left = legend.getBoundingClientRect().left + parseFloat(style.borderLeftWidth) + parseFloat(style.paddingLeft);
  const items = Array.from(legend.children).filter(item => item.getAttribute('aria-hidden') !== 'true');
  return items.filter(item => item.getBoundingClientRect().left <= left + 2).map(item => {
    const before = getComputedStyle(item, '::before');
    const generated = before.display !== 'none' && /^".*"$/.test(before.content) ? before.content.slice(1, -1) : '';
    return {legend: legend.getAttribute('aria-label'), text: (generated + item.textContent).trim()};
  });
})"""

SEPARATORS = ("·", "•", "|", "-", "–", "—")


@pytest.mark.parametrize(("who", "path"), [("alpha-lead", "/calendar/?pool=h100"),
                                           ("alpha-viewer", "/calendar/?pool=h100"),
                                           ("alpha-lead", "/availability/"), ("staff", "/fleet/")])
def test_no_legend_line_starts_with_a_separator_on_a_phone(world, live_server, new_page, sign_in, who, path):
    """At 390 px the calendar's legends wrap, and their notes ("· drag across free time to book…", "· each
    booking shows its status in words…") began a line of their own with the "·" that was meant to stand
    between them and the swatch before them. A note now sits on a line of its own, with no separator."""
    page = sign_in(new_page(viewport=PHONE), who)
    page.goto(live_server.url + path)
    if path.startswith("/calendar/"):
        page.wait_for_selector("#calendar[data-ready='1']")
    starts = page.evaluate(_LINE_STARTS)
    assert starts, "no legend item found at a line's start"
    for start in starts:
        assert start["text"] and not start["text"].startswith(SEPARATORS), start
    assert page.errors == []
