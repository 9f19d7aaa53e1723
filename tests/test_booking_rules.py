"""Booking rules at their edges: early teardown still counts against the quota, a re-picked degraded booking
holds all its nodes, a running booking on a spare extends from the swap, a shortened burst booking is classified
again."""
from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from reservations import selectors
from reservations.models import Allocation, Node, Reservation
from reservations.services import (
    node_replace_allocations,
    node_update,
    reservation_cancel,
    reservation_create,
    reservation_set_status,
    reservation_update,
)
from reservations.timeutil import slot_floor

from .conftest import now_clear_of_the_hour

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)


def book(world, slug, n, start, end):
    return reservation_create(actor=world.users[f"{slug}-lead"], tenant=world.tenants[slug], pool=world.pool,
                              node_count=n, start=start, end=end)


def held_at(tenant, t):
    """Nodes the tenant really holds at instant t: its active allocations (brute force)."""
    return Allocation.objects.filter(reservation__tenant=tenant, active=True, period__contains=t).count()


# 1. A reservation torn down early (ending -> completed, what provisioning.cluster_teardown does) keeps its
#    allocations to the booked end, but the quota sweep no longer counts it: the tenant books past its limit.
def test_completed_early_reservation_is_counted_or_frees_its_nodes(world):
    alpha = world.tenants["alpha"]
    alpha.burst_enabled = False
    alpha.save()
    now_slot = slot_floor(now_clear_of_the_hour(), 60)
    start, end = now_slot, now_slot + 4 * H
    first = book(world, "alpha", 3, start, end)  # max_nodes = 3: the whole guarantee
    reservation_set_status(reservation_id=first.pk, status="ending", expected=("confirmed",))
    reservation_set_status(reservation_id=first.pk, status="completed", expected=("ending",))
    try:
        book(world, "alpha", 1, start + H, end)
    except Exception as exc:  # refused: the quota still counts the nodes the first one holds
        assert getattr(exc, "code", None) == "quota_exceeded"
    # Either way the tenant never holds more than max_nodes (3) at once (burst is off).
    assert held_at(alpha, start + H) <= 3


# 2. Moving/extending a degraded future reservation whose own nodes are taken re-picks node_count nodes,
#    but missing_nodes stays: it holds more nodes than node_count - missing_nodes and the API says it is
#    short of a node it has.
def test_repick_of_a_degraded_reservation_keeps_its_node_count_consistent(world, t0):
    r = book(world, "alpha", 2, t0, t0 + 2 * H)
    blocker = book(world, "beta", 2, t0, t0 + 2 * H)  # every other node: no spare
    failed = Node.objects.get(hostname=r.node_hostnames[0])
    node_update(actor=None, node=failed, state="failed")
    assert [o["result"] for o in node_replace_allocations(node=failed)] == ["degraded"]
    kept = Node.objects.get(hostname=r.node_hostnames[1])
    reservation_cancel(actor=world.users["beta-lead"], reservation=blocker)
    # Its remaining node is taken right after its window: extending must move it (not begun yet).
    Allocation.objects.create(node=kept, period=DateTimeTZRange(t0 + 2 * H, t0 + 3 * H, "[)"), kind="maintenance")
    reservation_update(actor=world.users["alpha-lead"], reservation=r, end=t0 + 3 * H)
    r.refresh_from_db()
    active = r.allocations.filter(active=True).count()
    assert active == r.node_count - r.missing_nodes, (active, r.node_count, r.missing_nodes)


# 3. A running reservation moved to a spare holds the spare from the cut ("now") on. Extending it rewrites
#    every active allocation to the whole window [start, new end): the spare's row now claims the past too,
#    and if the spare served another booking earlier in that window the extension is refused with 409
#    although the spare is free for the extra hour.
def test_extending_a_running_reservation_keeps_its_spare_from_the_cut(world):
    now = now_clear_of_the_hour()
    now_slot = slot_floor(now, 60)
    alpha, beta = world.tenants["alpha"], world.tenants["beta"]
    r = book(world, "alpha", 1, now_slot, now_slot + 2 * H)
    own = Node.objects.get(hostname=r.node_hostnames[0])
    others = [n for n in world.nodes if n.pk != own.pk]
    spare, busy = others[0], others[1:]
    # r began three hours ago (shift its rows into the past: bookings cannot be made there).
    began = now_slot - 3 * H
    Reservation.objects.filter(pk=r.pk).update(period=DateTimeTZRange(began, now_slot + 2 * H, "[)"))
    Allocation.objects.filter(reservation=r).update(period=DateTimeTZRange(began, now_slot + 2 * H, "[)"))
    # The spare served a beta booking that ended two hours ago (completed: its rows stay as they were).
    past = Reservation.objects.create(tenant=beta, pool=world.pool, node_count=1, status="completed",
                                      period=DateTimeTZRange(began, now_slot - 2 * H, "[)"), billing="committed")
    Allocation.objects.create(reservation=past, node=spare, period=past.period, kind="reservation")
    # Every other node is busy now, so the spare is the one a swap takes.
    for node in busy:
        Allocation.objects.create(node=node, period=DateTimeTZRange(now_slot, now_slot + 3 * H, "[)"),
                                  kind="maintenance")
    node_update(actor=None, node=own, state="failed")
    assert [o["result"] for o in node_replace_allocations(node=own)] == ["replaced"]
    moved = Allocation.objects.get(reservation=r, active=True)
    assert moved.node_id == spare.pk and moved.period.lower > now_slot
    # The spare is free for the extra hour: extending must work and keep the spare's row from the cut.
    assert spare.pk in selectors.free_node_ids(pool_id=world.pool.pk, start=now_slot + 2 * H,
                                               end=now_slot + 3 * H, limit=10)
    reservation_update(actor=world.users["alpha-lead"], reservation=r, end=now_slot + 3 * H)
    moved.refresh_from_db()
    assert moved.period.lower > now_slot and moved.period.upper == now_slot + 3 * H
    assert held_at(alpha, timezone.now()) == 1


# 4. DESIGN §4: "Extend/shorten (PATCH end) and cancel follow the same rules": a burst booking shortened to a
#    window where peak + n <= max_nodes is committed by those rules, but keeps billing = burst (on-demand).
def test_shortened_burst_booking_is_classified_again(world, t0):
    book(world, "alpha", 3, t0, t0 + 2 * H)                    # the guarantee, for the first two hours
    r = book(world, "alpha", 1, t0, t0 + 4 * H)               # 3 + 1 > 3: burst
    assert r.billing == "burst"
    reservation_update(actor=world.users["alpha-lead"], reservation=r, start=t0 + 2 * H)  # now alone: 1 <= 3
    r.refresh_from_db()
    assert r.billing == "committed"
