"""The calendar's title writes a day or a week as the rest of the site writes a date: day before month."""

from __future__ import annotations

from datetime import date, timedelta

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _title(page, live_server, view: str, d: date) -> str:
    page.goto(f"{live_server.url}/calendar/?view={view}&date={d.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    return page.locator(".fc-toolbar-title").inner_text()


@pytest.mark.parametrize("locale", ["en-US", "de-DE"])
def test_the_calendars_title_names_the_day_before_the_month_whatever_the_browsers_language(
        world, live_server, new_page, sign_in, locale):
    """The day view's title read "December 31, 2026" and the week's "Dec 28, 2026 – Jan 3, 2027" (US order)
    under column headings and booking times written "Thu 31 Dec" as everywhere else on the site."""
    page = sign_in(new_page(locale=locale), "alpha-lead")
    year = date.today().year + 1
    new_year = date(year, 12, 31)
    assert _title(page, live_server, "timeGridDay", new_year) == f"{new_year:%a} 31 Dec {year}"
    assert _title(page, live_server, "timeGridWeek", new_year - timedelta(days=3)) == \
        f"28 Dec {year} – 3 Jan {year + 1}"
    assert _title(page, live_server, "timeGridWeek", date(year, 1, 29)) == f"29 Jan – 4 Feb {year}"
    assert _title(page, live_server, "timeGridWeek", date(year, 3, 2)) == f"2 – 8 Mar {year}"
    assert page.errors == []
