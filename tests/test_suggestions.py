"""Suggestions of a capacity_unavailable refusal (DESIGN §4): right, and cheap on a busy pool.

selectors.suggest_windows must return the nearest window of the asked length with node_count
free nodes before start and the nearest after, on the slot grid, within ±search, not before
earliest, ending by latest_end, counting only available nodes and only active allocations. The
property test checks it against a brute force over every grid start on small random pools
(maintenance blocks, drained and failed nodes, released allocations, windows touching earliest
and latest_end, several slot lengths, the passes cut small so that every pass is exercised).

The cost test counts what PostgreSQL read, not how long it took (the machine is shared): the
statement before the sweep probed the allocations once per candidate start and per node.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservations import selectors
from reservations.models import Allocation, Node, Pool
from reservations.timeutil import slot_floor

from . import booking_oracle as oracle

STATES = ["available", "available", "available", "available", "draining", "failed", "maintenance"]


def _pool(slot_minutes: int, states: list[str]) -> tuple[Pool, list[Node]]:
    pool = Pool.objects.create(name=f"sugg-{random.random():.9f}", gpu_model="H100-SXM", gpus_per_node=8,
                               slot_minutes=slot_minutes)
    nodes = [Node.objects.create(hostname=f"{pool.name}-{i}", pool=pool, state=s) for i, s in enumerate(states)]
    return pool, nodes


def _block(nodes, taken, i, lo, hi, *, active=True) -> None:
    """A maintenance allocation of node i over [lo, hi), unless it would double-book the node."""
    if active and any(a < hi and lo < b for a, b in taken[i]):
        return
    if active:
        taken[i].append((lo, hi))
    Allocation.objects.create(node=nodes[i], period=DateTimeTZRange(lo, hi), kind="maintenance", active=active,
                              note="test")


def brute(pool, n, start, end, *, earliest, latest_end, search):
    """Every grid start nearest first, each counted against the allocation rows."""
    step, dur = timedelta(minutes=pool.slot_minutes), end - start
    lo, hi = max(earliest, start - search), start + search

    def fits(t):
        return t >= earliest and t + dur <= latest_end and len(oracle.free_nodes(pool, t, t + dur)) >= n

    before = next((t for t in (start - step * k for k in range(1, 10_000)) if t < lo or fits(t)), None)
    after = next((t for t in (start + step * k for k in range(1, 10_000)) if t > hi or fits(t)), None)
    return [{"start": t, "end": t + dur} for t in (before, after)
            if t is not None and lo <= t <= hi]


blocks = st.lists(st.tuples(st.integers(0, 7), st.integers(-30, 60), st.integers(1, 12), st.booleans()),
                  max_size=40)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(slot=st.sampled_from([60, 120, 30, 1]), states=st.lists(st.sampled_from(STATES), min_size=1, max_size=8),
       allocs=blocks, at=st.integers(0, 30), hours=st.integers(1, 8), extra=st.integers(0, 2),
       search_slots=st.integers(8, 48), earliest_back=st.integers(-2, 50), horizon=st.integers(0, 80),
       horizon_off=st.integers(0, 59), passes=st.sampled_from([(24, 240), (1, 3), (2,), ()]))
def test_suggestions_match_a_brute_force_over_every_grid_start(db, monkeypatch, slot, states, allocs, at, hours,
                                                               extra, search_slots, earliest_back, horizon,
                                                               horizon_off, passes):
    monkeypatch.setattr(selectors, "SUGGESTION_PASSES", passes)
    step = timedelta(minutes=slot)
    with transaction.atomic():
        pool, nodes = _pool(slot, states)
        base = slot_floor(timezone.now(), slot) + timedelta(days=2)
        taken = {i: [] for i in range(len(nodes))}
        for i, off, length, active in allocs:
            lo = base + step * off
            _block(nodes, taken, i % len(nodes), lo, lo + step * length, active=active)
        start = base + step * at
        end = start + step * hours
        search = step * search_slots
        # earliest at start, or before or after the search's far end; latest_end from the asked end
        # (a booking is within the horizon) to well past the search, off the grid too (now + horizon).
        earliest = start - step * earliest_back
        latest_end = end + step * horizon + timedelta(minutes=horizon_off)
        if earliest > start or hours > search_slots:
            transaction.set_rollback(True)
            return
        # Refused: one more node than are free at start, as _capacity_error is called.
        n = len(oracle.free_nodes(pool, start, end)) + 1 + extra
        got = selectors.suggest_windows(pool=pool, node_count=n, start=start, end=end, earliest=earliest,
                                        latest_end=latest_end, search=search)
        want = brute(pool, n, start, end, earliest=earliest, latest_end=latest_end, search=search)
        assert got == want, (got, want)
        transaction.set_rollback(True)


def test_windows_touching_earliest_and_latest_end_are_offered(db):
    """A fit that starts exactly at earliest, and one that ends exactly at latest_end, are suggested."""
    h = timedelta(hours=1)
    pool, nodes = _pool(60, ["available", "available", "draining"])
    base = slot_floor(timezone.now(), 60) + timedelta(days=2)
    taken = {i: [] for i in range(3)}
    # Both available nodes are blocked from base + 2 h to base + 10 h (one by maintenance), except
    # that node 0 is free at base + 4 h .. base + 6 h: asking for 2 nodes at base + 4 h is refused.
    _block(nodes, taken, 0, base + 2 * h, base + 4 * h)
    _block(nodes, taken, 0, base + 6 * h, base + 10 * h)
    _block(nodes, taken, 1, base + 2 * h, base + 10 * h)
    _block(nodes, taken, 2, base - 10 * h, base + 30 * h, active=False)  # released, and on a drained node
    start, end = base + 4 * h, base + 6 * h
    got = selectors.suggest_windows(pool=pool, node_count=2, start=start, end=end, earliest=base,
                                    latest_end=base + 12 * h, search=timedelta(days=1))
    assert got == [{"start": base, "end": base + 2 * h}, {"start": base + 10 * h, "end": base + 12 * h}]
    # One slot less on either side: nothing fits there.
    got = selectors.suggest_windows(pool=pool, node_count=2, start=start, end=end, earliest=base + h,
                                    latest_end=base + 12 * h - timedelta(minutes=1), search=timedelta(days=1))
    assert got == []
    # The drained node is not counted: three nodes never fit.
    assert selectors.suggest_windows(pool=pool, node_count=3, start=start, end=end, earliest=base,
                                     latest_end=base + 40 * h, search=timedelta(days=1)) == []


def _allocation_reads() -> tuple[int, int]:
    """(scans, rows read) of reservations_allocation by this transaction so far: sequential and index."""
    with connection.cursor() as cur:
        # The table's own counters are its sequential scans; each index's, its index scans.
        cur.execute("""
            SELECT sum(pg_stat_get_xact_numscans(c)), sum(pg_stat_get_xact_tuples_returned(c))
            FROM (SELECT 'reservations_allocation'::regclass::oid AS c
                  UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid = 'reservations_allocation'::regclass) x
        """)
        scans, rows = cur.fetchone()
    return int(scans), int(rows)


@pytest.mark.parametrize("hours, extra", [(4, 0), (24, 0), (8, 10_000)])
def test_suggestions_on_a_busy_pool_read_the_allocations_a_few_times_not_once_per_candidate_and_node(
        db, hours, extra):
    """60 nodes booked back to back for six weeks (~2,500 allocations, ~900 candidate starts).

    Before: every candidate start was scored by a NOT EXISTS probe per node, ~50,000 index scans of
    the allocations for one refusal (0.6-0.9 s on a 1,000-node pool). Now each of at most three
    passes reads the allocations once (one scan, or one per node where the planner joins node by
    node), each row at most once — also when nothing fits anywhere (extra: more nodes than the
    pool has). Before, the rows read were ~23 times the pool's allocations.
    """
    rng = random.Random(5)
    h = timedelta(hours=1)
    pool, nodes = _pool(60, ["available"] * 57 + ["draining"] * 3)
    base = slot_floor(timezone.now(), 60) + timedelta(days=1)
    rows = []
    for node in nodes:
        t = base - timedelta(days=3) + h * rng.randint(0, 12)
        while t < base + timedelta(days=40):
            length = h * rng.choice([2, 4, 8, 12, 24])
            rows.append(Allocation(node=node, period=DateTimeTZRange(t, t + length), kind="maintenance",
                                   note="busy"))
            t += length + h * rng.choice([0, 0, 1, 2, 5])
    Allocation.objects.bulk_create(rows, batch_size=2000)
    start = base + timedelta(days=12)
    end = start + h * hours
    n = len(oracle.free_nodes(pool, start, end)) + 1 + extra
    scans_before, read_before = _allocation_reads()
    selectors.suggest_windows(pool=pool, node_count=n, start=start, end=end, earliest=base,
                              latest_end=base + timedelta(days=365), search=timedelta(days=60))
    scans_after, read_after = _allocation_reads()
    scans, read = scans_after - scans_before, read_after - read_before
    assert scans <= 3 * (len(nodes) + 1), f"{scans} scans of the allocations for one refusal ({read} rows read)"
    assert read <= 3 * len(rows), f"{read} allocation rows read for one refusal; the pool has {len(rows)}"


def test_when_the_summary_rules_nothing_out_and_nothing_fits_the_allocations_are_still_read_a_few_times(db):
    """The worst case: 30 nodes each down one hour in six, staggered, past the whole search range.

    Every slot has 25 nodes free, so the per-slot bound lets every start through, but no 12-hour
    window has a single node free: every start is counted exactly, and nothing is found. Three
    passes, each reading the allocations once (before: a probe per start and per node).
    """
    h = timedelta(hours=1)
    pool, nodes = _pool(60, ["available"] * 30)
    base = slot_floor(timezone.now(), 60) + timedelta(days=1)
    rows = [Allocation(node=node, period=DateTimeTZRange(t, t + h), kind="maintenance", note="down")
            for i, node in enumerate(nodes)
            for t in (base - timedelta(days=1) + h * (i % 6 + 6 * k) for k in range(4 * 75))]
    Allocation.objects.bulk_create(rows, batch_size=2000)
    start = base + timedelta(days=12)
    scans_before, read_before = _allocation_reads()
    got = selectors.suggest_windows(pool=pool, node_count=1, start=start, end=start + 12 * h, earliest=base,
                                    latest_end=base + timedelta(days=365), search=timedelta(days=60))
    scans_after, read_after = _allocation_reads()
    scans, read = scans_after - scans_before, read_after - read_before
    assert got == []
    assert scans <= 3 * (len(nodes) + 1), f"{scans} scans of the allocations for one refusal ({read} rows read)"
    assert read <= 3 * len(rows), f"{read} allocation rows read for one refusal; the pool has {len(rows)}"


def _bound_cost(call):
    """Run call(); return (its answer, statements run, array elements bound to them, peak Python memory in bytes).

    Counts, not time: what suggest_windows hands PostgreSQL and what it builds in Python for it.
    """
    import tracemalloc

    statements, elements = [], 0

    def wrapper(execute, sql, params, many, context):
        nonlocal elements
        statements.append(sql)
        values = params.values() if isinstance(params, dict) else (params or ())
        elements += sum(len(v) for v in values if isinstance(v, list | tuple))
        return execute(sql, params, many, context)

    tracemalloc.start()
    try:
        with connection.execute_wrapper(wrapper):
            got = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return got, len(statements), elements, peak


def test_one_minute_slots_nothing_fits_costs_the_surviving_starts_not_every_minute_of_the_search(db):
    """1-minute slots, ±60 days, the per-slot summary rules nothing out and nothing fits.

    Two nodes, each down an hour every twelve hours, six hours apart: every minute has a node free, so
    every start passes the summary's bound, but no 24-hour window has one node free throughout. Before,
    suggest_windows built the grid in Python, a datetime per minute of the search (~172,800 of them, and
    a busy count per minute read back from the summary), and bound them all to the last pass as a
    timestamp array (1.5 s on a 30-node pool). Now the surviving starts travel as a few runs.
    """
    pool, nodes = _pool(1, ["available", "available"])
    h = timedelta(hours=1)
    base = slot_floor(timezone.now(), 60) + timedelta(days=1)
    rows = [Allocation(node=nodes[i], period=DateTimeTZRange(t, t + h), kind="maintenance", note="down")
            for i in range(2)
            for t in (base - timedelta(days=62) + 6 * h * i + 12 * h * k for k in range(2 * 125))]
    Allocation.objects.bulk_create(rows, batch_size=2000)
    start = base
    got, statements, elements, peak = _bound_cost(lambda: selectors.suggest_windows(
        pool=pool, node_count=1, start=start, end=start + 24 * h, earliest=start - timedelta(days=61),
        latest_end=start + timedelta(days=365), search=timedelta(days=60)))
    assert got == []
    assert elements <= 100, f"{elements} array elements bound for one refusal"
    assert peak <= 1_000_000, f"{peak} bytes of Python objects built for one refusal"
    assert statements <= 4


def _summary_scans() -> int:
    """Scans of the per-slot summary's tables (and their indexes) by this session so far."""
    with connection.cursor() as cur:
        cur.execute("""
            SELECT sum(pg_stat_get_xact_numscans(c)) FROM (
                SELECT indexrelid AS c FROM pg_index
                WHERE indrelid IN ('reservations_poolslotusage'::regclass, 'reservations_poolslotusagedelta'::regclass)
                UNION ALL SELECT 'reservations_poolslotusage'::regclass
                UNION ALL SELECT 'reservations_poolslotusagedelta'::regclass) x
        """)
        return int(cur.fetchone()[0])


def test_more_nodes_than_the_pool_has_available_answers_no_suggestion_at_once(db):
    """An empty pool of 30 available nodes (and a drained one), 1-minute slots, 31 nodes asked: no window can
    ever fit, so the answer is [] from one count, before any grid or summary (0.24-0.62 s before: the
    summary's 172,800 slots read back and the grid built in Python, to rule out every start)."""
    pool, _ = _pool(1, ["available"] * 30 + ["draining"])
    start = slot_floor(timezone.now(), 60) + timedelta(days=1)
    summary_scans = _summary_scans()
    got, statements, elements, peak = _bound_cost(lambda: selectors.suggest_windows(
        pool=pool, node_count=31, start=start, end=start + timedelta(hours=4), earliest=start - timedelta(days=1),
        latest_end=start + timedelta(days=365), search=timedelta(days=60)))
    assert got == []
    assert statements == 1 and elements == 0
    assert peak <= 200_000, f"{peak} bytes of Python objects built for a request that can never fit"
    assert _summary_scans() == summary_scans, "the per-slot summary was read"
    # 30 nodes still fit somewhere: suggestions are offered.
    assert selectors.suggest_windows(pool=pool, node_count=30, start=start, end=start + timedelta(hours=4),
                                     earliest=start - timedelta(days=1), latest_end=start + timedelta(days=365),
                                     search=timedelta(days=60)) != []
