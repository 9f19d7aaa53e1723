"""seed_scale loads a consistent fleet fast, leaves the schema exactly as migrated, and the
benchmark's hand-written availability SQL gives the selector's answer on that data."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.db.models import F
from django.utils import timezone

from reservations import selectors
from reservations.models import Allocation, Node, Pool, Reservation
from reservations.timeutil import slot_floor

pytestmark = pytest.mark.django_db

_spec = importlib.util.spec_from_file_location(
    "bench_availability", Path(__file__).resolve().parents[2] / "bench" / "availability.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def schema_snapshot() -> set[tuple]:
    with connection.cursor() as cur:
        cur.execute("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE tablename LIKE 'reservations_%%'")
        indexes = set(cur.fetchall())
        cur.execute("""SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
                       WHERE conrelid::regclass::text LIKE 'reservations_%%'""")
        return indexes | set(cur.fetchall())


@pytest.fixture
def seeded():
    before = schema_snapshot()
    call_command("seed_scale", nodes=60, allocations=3000, pools=2, tenants=5, no_vacuum=True, verbosity=0)
    return before


def test_seed_scale_loads_the_asked_counts_and_keeps_the_schema(seeded):
    assert Pool.objects.filter(name__startswith="scale-").count() == 2
    assert Node.objects.filter(pool__name__startswith="scale-").count() == 60
    assert Allocation.objects.filter(node__pool__name__startswith="scale-").count() == 3000
    assert Reservation.objects.filter(pool__name__startswith="scale-").exists()
    assert Allocation.objects.filter(kind="maintenance").count() < 100
    assert schema_snapshot() == seeded, "indexes and constraints are re-created exactly as migrated"
    # Reservations hold nodes of their own pool only, and node_count matches their allocations.
    mismatched = Reservation.objects.raw(
        "SELECT r.id FROM reservations_reservation r JOIN reservations_allocation a ON a.reservation_id = r.id "
        "JOIN reservations_node n ON n.id = a.node_id GROUP BY r.id, r.node_count, r.pool_id "
        "HAVING count(*) <> r.node_count OR bool_or(n.pool_id <> r.pool_id)")
    assert list(mismatched) == []
    # A burst booking bills some of its nodes as burst (usage prices burst_part_nodes of node_count at the
    # on-demand rate), a committed one none: seeded burst bookings with 0 showed no burst hours at all.
    assert Reservation.objects.filter(pool__name__startswith="scale-", billing="burst").exists()
    assert not Reservation.objects.filter(pool__name__startswith="scale-", billing="burst",
                                          burst_part_nodes__lt=1).exists()
    assert not Reservation.objects.filter(pool__name__startswith="scale-", billing="burst",
                                          burst_part_nodes__gt=F("node_count")).exists()
    assert not Reservation.objects.filter(pool__name__startswith="scale-", billing="committed",
                                          burst_part_nodes__gt=0).exists()
    # Statuses follow the clock.
    now = timezone.now()
    assert not Reservation.objects.filter(status="completed", period__endswith__gt=now).exists()
    assert not Reservation.objects.filter(status="confirmed", period__startswith__lte=now).exists()


def test_the_reloaded_exclusion_constraint_still_forbids_double_booking(seeded):
    taken = Allocation.objects.filter(active=True, kind="reservation").first()
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(node=taken.node, period=taken.period, kind="maintenance")


def test_a_second_load_needs_replace(seeded):
    with pytest.raises(CommandError):
        call_command("seed_scale", nodes=10, allocations=100, verbosity=0)
    call_command("seed_scale", nodes=16, allocations=500, replace=True, no_vacuum=True, verbosity=0)
    assert Node.objects.filter(pool__name__startswith="scale-").count() == 16
    assert Allocation.objects.filter(node__pool__name__startswith="scale-").count() == 500


@pytest.mark.parametrize(("offset_min", "days", "step_h", "tail_min"), [
    (0, 14, 1, 0),     # the benchmark's question: hourly slots on the grid
    (0, 3, 3, 0),      # several slots per step: bookings end mid-step (exact path)
    (30, 2, 1, 0),     # a window off the grid
    (0, 2, 2, 60),     # a partial last slot
    (-24 * 60, 5, 24, 0),  # daily slots from yesterday
])
def test_hand_sql_gives_the_selectors_answer(seeded, offset_min, days, step_h, tail_min):
    pool = Pool.objects.get(name="scale-p0")
    start = slot_floor(timezone.now(), 60) + timedelta(minutes=offset_min)
    end = start + timedelta(days=days, minutes=tail_min)
    step = timedelta(hours=step_h)
    expected = [(s.start, s.end, s.free_nodes) for s in selectors.availability(pool=pool, start=start, end=end,
                                                                              step=step)]
    with connection.cursor() as cur:
        got = bench.hand_availability(cur.cursor, pool_id=pool.pk, start=start, end=end, step=step)
    assert got == expected
    assert any(free < 30 for _, _, free in got), "the window must actually contain bookings"


def test_hand_sql_counts_a_node_once_when_two_bookings_share_a_step(db):
    pool = Pool.objects.create(name="p", gpu_model="H100", gpus_per_node=8)
    node = Node.objects.create(hostname="n1", pool=pool)
    Node.objects.create(hostname="n2", pool=pool)
    t0 = slot_floor(timezone.now(), 60) + timedelta(days=1)
    for h in (0, 1):
        Allocation.objects.create(node=node, kind="maintenance",
                                  period=DateTimeTZRange(t0 + timedelta(hours=h), t0 + timedelta(hours=h + 1), "[)"))
    with connection.cursor() as cur:
        got = bench.hand_availability(cur.cursor, pool_id=pool.pk, start=t0, end=t0 + timedelta(hours=4),
                                      step=timedelta(hours=2))
    assert [free for _, _, free in got] == [1, 2]


@pytest.mark.parametrize("days_back", [-1, 0, 3651, 10**9])
def test_days_back_outside_one_day_to_ten_years_is_refused_before_anything_is_loaded(days_back):
    with pytest.raises(CommandError, match=rf"--days-back must be between 1 and 3650 days \(got {days_back}\)"):
        call_command("seed_scale", nodes=8, allocations=10, days_back=days_back, no_vacuum=True, verbosity=0)
    assert not Pool.objects.filter(name__startswith="scale-").exists()


def test_seed_scale_counts_in_words():
    """Its summary said "1 pool(s)": one pool, one tenant read as such now."""
    import io

    out = io.StringIO()
    call_command("seed_scale", nodes=4, allocations=1, pools=1, tenants=1, no_vacuum=True, stdout=out)
    assert out.getvalue().startswith("seed_scale: 4 nodes in 1 pool, 1 tenant, 1 reservation, 1 allocation in "), \
        out.getvalue()


@pytest.mark.parametrize("days_back", [1, 3650])
def test_days_back_at_the_ends_of_its_range_loads(days_back):
    call_command("seed_scale", nodes=8, allocations=40, days_back=days_back, no_vacuum=True, verbosity=0)
    assert Allocation.objects.filter(node__pool__name__startswith="scale-").count() == 40
    first = Reservation.objects.filter(pool__name__startswith="scale-").order_by("period").first()
    assert first.period.lower >= timezone.now() - timedelta(days=days_back, hours=1)
