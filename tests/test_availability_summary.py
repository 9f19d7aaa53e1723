"""The per-slot availability summary (migration 0006) stays exact: random writes, rebuilds, races.

After every kind of write — allocations on and off the slot grid, period changes, deactivation,
deletes, node state changes and pool moves, a pool's slot length changing — with and without
compaction in between, the summary (busy + pending deltas) must equal a brute-force count from
the allocations and a full rebuild, and availability() must answer from it.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

from portal.core.exceptions import CapacityUnavailable, QuotaExceeded
from reservations import selectors
from reservations.models import Allocation, Node, Pool, PoolSlotUsage, PoolSlotUsageDelta, Reservation
from reservations.selectors import availability
from reservations.services import reservation_cancel, reservation_create, slot_usage_compact, slot_usage_rebuild
from reservations.timeutil import EPOCH
from tenants.models import Membership, Quota, Tenant

from .conftest import availability_statements

MICRO = timedelta(microseconds=1)
STATES = ["available", "available", "available", "draining", "failed"]


# --- oracles --------------------------------------------------------------------------------


def _slot_range(lo, hi, slot_s: int) -> range:
    """Slot numbers an allocation [lo, hi) touches on a grid of slot_s seconds."""
    step = slot_s * 1_000_000
    lo_us, hi_us = (lo - EPOCH) // MICRO, (hi - EPOCH) // MICRO
    return range(lo_us // step, -(-hi_us // step))


def oracle(pool: Pool) -> dict:
    """{slot start: distinct available nodes of pool with an active allocation touching it}, brute force."""
    pool.refresh_from_db()
    slot_s = pool.slot_minutes * 60
    busy: dict[int, set[int]] = defaultdict(set)
    for node_id, period in Allocation.objects.filter(active=True, node__pool=pool, node__state="available") \
            .values_list("node_id", "period"):
        for k in _slot_range(period.lower, period.upper, slot_s):
            busy[k].add(node_id)
    return {EPOCH + timedelta(seconds=k * slot_s): len(nodes) for k, nodes in busy.items()}


def summary(pool: Pool) -> dict:
    """{slot start: busy + pending deltas} as the summary holds it, zero slots left out."""
    with connection.cursor() as cur:
        cur.execute("""
            SELECT slot, sum(busy) FROM (
                SELECT slot, busy FROM reservations_poolslotusage WHERE pool_id = %(p)s
                UNION ALL
                SELECT slot, delta FROM reservations_poolslotusagedelta WHERE pool_id = %(p)s
            ) x GROUP BY slot HAVING sum(busy) <> 0
        """, {"p": pool.pk})
        return dict(cur.fetchall())


class _Undo(Exception):
    pass


def rebuilt(pool: Pool) -> dict:
    """The summary a full rebuild writes (in a transaction or savepoint that is rolled back)."""
    try:
        with transaction.atomic():
            slot_usage_rebuild(pool_id=pool.pk)
            result = summary(pool)
            raise _Undo
    except _Undo:
        return result


def free_by_brute_force(pool: Pool, start, end, step) -> list[tuple]:
    available = list(Node.objects.filter(pool=pool, state="available").values_list("id", flat=True))
    allocations = list(Allocation.objects.filter(active=True, node_id__in=available).values_list("node_id", "period"))
    out, cur = [], start
    while cur < end:
        nxt = min(cur + step, end)
        busy = {n for n, p in allocations if p.lower < nxt and cur < p.upper}
        out.append((cur, nxt, len(available) - len(busy)))
        cur = nxt
    return out


def assert_exact(*pools: Pool) -> None:
    for pool in pools:
        expected = oracle(pool)
        assert summary(pool) == expected, pool.name
        assert rebuilt(pool) == expected, pool.name


# --- random writes --------------------------------------------------------------------------

OFFSETS = [0, 0, 0, 0, 5, 20, 30, 45]  # minutes past the hour: most on the grid, some not


class Fleet:
    """Two pools (60- and 15-minute slots), nodes in all states, and random writes to them."""

    def __init__(self, rng: random.Random, t0) -> None:
        self.rng, self.t0 = rng, t0
        self.pools = [Pool.objects.create(name="sa", gpu_model="H100", gpus_per_node=8, slot_minutes=60),
                      Pool.objects.create(name="sb", gpu_model="A100", gpus_per_node=8, slot_minutes=15)]
        self.nodes = [Node.objects.create(hostname=f"s{i}", pool=self.pools[i % 2], state=rng.choice(STATES))
                      for i in range(7)]

    def period(self) -> DateTimeTZRange:
        rng = self.rng
        lo = self.t0 + timedelta(hours=rng.randint(0, 20), minutes=rng.choice(OFFSETS))
        hi = lo + timedelta(minutes=rng.choice([5, 10, 25, 60, 60, 120, 180, 300, 600]))
        if rng.random() < 0.5:  # end on the grid
            hi = self.t0 + timedelta(hours=-(-(hi - self.t0) // timedelta(hours=1)))
        return DateTimeTZRange(lo, hi, "[)")

    def some_allocations(self, k: int) -> list[Allocation]:
        ids = list(Allocation.objects.order_by("id").values_list("id", flat=True))
        return list(Allocation.objects.filter(id__in=self.rng.sample(ids, min(k, len(ids)))))

    def step(self) -> str:
        rng = self.rng
        op = rng.choices(["insert", "bulk_insert", "period", "active", "delete", "bulk_delete", "move_alloc",
                          "node_state", "node_pool", "slot_minutes", "compact"],
                         weights=[25, 10, 12, 10, 6, 3, 4, 8, 5, 2, 10])[0]
        try:
            with transaction.atomic():  # an exclusion violation undoes only this step
                getattr(self, f"_{op}")()
        except IntegrityError:
            return f"{op} (refused)"
        return op

    def _insert(self) -> None:
        Allocation.objects.create(node=self.rng.choice(self.nodes), period=self.period(), kind="maintenance",
                                  active=self.rng.random() < 0.85)

    def _bulk_insert(self) -> None:
        # One statement, several rows: adjacent pieces of one node inside one slot, or several nodes.
        node = self.rng.choice(self.nodes)
        lo = self.t0 + timedelta(hours=self.rng.randint(0, 20))
        if self.rng.random() < 0.5:
            cuts = sorted(self.rng.sample(range(1, 60), 3))
            rows = [Allocation(node=node, kind="maintenance",
                               period=DateTimeTZRange(lo + timedelta(minutes=a), lo + timedelta(minutes=b), "[)"))
                    for a, b in ((0, cuts[0]), (cuts[1], cuts[2]))]
        else:
            period = self.period()
            rows = [Allocation(node=n, period=period, kind="maintenance") for n in self.rng.sample(self.nodes, 3)]
        Allocation.objects.bulk_create(rows)

    def _period(self) -> None:
        for a in self.some_allocations(1):
            a.period = self.period() if self.rng.random() < 0.6 else DateTimeTZRange(
                a.period.lower, a.period.upper + timedelta(minutes=self.rng.choice([-5, 15, 60, 90])), "[)")
            if a.period.upper > a.period.lower:
                a.save(update_fields=["period"])

    def _active(self) -> None:
        ids = [a.pk for a in self.some_allocations(self.rng.randint(1, 3))]
        Allocation.objects.filter(id__in=ids).update(active=self.rng.random() < 0.4)

    def _delete(self) -> None:
        for a in self.some_allocations(1):
            a.delete()

    def _bulk_delete(self) -> None:
        Allocation.objects.filter(node=self.rng.choice(self.nodes)).delete()

    def _move_alloc(self) -> None:
        Allocation.objects.filter(id__in=[a.pk for a in self.some_allocations(1)]).update(
            node=self.rng.choice(self.nodes))

    def _node_state(self) -> None:
        node = self.rng.choice(self.nodes)
        node.state = self.rng.choice([s for s in STATES if s != node.state])
        node.save()

    def _node_pool(self) -> None:
        node = self.rng.choice(self.nodes)
        node.pool = self.pools[1] if node.pool_id == self.pools[0].pk else self.pools[0]
        node.save()

    def _slot_minutes(self) -> None:
        pool = self.rng.choice(self.pools)
        pool.refresh_from_db()
        pool.slot_minutes = self.rng.choice([m for m in (15, 30, 60) if m != pool.slot_minutes])
        pool.save()

    def _compact(self) -> None:
        slot_usage_compact(batch=self.rng.choice([1, 7, 50_000]))


@pytest.mark.django_db
@pytest.mark.parametrize("seed", range(6))
def test_random_writes_keep_the_summary_exact(t0, seed):
    fleet = Fleet(random.Random(seed), t0)
    done = []
    for i in range(70):
        done.append(fleet.step())
        if i % 5 == 4:
            for pool in fleet.pools:
                assert summary(pool) == oracle(pool), (seed, done)
    assert_exact(*fleet.pools)
    assert Allocation.objects.filter(active=True).exists()
    slot_usage_compact()
    assert not PoolSlotUsageDelta.objects.exists()
    assert_exact(*fleet.pools)


@pytest.mark.django_db
@pytest.mark.parametrize("seed", range(3))
def test_availability_answers_from_the_summary_like_the_sweep(t0, seed):
    fleet = Fleet(random.Random(100 + seed), t0)
    for _ in range(40):
        fleet.step()
    for pool in fleet.pools:
        pool.refresh_from_db()
        step = timedelta(minutes=pool.slot_minutes)
        for offset_slots, compact in ((0, False), (3, True)):
            if compact:
                slot_usage_compact()
            start = t0 + step * offset_slots - timedelta(hours=1)
            end = start + timedelta(hours=24)
            with availability_statements() as seen:
                got = [(s.start, s.end, s.free_nodes) for s in availability(pool=pool, start=start, end=end,
                                                                            step=step)]
            assert seen == [selectors.AVAILABILITY_SUMMARY_SQL]
            assert got == free_by_brute_force(pool, start, end, step)


@pytest.mark.django_db
def test_off_grid_windows_and_wide_steps_take_the_sweep(t0):
    pool = Pool.objects.create(name="p", gpu_model="H100", gpus_per_node=8, slot_minutes=30)
    nodes = [Node.objects.create(hostname=f"n{i}", pool=pool) for i in range(3)]
    Allocation.objects.create(node=nodes[0], kind="maintenance",
                              period=DateTimeTZRange(t0 + timedelta(minutes=10), t0 + timedelta(minutes=70), "[)"))
    cases = [
        (t0, t0 + timedelta(hours=3), timedelta(hours=1)),      # a step of two slots
        (t0 + timedelta(minutes=15), t0 + timedelta(hours=2, minutes=15), timedelta(minutes=30)),  # off the grid
        (t0, t0 + timedelta(minutes=100), timedelta(minutes=30)),  # a partial last slot
    ]
    for start, end, step in cases:
        with availability_statements() as seen:
            got = [(s.start, s.end, s.free_nodes) for s in availability(pool=pool, start=start, end=end, step=step)]
        assert got == free_by_brute_force(pool, start, end, step)
        assert seen[-1] in (selectors.AVAILABILITY_GRID_SQL, selectors.AVAILABILITY_EXACT_SQL)


@pytest.mark.django_db
def test_truncate_clears_the_summary(t0):
    fleet = Fleet(random.Random(5), t0)
    for _ in range(30):
        fleet.step()
    slot_usage_compact()
    Allocation.objects.create(node=Node.objects.create(hostname="late", pool=fleet.pools[0]), kind="maintenance",
                              period=DateTimeTZRange(t0 + timedelta(days=9), t0 + timedelta(days=10), "[)"))
    assert PoolSlotUsage.objects.exists() and PoolSlotUsageDelta.objects.exists()
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # TRUNCATE refuses pending (deferred FK) trigger events
        cur.execute("TRUNCATE reservations_allocation")
    assert not PoolSlotUsage.objects.exists() and not PoolSlotUsageDelta.objects.exists()
    fleet._bulk_insert()
    assert_exact(*fleet.pools)


@pytest.mark.django_db
def test_a_write_appends_one_delta_row_per_slot_and_never_updates_a_counter(t0):
    pool = Pool.objects.create(name="p", gpu_model="H100", gpus_per_node=8)
    nodes = [Node.objects.create(hostname=f"n{i}", pool=pool) for i in range(4)]
    period = DateTimeTZRange(t0, t0 + timedelta(hours=5), "[)")
    Allocation.objects.bulk_create([Allocation(node=n, period=period, kind="maintenance") for n in nodes])
    deltas = list(PoolSlotUsageDelta.objects.order_by("slot").values_list("slot", "delta"))
    assert deltas == [(t0 + timedelta(hours=h), 4) for h in range(5)]
    assert not PoolSlotUsage.objects.exists()
    assert slot_usage_compact() == 5
    assert list(PoolSlotUsage.objects.order_by("slot").values_list("busy", flat=True)) == [4] * 5


@pytest.mark.django_db
def test_the_beat_task_folds_the_deltas_in(t0):
    from reservations.tasks import slot_usage_compact_task

    pool = Pool.objects.create(name="p", gpu_model="H100", gpus_per_node=8)
    node = Node.objects.create(hostname="n1", pool=pool)
    Allocation.objects.create(node=node, kind="maintenance",
                              period=DateTimeTZRange(t0, t0 + timedelta(hours=3), "[)"))
    assert slot_usage_compact_task.apply().get() == 3
    assert slot_usage_compact_task.apply().get() == 0
    assert summary(pool) == oracle(pool) == {t0 + timedelta(hours=h): 1 for h in range(3)}


@pytest.mark.django_db
def test_rebuild_command_repairs_and_checks(t0):
    from django.core.management import CommandError, call_command

    fleet = Fleet(random.Random(9), t0)
    for _ in range(30):
        fleet.step()
    call_command("rebuild_slot_usage", "--check", verbosity=0)
    PoolSlotUsageDelta.objects.create(pool=fleet.pools[0], slot=t0, delta=3)  # drift
    with pytest.raises(CommandError):
        call_command("rebuild_slot_usage", "--check", verbosity=0)
    call_command("rebuild_slot_usage", verbosity=0)
    call_command("rebuild_slot_usage", "--check", verbosity=0)
    assert_exact(*fleet.pools)


@pytest.mark.django_db
def test_rebuild_command_counts_in_words(t0):
    """Its lines said "slot(s)" and "pool(s)": one pool, one drifted slot read as such now."""
    import io

    from django.core.management import CommandError, call_command

    pool = Pool.objects.create(name="solo", gpu_model="H100", gpus_per_node=8, slot_minutes=60)
    out = io.StringIO()
    call_command("rebuild_slot_usage", "--check", stdout=out)
    assert out.getvalue() == "rebuild_slot_usage: no drift in 1 pool\n"
    PoolSlotUsageDelta.objects.create(pool=pool, slot=t0, delta=3)  # drift in one slot
    with pytest.raises(CommandError, match=r"^1 slot drifted; run without --check to rebuild\.$"):
        call_command("rebuild_slot_usage", "--check", stdout=io.StringIO())
    node = Node.objects.create(hostname="solo-1", pool=pool)
    Allocation.objects.create(node=node, kind="maintenance", period=DateTimeTZRange(t0, t0 + timedelta(hours=1), "[)"))
    out = io.StringIO()
    call_command("rebuild_slot_usage", stdout=out)
    assert out.getvalue() == "rebuild_slot_usage: 1 slot row in 1 pool, 0 pending deltas compacted since\n"


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["h1\x0000", "h100\udcff"], ids=["NUL", "not UTF-8 (a byte from the shell)"])
def test_rebuild_command_refuses_an_unstorable_pool_name_with_a_message(name):
    # --pool went straight into the query: psycopg's DataError / UnicodeEncodeError traceback, not a message.
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--pool"):
        call_command("rebuild_slot_usage", "--pool", name, verbosity=0)


# --- races ----------------------------------------------------------------------------------


def run_threads(fns) -> list:
    """Run each fn in its own thread with its own connection, all released at once; return results."""
    barrier = threading.Barrier(len(fns))
    results: list = [None] * len(fns)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fns[i]()
        except BaseException as exc:  # collected and asserted on by the caller
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def repeatedly(fn, stop: threading.Event) -> int:
    runs = 0
    while not stop.is_set():
        fn()
        runs += 1
        time.sleep(0.005)
    return runs


@pytest.mark.django_db(transaction=True)
def test_racing_bookings_cancels_node_changes_and_compactions_keep_the_summary_exact(t0):
    pool = Pool.objects.create(name="race", gpu_model="H100-SXM", gpus_per_node=8)
    nodes = [Node.objects.create(hostname=f"race-{i}", pool=pool) for i in range(10)]
    User = get_user_model()
    leads = []
    for i in range(8):
        tenant = Tenant.objects.create(slug=f"t{i}", name=f"T{i}")
        Quota.objects.create(tenant=tenant, pool=pool, max_nodes=10)
        user = User.objects.create_user(username=f"lead{i}")
        Membership.objects.create(user=user, tenant=tenant, role="lead")
        leads.append((tenant, user))
    stop = threading.Event()

    def booker(i: int):
        def run():
            tenant, user = leads[i]
            rng = random.Random(i)
            booked = refused = 0
            for _ in range(6):
                offset, hours, n = rng.randint(0, 8), rng.randint(1, 4), rng.randint(1, 3)
                try:
                    r = reservation_create(actor=user, tenant=tenant, pool=pool, node_count=n,
                                           start=t0 + timedelta(hours=offset),
                                           end=t0 + timedelta(hours=offset + hours))
                    booked += 1
                    if rng.random() < 0.3:
                        reservation_cancel(actor=user, reservation=r)
                except (CapacityUnavailable, QuotaExceeded):
                    refused += 1
            return booked, refused
        return run

    def flip_nodes():
        rng = random.Random(99)

        def flip():
            with transaction.atomic():
                node = Node.objects.select_for_update().get(pk=rng.choice(nodes).pk)
                node.state = "draining" if node.state == "available" else "available"
                node.save()
        return repeatedly(flip, stop)

    def off_grid(node_index: int, minute: int):
        # Adjacent off-grid pieces of one slot on one node, from different transactions at once:
        # without the per-node advisory lock each would count the node as newly busy.
        def run():
            lo = t0 + timedelta(hours=30, minutes=minute)
            Allocation.objects.create(node=nodes[node_index], kind="maintenance",
                                      period=DateTimeTZRange(lo, lo + timedelta(minutes=10), "[)"))
            return "off-grid"
        return run

    bookers = [booker(i) for i in range(8)]
    pieces = [off_grid(i % 2, 10 * (i // 2)) for i in range(8)]  # 4 pieces on each of two nodes
    helpers = [lambda: repeatedly(slot_usage_compact, stop), flip_nodes]

    def main_work():
        try:
            return run_threads(bookers + pieces)
        finally:
            stop.set()

    results = run_threads([main_work, *helpers])
    work, compactions, flips = results
    assert not isinstance(work, BaseException), work
    assert all(isinstance(r, tuple | str) for r in work), work
    assert sum(r[0] for r in work[:8]) > 0
    assert compactions > 1 and flips > 1, results
    assert Reservation.objects.exists()
    assert_exact(pool)
    slot_usage_compact()
    assert_exact(pool)
    nodes[0].refresh_from_db()
    assert summary(pool).get(t0 + timedelta(hours=30), 0) == sum(
        1 for n in Node.objects.filter(pk__in=[nodes[0].pk, nodes[1].pk]) if n.state == "available")
