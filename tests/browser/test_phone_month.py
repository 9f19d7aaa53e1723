"""The calendar's month view on a phone (390 px): a booking's status, in words in its box, stays in the box."""

from __future__ import annotations

import pytest

from reservations import services

from .conftest import PHONE, at

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Each event's box and its status's box; whether any part of the status lies outside the event.
_STATUS_IN_BOX = """() => Array.from(document.querySelectorAll('.fc-event[data-reservation-id]')).map(e => {
  const s = e.querySelector('.ev-status'), box = e.getBoundingClientRect();
  if (!s) { return {id: e.getAttribute('data-reservation-id'), text: null}; }
  const r = s.getBoundingClientRect(), time = e.querySelector('.fc-event-time');
  const t = time ? time.getBoundingClientRect() : null;
  return {id: e.getAttribute('data-reservation-id'), text: s.textContent.trim(), width: r.width, height: r.height,
          cut: s.scrollWidth - s.clientWidth,
          inside: r.left >= box.left - 1 && r.right <= box.right + 1 &&
                  r.top >= box.top - 1 && r.bottom <= box.bottom + 1,
          time: time ? time.textContent.trim() : null,
          timeInside: !t || (t.left >= box.left - 1 && t.right <= box.right + 1),
          overlap: !!t && t.right > r.left + 1 && r.bottom > t.top + 1 && t.bottom > r.top + 1};
})"""


def test_a_bookings_status_stays_in_its_box_in_the_month_view_on_a_phone(world, live_server, new_page, sign_in, day):
    """In the month view at 390 px a day's cell is about 45 px wide: a booking's time filled it and its status
    ("Confirmed", white) ran out of the box over the next days' cells, where it could not be read and covered
    their bookings. The time and the status now each take a line inside the box."""
    mine = [services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                        pool=world.pool, node_count=1, start=at(day, hour), end=at(day, hour + 2),
                                        name=name)
            for hour, name in ((10, "eval"), (14, "hyperparameter-sweep-for-the-long-context-model"))]
    page = sign_in(new_page(viewport=PHONE), "alpha-lead")
    page.goto(f"{live_server.url}/calendar/?view=dayGridMonth&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    shown = {s["id"]: s for s in page.evaluate(_STATUS_IN_BOX)}
    assert set(shown) == {str(r.pk) for r in mine}, shown
    for status in shown.values():
        assert status["text"] == "Confirmed", status
        assert status["cut"] <= 1 and status["inside"] and status["timeInside"], status
        assert not status["overlap"], status
        assert status["width"] > 20 and status["height"] >= 8, status
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, overflow
    assert page.errors == []
