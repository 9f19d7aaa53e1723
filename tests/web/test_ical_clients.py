"""The iCalendar feed as real clients read it: escaping of tenant-controlled text, SEQUENCE on every change, HEAD."""

from datetime import timedelta

import pytest
from icalendar import Calendar

from reservations import services
from tests.conftest import feed_path

pytestmark = pytest.mark.django_db


def _feed(client, tenant):
    return client.get(feed_path(tenant, tenant.memberships.get(user__username="alpha-viewer").user))


def _unfold(body: bytes) -> list[str]:
    return body.decode().replace("\r\n ", "").split("\r\n")


def test_tenant_name_with_a_newline_does_not_break_the_feed(world, client, book, t0):
    # Staff can set any name through the API (CharField) or a hand-made admin POST.
    alpha = world.tenants["alpha"]
    alpha.name, alpha.ical_token = "Team Alpha\nResearch", "alpha-feed-secret-0123456789"
    alpha.save()
    book("alpha-lead", t0)
    response = _feed(client, alpha)
    assert response.status_code == 200  # was: 500 (AssertionError in icalendar's Contentline)
    cal = Calendar.from_ical(response.content)
    assert len(cal.walk("VEVENT")) == 1


def test_calendar_name_and_description_are_escaped_as_text(world, client, book, t0):
    # RFC 5545 §3.3.11 / RFC 7986 NAME: TEXT escapes backslash, comma and semicolon. Clients unescape
    # X-WR-CALNAME too, so "R\nD" would be shown on two lines and "a,b" may be read as a list.
    alpha = world.tenants["alpha"]
    alpha.name, alpha.ical_token = r"Alpha, R\nD; GPUs", "alpha-feed-secret-0123456789"
    alpha.save()
    lines = _unfold(_feed(client, alpha).content)
    for prop in ("NAME", "X-WR-CALNAME"):
        (line,) = [x for x in lines if x.startswith(prop + ":")]
        assert line == prop + r":Alpha\, R\\nD\; GPUs GPU reservations", line
    (desc,) = [x for x in lines if x.startswith("X-WR-CALDESC:")]
    assert desc == r"X-WR-CALDESC:GPU node reservations of Alpha\, R\\nD\; GPUs.", desc


def test_every_change_raises_sequence(world, client, book, t0):
    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-feed-secret-0123456789"
    alpha.save()
    r = book("alpha-lead", t0)

    def seq():
        (ev,) = [e for e in Calendar.from_ical(_feed(client, alpha).content).walk("VEVENT")]
        return int(ev["SEQUENCE"])

    s0 = seq()
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, end=t0 + timedelta(hours=3))
    s1 = seq()
    services.reservation_cancel(actor=world.users["alpha-lead"], reservation=r)
    s2 = seq()
    # Seconds since creation, truncated: two changes inside one second share a SEQUENCE.
    assert s0 < s1 < s2, (s0, s1, s2)


def test_head_is_answered_like_get(world, client):
    # Calendar clients and link checkers probe subscriptions with HEAD.
    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-feed-secret-0123456789"
    alpha.save()
    response = client.head(feed_path(alpha, world.users["alpha-viewer"]))
    assert response.status_code == 200  # was: 405 (require_GET)
    assert response["Content-Type"] == "text/calendar; charset=utf-8"


def test_dtstamp_is_the_last_revision_not_the_time_of_the_request(world, client, book, t0):
    # RFC 5545 §3.8.7.2: without a METHOD (a published feed, as this one), DTSTAMP is when the event's
    # information was last revised in the calendar store. It was the time of each request, so every poll
    # rewrote every event (and the feed was never the same twice).
    import time

    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-feed-secret-0123456789"
    alpha.save()
    book("alpha-lead", t0)
    first = _feed(client, alpha).content
    time.sleep(1.1)  # DTSTAMP has whole seconds
    second = _feed(client, alpha).content
    assert first == second
    (event,) = Calendar.from_ical(second).walk("VEVENT")
    assert "METHOD" not in Calendar.from_ical(second)
    assert event["DTSTAMP"].dt == event["LAST-MODIFIED"].dt


def test_a_node_swap_revises_the_event(world, client, book, t0):
    # A failed node's booking moved to a spare changes the event's node list; the reservation's updated_at (the
    # event's LAST-MODIFIED and DTSTAMP) stayed as it was, so the event claimed no revision since its booking.
    import time

    from reservations.models import Node
    from reservations.services import node_replace_allocations, node_update

    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-feed-secret-0123456789"
    alpha.save()
    r = book("alpha-lead", t0)
    (before,) = Calendar.from_ical(_feed(client, alpha).content).walk("VEVENT")
    time.sleep(1.1)  # the stamps have whole seconds
    own = Node.objects.get(hostname=r.node_hostnames[0])
    node_update(actor=None, node=own, state="failed")
    assert [o["result"] for o in node_replace_allocations(node=own)] == ["replaced"]
    (after,) = Calendar.from_ical(_feed(client, alpha).content).walk("VEVENT")
    assert own.hostname in str(before["DESCRIPTION"]) and own.hostname not in str(after["DESCRIPTION"])
    assert after["LAST-MODIFIED"].dt > before["LAST-MODIFIED"].dt
    assert after["DTSTAMP"].dt > before["DTSTAMP"].dt
    assert int(after["SEQUENCE"]) > int(before["SEQUENCE"])
