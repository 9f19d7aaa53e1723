"""portal_provisioning_phase_duration_seconds times provisioning work, with buckets that can hold it.

The provisioning dashboard's "Mean time per phase" and "Phase duration p95" panels read this histogram.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.apps import apps
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.test import Client

from reservations.models import Reservation
from tests.conftest import make_world

from .conftest import scrape

pytestmark = pytest.mark.django_db

FAMILY = "portal_provisioning_phase_duration_seconds"


def cluster_with_phases(world, t0, phases):
    VirtualCluster = apps.get_model("provisioning", "VirtualCluster")
    ClusterTransition = apps.get_model("provisioning", "ClusterTransition")
    start = t0 + timedelta(days=3)
    r = Reservation.objects.create(tenant=world.tenants["alpha"], pool=world.pool, node_count=1,
                                   period=DateTimeTZRange(start, start + timedelta(hours=4), "[)"))
    cluster = VirtualCluster.objects.create(
        reservation=r, tenant=r.tenant, backend="simulated", orchestrator="slurm", orchestrator_version="24.05",
        cuda_version="12.8", default_memory_per_gpu_gib=80, shared_storage_gib=100, status=phases[-1][0])
    for phase, at in phases:
        ClusterTransition.objects.create(cluster=cluster, phase=phase, at=at)


def test_the_wait_for_a_bookings_start_is_not_counted_as_a_provisioning_phase(ops):
    """A cluster is created "pending" when its booking is made and leaves it when provisioning starts, 30
    minutes before the window: days or weeks later. That wait is the booking's lead time, not provisioning
    work: in the histogram it put days next to seconds on "Mean time per phase", and (past every bucket)
    read as the top bucket on the p95 panel."""
    world = make_world(nodes=2)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    provisioning_starts = t0 + timedelta(days=3) - timedelta(minutes=30)
    cluster_with_phases(world, t0, [
        ("pending", t0),
        ("allocating_nodes", provisioning_starts),
        ("configuring_network", provisioning_starts + timedelta(seconds=20)),
        ("ready", provisioning_starts + timedelta(seconds=80)),
    ])
    s = scrape(Client())
    assert s.value(f"{FAMILY}_count", phase="allocating_nodes") == 1
    assert s.value(f"{FAMILY}_sum", phase="configuring_network") == 60
    phases = {dict(labels).get("phase") for name, labels in s.samples if name.startswith(FAMILY)}
    assert "pending" not in phases, phases


def test_the_buckets_reach_the_longest_acceptance_phase(ops):
    """running_acceptance_tests waits for the acceptance checks up to one check's timeout of the level
    (PORTAL_HEALTH_TIMEOUT_FULL: 4 h with PORTAL_HEALTH_ACCEPTANCE_LEVEL=full). The top bucket was 2 h: a
    3.5 h acceptance phase fell in +Inf only, and histogram_quantile read it as 2 h."""
    from provisioning.health.conf import LEVEL_TIMEOUTS_S

    world = make_world(nodes=2)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    cluster_with_phases(world, t0, [
        ("installing_drivers", t0),
        ("running_acceptance_tests", t0 + timedelta(minutes=10)),
        ("ready", t0 + timedelta(minutes=10, hours=3, seconds=1800)),
    ])
    s = scrape(Client())
    buckets = {float(dict(labels)["le"]): value for (name, labels), value in s.samples.items()
               if name == f"{FAMILY}_bucket" and dict(labels)["phase"] == "running_acceptance_tests"}
    finite = sorted(le for le in buckets if le != float("inf"))
    assert finite[-1] >= max(LEVEL_TIMEOUTS_S.values()), finite
    assert buckets[7200.0] == 0
    assert any(buckets[le] == 1 for le in finite), buckets


def test_the_histogram_is_summed_in_the_database_not_read_row_by_row(ops, monkeypatch):
    """Cluster transitions are never pruned and the scrape runs every 15 s: reading every transition ever
    recorded into the web worker on each scrape grew without bound. The database sums the histogram: what
    a scrape reads stays a row per phase, however many clusters there have been."""
    from portal.ops import collectors

    ClusterTransition = apps.get_model("provisioning", "ClusterTransition")
    table = ClusterTransition._meta.db_table
    world = make_world(nodes=2)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    for i in range(40):
        at = t0 + timedelta(hours=i)
        cluster_with_phases(world, t0 + timedelta(days=i), [
            ("pending", at - timedelta(days=1)), ("allocating_nodes", at),
            ("configuring_network", at + timedelta(seconds=10 + i)),
            ("attaching_storage", at + timedelta(seconds=100)), ("ready", at + timedelta(seconds=200)),
        ])
    read = []
    real_rows = collectors._rows

    def counting_rows(sql, params=None):
        rows = real_rows(sql, params)
        if table in sql:
            read.append(len(rows))
        return rows

    monkeypatch.setattr(collectors, "_rows", counting_rows)
    s = scrape(Client())
    assert s.value(f"{FAMILY}_count", phase="configuring_network") == 40
    assert s.value(f"{FAMILY}_sum", phase="configuring_network") == sum(100 - (10 + i) for i in range(40))
    assert s.value(f"{FAMILY}_bucket", phase="configuring_network", le="60.0") == 10  # i >= 30: 90 - i <= 60
    assert s.value(f"{FAMILY}_count", phase="attaching_storage") == 40
    assert s.value(f"{FAMILY}_bucket", phase="attaching_storage", le="+Inf") == 40
    assert sum(read) <= 2 * len(collectors.PROVISIONING_PHASES), read
