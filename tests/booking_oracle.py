"""Brute-force oracles over the database rows, for tests/test_booking_properties.py."""
from datetime import timedelta

from django.utils import timezone

from reservations.choices import HOLDING_STATUSES
from reservations.models import Allocation, Node, Reservation
from reservations.timeutil import slot_floor

H = timedelta(hours=1)


def free_nodes(pool, start, end, exclude_reservation=None):
    busy = set(Allocation.objects.filter(node__pool=pool, active=True, period__overlap=(start, end))
               .exclude(reservation_id=exclude_reservation or -1).values_list("node_id", flat=True))
    return [n.pk for n in Node.objects.filter(pool=pool, state="available") if n.pk not in busy]


def peak(tenant, pool, start, end, exclude=None):
    # What the tenant holds: open reservations, and ones ended early that keep their nodes (active rows).
    rs = [r for r in Reservation.objects.filter(tenant=tenant, pool=pool)
          if r.pk != exclude and r.period.lower < end and start < r.period.upper
          and (r.status in HOLDING_STATUSES
               or r.allocations.filter(active=True, period__overlap=(start, end)).exists())]
    points = {start} | {r.period.lower for r in rs if r.period.lower > start}
    return max([sum(r.node_count for r in rs if r.period.lower <= t < r.period.upper) for t in points] or [0])


def classify(quota, burst_enabled, pk, n, start, end, tenant, pool):
    if quota is None:
        return "quota_exceeded"
    if quota.max_duration_hours is not None and (end - start) / H > quota.max_duration_hours:
        return "quota_exceeded"
    p = peak(tenant, pool, start, end, exclude=pk)
    if p + n <= quota.max_nodes:
        return "committed"
    if burst_enabled and p + n <= quota.max_nodes + quota.burst_nodes:
        return "burst"
    return "quota_exceeded"


def availability_per_slot(pool, start, end):
    out = []
    t = start
    step = timedelta(minutes=pool.slot_minutes)
    while t < end:
        out.append((t, t + step, len(free_nodes(pool, t, t + step))))
        t += step
    return out


def brute_suggestions(pool, n, start, end, search_days, horizon_days):
    now = timezone.now()
    step = timedelta(minutes=pool.slot_minutes)
    dur = end - start
    earliest = slot_floor(now, pool.slot_minutes)
    latest_end = now + timedelta(days=horizon_days)
    lo = max(earliest, start - timedelta(days=search_days))
    hi = start + timedelta(days=search_days)
    before = after = None
    if Node.objects.filter(pool=pool, state="available").count() < n:
        return []
    t = start - step
    while t >= lo:
        if t + dur <= latest_end and len(free_nodes(pool, t, t + dur)) >= n:
            before = t
            break
        t -= step
    t = start + step
    while t <= hi and t + dur <= latest_end:
        if len(free_nodes(pool, t, t + dur)) >= n:
            after = t
            break
        t += step
    return [{"start": s, "end": s + dur} for s in (before, after) if s is not None]
