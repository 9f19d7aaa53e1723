"""Booking rules as properties on random sequences of every booking operation, against the real database.

Each example runs in a savepoint that is rolled back; the brute-force oracles are in tests/booking_oracle.py.
"""
from datetime import timedelta

import pytest
from django.conf import settings as dj
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portal.core.exceptions import CapacityUnavailable, DomainError
from reservations import selectors, services
from reservations.choices import HOLDING_STATUSES
from reservations.models import Allocation, Node, Reservation
from reservations.timeutil import slot_floor
from tenants.models import Quota
from tenants.services import quota_update, tenant_update

from . import booking_oracle as oracle
from .conftest import make_world, now_clear_of_the_hour

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)

op = st.one_of(
    st.tuples(st.just("book"), st.sampled_from(["alpha", "beta"]), st.integers(1, 5), st.integers(0, 12),
              st.integers(1, 6)),
    st.tuples(st.just("update"), st.integers(0, 9), st.integers(-3, 3), st.integers(-3, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 9)),
    st.tuples(st.just("fail_res"), st.integers(0, 9)),
    st.tuples(st.just("complete"), st.integers(0, 9)),
    st.tuples(st.just("node"), st.integers(0, 4), st.sampled_from(["draining", "failed", "available"])),
    st.tuples(st.just("maint"), st.integers(0, 4), st.integers(0, 12), st.integers(1, 4)),
    st.tuples(st.just("quota"), st.sampled_from(["alpha", "beta"]), st.integers(0, 4), st.integers(0, 2),
              st.sampled_from([None, None, 3, 6])),
    st.tuples(st.just("burst"), st.sampled_from(["alpha", "beta"]), st.booleans()),
    st.tuples(st.just("probe"), st.integers(0, 12), st.integers(1, 4)),
)


def code(exc):
    return getattr(exc, "code", type(exc).__name__)


def check_invariants(world, base):
    pool = world.pool
    now = timezone.now()
    lo, hi = base, base + timedelta(hours=24)
    want = oracle.availability_per_slot(pool, lo, hi)
    got = [(s.start, s.end, s.free_nodes) for s in selectors.availability(pool=pool, start=lo, end=hi, step=H)]
    assert got == want, "summary availability disagrees with brute force"
    sweep = [s.free_nodes for s in selectors.availability(pool=pool, start=lo, end=hi, step=3 * H)]
    assert sweep == [len(oracle.free_nodes(pool, lo + 3 * H * i, lo + 3 * H * (i + 1))) for i in range(8)]
    # Every holding reservation still to run holds node_count - missing_nodes nodes for the rest of its window.
    for r in Reservation.objects.filter(pool=pool, status__in=HOLDING_STATUSES, period__endswith__gt=now):
        allocs = list(r.allocations.filter(active=True))
        assert len(allocs) == r.node_count - r.missing_nodes, (r.pk, len(allocs), r.node_count, r.missing_nodes)
        for a in allocs:
            assert a.period.upper == r.period.upper
            assert a.period.lower >= r.period.lower
            assert a.node.pool_id == pool.pk
    # Cancelled / failed reservations hold nothing.
    assert not Allocation.objects.filter(active=True, reservation__status__in=["cancelled", "failed"]).exists()
    # No future allocation of a booking on a node out of service after its bookings were moved.
    for a in Allocation.objects.filter(active=True, kind="reservation", period__endswith__gt=now,
                                       reservation__status__in=HOLDING_STATUSES).exclude(
            node__state="available"):
        raise AssertionError(f"allocation {a.pk} on {a.node.state} node {a.node.hostname}")


def run_ops(world, ops):
    base = slot_floor(now_clear_of_the_hour(120), 60)
    staff = world.users["staff"]
    pool = world.pool
    created = []
    for o in ops:
        kind = o[0]
        if kind == "book":
            _, slug, n, off, hours = o
            tenant = world.tenants[slug]
            start, end = base + off * H, base + (off + hours) * H
            quota = Quota.objects.filter(tenant=tenant, pool=pool).first()
            tenant.refresh_from_db()
            expect = oracle.classify(quota, tenant.burst_enabled, None, n, start, end, tenant, pool)
            if n > Node.objects.filter(pool=pool).exclude(state="retired").count():
                expect = "invalid"
            elif expect != "quota_exceeded" and len(oracle.free_nodes(pool, start, end)) < n:
                expect = "capacity_unavailable"
            try:
                r = services.reservation_create(actor=world.users[f"{slug}-lead"], tenant=tenant, pool=pool,
                                                node_count=n, start=start, end=end)
                got = r.billing
                created.append(r.pk)
            except DomainError as exc:
                got = code(exc)
            assert got == expect, (o, got, expect)
        elif kind == "update":
            _, i, dstart, dend = o
            if not created:
                continue
            r = Reservation.objects.select_related("tenant").get(pk=created[i % len(created)])
            now = timezone.now()
            started = r.period.lower <= now
            new_start = r.period.lower if started else r.period.lower + dstart * H
            new_end = r.period.upper + dend * H
            mine = sorted(r.allocations.filter(active=True).values_list("node_id", flat=True))
            own_free = True
            before = (r.period, r.billing, sorted(r.allocations.filter(active=True).values_list("node_id", "period")))
            # The expected outcome, from the rules (DESIGN §4: the same rules as booking).
            if r.status in ("completed", "cancelled", "failed", "ending"):
                expect = "invalid_state"
            elif new_end <= new_start or (not started and new_start < base) or new_end <= now:
                expect = "invalid"
            elif (new_start, new_end) == (r.period.lower, r.period.upper):
                expect = r.billing
            else:
                quota = Quota.objects.filter(tenant=r.tenant, pool=pool).first()
                r.tenant.refresh_from_db()
                if r.period.lower <= new_start and new_end <= r.period.upper:
                    # Never refused (gives nodes back), but classified by the same rule (DESIGN §4).
                    fits = quota is not None and oracle.peak(r.tenant, pool, new_start, new_end, exclude=r.pk) \
                        + r.node_count <= quota.max_nodes
                    expect = "committed" if fits else r.billing
                else:
                    expect = oracle.classify(quota, r.tenant.burst_enabled, r.pk, r.node_count, new_start, new_end,
                                             r.tenant, pool)
                if expect != "quota_exceeded":
                    free = oracle.free_nodes(pool, new_start, new_end, exclude_reservation=r.pk)
                    own_free = all(nid in free for nid in mine)
                    if not own_free and (started or len(free) < r.node_count):
                        expect = "capacity_unavailable"
            try:
                services.reservation_update(actor=staff, reservation=r, start=new_start, end=new_end)
                got = "ok"
            except DomainError as exc:
                got = code(exc)
            r.refresh_from_db()
            after = (r.period, r.billing, sorted(r.allocations.filter(active=True).values_list("node_id", "period")))
            if got != "ok":
                assert after == before, "a refused change changed something"
                assert got == expect, (o, got, expect)
            else:
                assert r.billing == expect, (o, r.billing, expect)
                if own_free:
                    assert sorted(r.allocations.filter(active=True).values_list("node_id", flat=True)) == mine
        elif kind == "complete":
            if created:
                rid = created[o[1] % len(created)]
                services.reservation_set_status(reservation_id=rid, status="ending",
                                                expected=("confirmed", "provisioning", "active"))
                services.reservation_set_status(reservation_id=rid, status="completed", expected=("ending",))
        elif kind == "cancel":
            if created:
                r = Reservation.objects.get(pk=created[o[1] % len(created)])
                try:
                    services.reservation_cancel(actor=staff, reservation=r)
                except DomainError:
                    pass
        elif kind == "fail_res":
            if created:
                services.reservation_set_status(reservation_id=created[o[1] % len(created)], status="failed",
                                                expected=tuple(HOLDING_STATUSES))
        elif kind == "node":
            _, i, state = o
            node = world.nodes[i % len(world.nodes)]
            services.node_update(actor=staff, node=node, state=state)
            if state != "available":
                services.node_replace_allocations(node=node, actor=staff, reason="test")
        elif kind == "maint":
            _, i, off, hours = o
            node = world.nodes[i % len(world.nodes)]
            node.refresh_from_db()
            start, end = base + off * H, base + (off + hours) * H
            clash = Allocation.objects.filter(node=node, active=True, period__overlap=(start, end)).exists()
            try:
                services.maintenance_window_create(actor=staff, node=node, start=start, end=end)
                got = "ok"
            except CapacityUnavailable:
                got = "busy"
            assert got == ("busy" if clash else "ok")
        elif kind == "quota":
            _, slug, mx, burst, dur = o
            q = Quota.objects.get(tenant=world.tenants[slug], pool=pool)
            quota_update(actor=staff, quota=q, max_nodes=mx, burst_nodes=burst, max_duration_hours=dur)
        elif kind == "burst":
            _, slug, on = o
            world.tenants[slug] = tenant_update(actor=staff, tenant=world.tenants[slug], burst_enabled=on)
        elif kind == "probe":
            _, off, hours = o
            start, end = base + off * H, base + (off + hours) * H
            (slot,) = selectors.availability(pool=pool, start=start, end=end, step=end - start)
            n = slot.free_nodes
            assert n == len(oracle.free_nodes(pool, start, end))
            Quota.objects.filter(tenant=world.tenants["beta"]).update(max_nodes=99, max_duration_hours=None)
            try:
                with outer():
                    if n:
                        services.reservation_create(actor=staff, tenant=world.tenants["beta"], pool=pool,
                                                    node_count=n, start=start, end=end)
                    total = Node.objects.filter(pool=pool).exclude(state="retired").count()
                    if n + 1 <= total:
                        with pytest.raises(CapacityUnavailable) as info:
                            services.reservation_create(actor=staff, tenant=world.tenants["beta"], pool=pool,
                                                        node_count=n + 1, start=start, end=end)
                        sugg = [{"start": parse_datetime(s["start"]), "end": parse_datetime(s["end"])}
                                for s in info.value.extra["suggestions"]]
                        for s in sugg:  # bookable at once
                            assert len(oracle.free_nodes(pool, s["start"], s["end"])) >= n + 1
                        expect = oracle.brute_suggestions(pool, n + 1, start, end, dj.PORTAL_SUGGESTION_SEARCH_DAYS,
                                                          dj.PORTAL_BOOKING_HORIZON_DAYS)
                        assert sugg == expect, (sugg, expect)
                    raise _Rollback
            except _Rollback:
                pass
        check_invariants(world, base)


def outer():
    """A savepoint that durable service blocks may nest in (as inside a TestCase)."""
    a = transaction.atomic()
    a._from_testcase = True
    return a


class _Rollback(Exception):
    pass


@pytest.fixture
def world5(db):
    return make_world(nodes=5, max_nodes=3, burst_nodes=1, burst_enabled=True)


@settings(max_examples=int(__import__("os").environ.get("BOOKING_PROPERTY_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=12))
def test_random_operation_sequences(world5, ops):
    try:
        with outer():
            for t in world5.tenants.values():
                t.refresh_from_db()
            for n in world5.nodes:
                n.refresh_from_db()
            run_ops(world5, ops)
            raise _Rollback
    except _Rollback:
        pass
