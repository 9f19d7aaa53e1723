"""A failing check's node swap racing real bookings on the real database never double-books."""

from __future__ import annotations

from datetime import timedelta

import pytest

from portal.core.exceptions import CapacityUnavailable
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.runner import SimulatedFleet
from provisioning.health.services import health_check_record
from reservations.models import Allocation, Node, Pool, Reservation
from reservations.services import reservation_create
from tests.test_races import overlapping_allocations, run_threads, tenants_with_leads

BOOKERS = 10


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("spares", [1, 4])
def test_failing_check_swap_racing_bookings_never_double_books(spares, eager, tomorrow):
    pool = Pool.objects.create(name="race-h100", gpu_model="H100-SXM", gpus_per_node=8)
    nodes = [Node.objects.create(hostname=f"race-{i:02d}", pool=pool) for i in range(2 + spares)]
    leads = tenants_with_leads(pool, BOOKERS + 1, max_nodes=4)
    start, end = tomorrow, tomorrow + timedelta(hours=3)
    victim_booking = reservation_create(actor=leads[0][1], tenant=leads[0][0], pool=pool, node_count=2,
                                        start=start, end=end)
    victim = Node.objects.get(hostname=victim_booking.node_hostnames[0])
    check = HealthCheck.objects.create(node=victim, level="quick", trigger="schedule", status="running")
    fake = SimulatedFleet({"nodes": {victim.hostname: [{"kind": "remap_failure", "gpu": 4}]}})
    report = fake.run({"id": check.pk, "host": victim.hostname, "level": "quick", "model": "H100-SXM", "gpus": 8})
    assert report["verdict"] == "fail"

    def act(i):
        if i == 0:
            return health_check_record(check.pk, report)
        tenant, user = leads[i]
        return reservation_create(actor=user, tenant=tenant, pool=pool, node_count=1, start=start, end=end)

    results = run_threads(act, BOOKERS + 1)
    assert isinstance(results[0], HealthCheck), results[0]
    booked = [r for r in results[1:] if isinstance(r, Reservation)]
    assert all(isinstance(r, Reservation | CapacityUnavailable) for r in results[1:]), results

    assert overlapping_allocations() == 0
    victim.refresh_from_db()
    assert victim.state == "draining"
    assert Repair.objects.filter(node=victim, triggering_check=check).exists()
    victim_booking.refresh_from_db()
    # The swap is ours (node_replace_allocations) or provisioning's (on node.state_changed),
    # whichever came first; either way the booking is whole again or counted as degraded.
    swapped = Allocation.objects.filter(reservation=victim_booking, active=True).count() == 2
    assert victim_booking.missing_nodes == (0 if swapped else 1)
    # Every healthy node is held by exactly one booking, and nobody holds the failed node.
    window = Allocation.objects.filter(node__pool=pool, active=True, period__overlap=(start, end))
    assert not window.filter(node=victim).exists()
    assert window.count() == len(nodes) - 1
    assert len(booked) + 1 + (1 if swapped else 0) == len(nodes) - 1
