"""The reservations list: the current tenant's bookings, past ones too, filtered and paged."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

from reservations import views
from reservations.choices import ReservationStatus
from reservations.models import Reservation
from reservations.services import reservation_cancel

pytestmark = pytest.mark.django_db


def _ids(response) -> list[int]:
    return [r.pk for r in response.context["page"].object_list]


def test_lists_the_tenants_bookings_newest_first(web, world, book, t0):
    a = book("alpha-lead", t0, name="first")
    b = book("alpha-member", t0 + timedelta(hours=3), name="second")
    other = book("beta-lead", t0, name="theirs")
    response = web("alpha-viewer").get("/reservations/")
    assert response.status_code == 200
    assert _ids(response) == [b.pk, a.pk]
    page = response.content.decode()
    assert "first" in page and "second" in page and "theirs" not in page and f"#{other.pk}" not in page
    assert 'href="/reservations/"' in page  # in the navigation


def test_past_and_cancelled_bookings_are_there_too(web, world, book, t0):
    done = book("alpha-lead", t0, name="done")
    Reservation.objects.filter(pk=done.pk).update(
        status=ReservationStatus.COMPLETED, period=DateTimeTZRange(t0 - timedelta(days=30), t0 - timedelta(days=29)))
    gone = reservation_cancel(actor=world.users["alpha-lead"], reservation=book("alpha-lead", t0, name="gone"))
    live = book("alpha-lead", t0 + timedelta(hours=2), name="live")
    client = web("alpha-lead")
    assert set(_ids(client.get("/reservations/"))) == {done.pk, gone.pk, live.pk}
    assert _ids(client.get("/reservations/?status=current")) == [live.pk]
    assert _ids(client.get("/reservations/?status=completed")) == [done.pk]
    assert _ids(client.get("/reservations/?status=cancelled")) == [gone.pk]


def test_filters(web, world, book, t0):
    mine = book("alpha-member", t0, name="ablation-7b")
    theirs = book("alpha-lead", t0 + timedelta(hours=2), name="serving")
    client = web("alpha-member")
    assert _ids(client.get("/reservations/?mine=on")) == [mine.pk]
    assert _ids(client.get("/reservations/?q=ABLATION")) == [mine.pk]
    assert _ids(client.get(f"/reservations/?pool={world.pool.name}")) == [theirs.pk, mine.pk]
    assert _ids(client.get("/reservations/?q=nothing-like-it")) == []


@pytest.mark.parametrize("query,field", [("status=bogus", "status"), ("pool=no-such-pool", "pool"),
                                         ("q=" + "x" * 201, "q")])
def test_a_bad_filter_is_shown_and_ignored(web, world, book, t0, query, field):
    booked = book("alpha-lead", t0)
    response = web("alpha-lead").get(f"/reservations/?{query}")
    assert response.status_code == 400
    assert field in response.context["form"].errors
    assert _ids(response) == [booked.pk]  # the valid filters (none here) still apply


def test_pages(web, world, book, t0, monkeypatch):
    monkeypatch.setattr(views, "RESERVATION_PAGE_SIZE", 2)
    made = [book("alpha-lead", t0 + timedelta(hours=2 * i), name=f"run-{i}") for i in range(5)]
    client = web("alpha-lead")
    first = client.get("/reservations/?mine=on")
    assert _ids(first) == [made[4].pk, made[3].pk]
    assert 'href="?mine=on&amp;page=2"' in first.content.decode()
    assert _ids(client.get("/reservations/?mine=on&page=3")) == [made[0].pk]
    assert _ids(client.get("/reservations/?mine=on&page=x")) == [made[4].pk, made[3].pk]


def test_staff_see_the_tenant_they_work_as(web, world, book, t0):
    theirs = book("beta-lead", t0)
    staff = web("staff")
    staff.post("/tenant/switch/", {"tenant": "beta"})
    assert _ids(staff.get("/reservations/")) == [theirs.pk]


def test_signed_out_is_sent_to_sign_in(client, world):
    response = client.get("/reservations/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
