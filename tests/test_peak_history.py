"""The booking hot path's peak statement never reads the tenant's history of completed reservations.

Reservations torn down early count while their allocations are active; they are found from the active
allocations in the window (GiST index), not by an OR on status that made every booking, under the quota
lock, scan every completed reservation ever made (0.35 ms -> 220 ms at 60k rows)."""
import json
from datetime import timedelta

import pytest
from django.db import connection

from reservations import selectors
from reservations.choices import HOLDING_STATUSES
from reservations.services import reservation_create, reservation_set_status
from reservations.timeutil import slot_floor

from .conftest import now_clear_of_the_hour
from .plans import rows_read

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)
HISTORY = 3000


def add_completed_history(tenant, pool, t0) -> None:
    """HISTORY finished one-hour bookings of tenant in pool, ending two days before t0 (a year of them)."""
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO reservations_reservation (tenant_id, pool_id, node_count, period, name, status, status_reason,"
            " missing_nodes, billing, orchestrator, cuda_version, created_at, updated_at)"
            " SELECT %s, %s, 1, tstzrange(%s - g * interval '1 hour', %s - (g - 1) * interval '1 hour'), '',"
            " 'completed', '', 0, 'committed', 'slurm', '12.4', now(), now() FROM generate_series(2, %s) g",
            [tenant.pk, pool.pk, t0 - 48 * H, t0 - 48 * H, HISTORY + 1])
        cur.execute("ANALYZE reservations_reservation")


def test_peak_does_not_read_completed_history(world, t0):
    tenant, pool = world.tenants["alpha"], world.pool
    add_completed_history(tenant, pool, t0)
    reservation_create(actor=world.users["alpha-lead"], tenant=tenant, pool=pool, node_count=1, start=t0,
                       end=t0 + 2 * H)
    params = {"tenant": tenant.pk, "pool": pool.pk, "start": t0, "end": t0 + 4 * H,
              "statuses": list(HOLDING_STATUSES), "exclude": 0}
    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + selectors._PEAK_ONE_POOL_SQL, params)
        plan = cur.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read = rows_read(plan[0]["Plan"], "reservations_reservation")
    assert read < 100, f"the peak read {read} reservation rows for a tenant holding 1 booking"
    assert selectors.tenant_peak_usage(tenant_id=tenant.pk, pool_id=pool.pk, start=t0, end=t0 + 4 * H) == 1


def test_early_teardown_still_counts_after_rewrite(world):
    """What the OR was for (booking rule 1) still holds: a completed booking with active allocations counts."""
    now_slot = slot_floor(now_clear_of_the_hour(), 60)
    r = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=2, start=now_slot, end=now_slot + 4 * H)
    reservation_set_status(reservation_id=r.pk, status="ending", expected=("confirmed",))
    reservation_set_status(reservation_id=r.pk, status="completed", expected=("ending",))
    assert selectors.tenant_peak_usage(tenant_id=r.tenant_id, pool_id=r.pool_id, start=now_slot + H,
                                       end=now_slot + 2 * H) == 2
    assert selectors.tenant_peak_usage_by_pool(tenant_id=r.tenant_id, start=now_slot + H,
                                               end=now_slot + 2 * H) == {r.pool_id: 2}


def test_the_booking_reads_the_peak_with_the_rights_and_the_same_figure(world, t0):
    """The booking reads the peak in its rights statement (after the quota lock): the figure tenant_peak_usage
    gives, early-completed bookings included, its own booking left out when asked, and no history read."""
    from reservations import services

    tenant, pool, lead = world.tenants["alpha"], world.pool, world.users["alpha-lead"]
    add_completed_history(tenant, pool, t0)
    first = reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=2, start=t0, end=t0 + 2 * H)
    reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=1, start=t0 + H, end=t0 + 3 * H)
    for actor in (lead, world.users["staff"]):
        for exclude in (None, first.pk):
            got = services._rights_and_peak(actor=actor, tenant=tenant, pool=pool, start=t0, end=t0 + 4 * H,
                                            exclude_reservation_id=exclude, owner_id=None)
            want = selectors.tenant_peak_usage(tenant_id=tenant.pk, pool_id=pool.pk, start=t0, end=t0 + 4 * H,
                                               exclude_reservation_id=exclude)
            assert got == (True, want) and want == (1 if exclude else 3)
    assert services._rights_and_peak(actor=lead, tenant=tenant, pool=pool, start=t0 + 10 * H, end=t0 + 11 * H,
                                     exclude_reservation_id=None, owner_id=None) == (True, 0)
    params = {**selectors.peak_params(tenant_id=tenant.pk, pool_id=pool.pk, start=t0, end=t0 + 4 * H),
              "actor": lead.pk}
    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + services._RIGHTS_SQL, params)
        plan = cur.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read = rows_read(plan[0]["Plan"], "reservations_reservation")
    assert read < 100, f"the booking's rights-and-peak statement read {read} reservation rows"
