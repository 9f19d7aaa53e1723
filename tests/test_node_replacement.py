"""A failed node's bookings move to spares under the same exclusion constraint, or degrade."""

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.core.exceptions import CapacityUnavailable, InvalidState
from reservations.models import Allocation, Node, Reservation
from reservations.services import node_replace_allocations, node_update, reservation_create
from reservations.timeutil import slot_floor

from .conftest import now_clear_of_the_hour
from .test_races import overlapping_allocations, run_threads, tenants_with_leads


def fail(world_or_node, staff=None):
    node = world_or_node
    node_update(actor=staff, node=node, state="failed", reason="XID 79")
    return node_replace_allocations(node=node, actor=staff, reason="XID 79: fallen off the bus")


@pytest.mark.django_db
def test_running_booking_moves_the_rest_of_its_window_to_a_spare(world, captured_events,
                                                                 django_capture_on_commit_callbacks):
    now_slot = slot_floor(now_clear_of_the_hour(), 60)
    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=2, start=now_slot, end=now_slot + timedelta(hours=4))
    failed = Node.objects.get(hostname=r.node_hostnames[0])
    with pytest.raises(InvalidState):
        node_replace_allocations(node=failed)  # still available: refuse to shuffle a healthy node
    with django_capture_on_commit_callbacks(execute=True):
        outcomes = fail(failed, world.users["staff"])
    assert [o["result"] for o in outcomes] == ["replaced"]
    spare = outcomes[0]["spare"]
    assert spare not in r.node_hostnames
    old = Allocation.objects.get(reservation=r, node=failed)
    assert old.active is False and old.period.lower == now_slot and old.period.upper <= timezone.now()
    assert old.replaced_at == old.period.upper  # the instant the node stopped being the booking's
    new = Allocation.objects.get(reservation=r, node__hostname=spare)
    assert new.active and new.period.upper == now_slot + timedelta(hours=4)
    assert new.period.lower == old.period.upper
    r.refresh_from_db()
    assert r.missing_nodes == 0
    assert ("node.replaced", {"reservation_id": r.pk, "tenant_id": r.tenant_id, "failed": failed.hostname,
                              "spare": spare, "reason": "XID 79: fallen off the bus",
                              "allocation_id": old.pk}) in captured_events  # the allocation lost names the failure
    assert overlapping_allocations() == 0
    body = world.client("alpha-lead").get(f"/api/v1/reservations/{r.pk}/").json()
    assert failed.hostname not in body["nodes"] and spare in body["nodes"] and body["missing_nodes"] == 0


@pytest.mark.django_db
def test_future_booking_moves_whole_and_without_spare_it_degrades(world, t0, captured_events,
                                                                 django_capture_on_commit_callbacks):
    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=3, start=t0, end=t0 + timedelta(hours=2))
    reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                       node_count=1, start=t0, end=t0 + timedelta(hours=2))
    failed = Node.objects.get(hostname=r.node_hostnames[0])
    with django_capture_on_commit_callbacks(execute=True):
        outcomes = fail(failed)
    assert outcomes[0]["result"] == "degraded" and outcomes[0]["missing_nodes"] == 1
    r.refresh_from_db()
    assert r.missing_nodes == 1 and r.status == "confirmed"
    assert [p["missing_nodes"] for n, p in captured_events if n == "reservation.degraded"] == [1]
    assert Allocation.objects.filter(reservation=r, active=True).count() == 2
    assert not Allocation.objects.filter(node=failed, active=True).exists()
    moved = Allocation.objects.get(reservation=r, node=failed)  # held nothing: replaced at its start
    assert moved.replaced_at == moved.period.lower == t0


@pytest.mark.django_db
def test_only_a_released_booking_allocation_can_be_replaced(world, t0):
    """replaced_at marks what a swap released: the database refuses it on a held or maintenance allocation."""
    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=1, start=t0, end=t0 + timedelta(hours=2))
    held = Allocation.objects.filter(reservation=r)
    with pytest.raises(IntegrityError, match="replaced_is_released"), transaction.atomic():
        held.update(replaced_at=t0)
    node = world.pool.nodes.exclude(pk=held.get().node_id).first()
    with pytest.raises(IntegrityError, match="replaced_is_released"), transaction.atomic():
        Allocation.objects.create(node=node, kind="maintenance", active=False, replaced_at=t0,
                                  period=(t0, t0 + timedelta(hours=1)))
    assert held.get().replaced_at is None


@pytest.mark.django_db(transaction=True)
def test_bookings_racing_a_swap_never_double_book(t0):
    from reservations.models import Pool

    pool = Pool.objects.create(name="swap", gpu_model="H100", gpus_per_node=8)
    for i in range(6):
        Node.objects.create(hostname=f"swap-{i}", pool=pool)
    leads = tenants_with_leads(pool, 12, max_nodes=6)
    victim = reservation_create(actor=leads[0][1], tenant=leads[0][0], pool=pool, node_count=2, start=t0,
                                end=t0 + timedelta(hours=3))
    failed = Node.objects.get(hostname=victim.node_hostnames[0])
    node_update(actor=None, node=failed, state="failed", reason="ECC")

    def act(i):
        if i == 0:
            return node_replace_allocations(node=failed, reason="ECC")
        tenant, user = leads[i]
        return reservation_create(actor=user, tenant=tenant, pool=pool, node_count=1, start=t0,
                                  end=t0 + timedelta(hours=3))

    results = run_threads(act, 12)
    swap = results[0]
    assert isinstance(swap, list), swap
    booked = [r for r in results[1:] if isinstance(r, Reservation)]
    assert all(isinstance(r, Reservation | CapacityUnavailable) for r in results[1:]), results
    # 5 healthy nodes: the victim's survivor + whatever the swap and the bookers got, never more.
    victim.refresh_from_db()
    active = Allocation.objects.filter(node__pool=pool, active=True, period__overlap=(t0, t0 + timedelta(hours=3)))
    assert active.count() == 5
    assert len(booked) + (1 if swap[0]["result"] == "replaced" else 0) == 4
    assert victim.missing_nodes == (0 if swap[0]["result"] == "replaced" else 1)
    assert overlapping_allocations() == 0


@pytest.mark.django_db(transaction=True)
def test_a_swap_racing_a_move_that_re_picks_the_nodes_finds_nothing_left(world, t0):
    """The team moves its future booking while a failed node's bookings are moved off it: the move re-picks
    the nodes (its allocations deleted, new ones inserted) after the swap listed them. The swap crashed on the
    vanished allocation (DoesNotExist: the health step or node_sync failed, and the node's other bookings
    waited for a retry); it is nothing left to move."""
    from reservations.services import _lock_nodes
    from tests.racing import behind_a_lock

    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=1, start=t0, end=t0 + timedelta(hours=2))
    failed = Node.objects.get(hostname=r.node_hostnames[0])
    other = Node.objects.filter(pool=world.pool, state="available").exclude(pk=failed.pk).order_by("pk").first()
    Node.objects.filter(pk=failed.pk).update(state="failed")

    def moves_and_re_picks() -> None:  # what reservation_update's re-pick writes, under the booking's lock
        Reservation.objects.select_for_update().get(pk=r.pk)
        Allocation.objects.filter(reservation=r).delete()
        _lock_nodes([other.pk])
        Allocation.objects.create(reservation=r, node=other, period=r.period)

    outcomes = behind_a_lock(moves_and_re_picks, lambda: node_replace_allocations(node=failed, reason="XID 79"))
    assert outcomes == [{"reservation_id": r.pk, "result": "unchanged"}], outcomes
    assert list(Allocation.objects.filter(reservation=r, active=True).values_list("node_id", flat=True)) == [other.pk]


@pytest.mark.django_db
def test_re_picking_the_nodes_of_a_booking_keeps_the_record_of_an_earlier_swap(world, t0):
    """A future booking whose node failed was moved whole to a spare: the failed node's allocation stays,
    released, as the record of the swap (staff read it in the booking's admin page: which node, replaced when,
    why). Moving the booking later into time its spare is taken re-picks its nodes; that deleted every one of
    its allocations, the swap's record with them. Only the ones holding nodes are replaced now."""
    from django.test import Client

    from reservations.services import reservation_update

    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=1, start=t0, end=t0 + timedelta(hours=2))
    failed = Node.objects.get(hostname=r.node_hostnames[0])
    [outcome] = fail(failed, world.users["staff"])
    assert outcome["result"] == "replaced"
    spare = Node.objects.get(hostname=outcome["spare"])
    record = Allocation.objects.get(reservation=r, node=failed)
    assert not record.active and record.replaced_at == t0
    # The spare is taken right after the booking's window: extending into it must re-pick the node.
    Allocation.objects.create(node=spare, kind="maintenance",
                              period=(t0 + timedelta(hours=2), t0 + timedelta(hours=4)))
    r = reservation_update(actor=world.users["alpha-lead"], reservation=Reservation.objects.get(pk=r.pk),
                           end=t0 + timedelta(hours=4))
    [holding] = Allocation.objects.filter(reservation=r, active=True)
    assert holding.node_id not in (failed.pk, spare.pk) and holding.period.upper == t0 + timedelta(hours=4)
    kept = Allocation.objects.get(pk=record.pk)
    assert (kept.node_id, kept.active, kept.replaced_at, kept.note) == (failed.pk, False, t0, record.note)
    assert overlapping_allocations() == 0
    staff = Client()
    staff.force_login(world.users["staff"])
    page = staff.get(f"/admin/reservations/reservation/{r.pk}/change/").content.decode()
    assert record.note in page
