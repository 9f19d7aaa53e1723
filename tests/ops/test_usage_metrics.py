"""portal_usage_gpu_seconds: what the usage statement counts as used so far this UTC month, per tenant, pool
and billing, read at scrape time in one statement (the statement's own SQL), in GPU-seconds (Prometheus'
base unit), so a Grafana panel shows the same GPU-hours the tenants are billed for."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.ops import collectors
from reservations.models import Allocation, Reservation
from reservations.selectors import usage_for_period
from reservations.services import pool_update
from reservations.usage import parse_month
from tests.conftest import make_world

from .conftest import promtool_check, scrape

pytestmark = pytest.mark.django_db


def _booking(world, tenant, nodes, start, end, *, burst_part=0):
    r = Reservation.objects.create(
        tenant=world.tenants[tenant], pool=world.pool, node_count=len(nodes), status="active",
        period=DateTimeTZRange(start, end, "[)"), billing="burst" if burst_part else "committed",
        burst_part_nodes=burst_part)
    for node in nodes:
        Allocation.objects.create(reservation=r, node=node, period=r.period)
    return r


def test_gpu_hours_used_this_month_per_tenant_pool_and_billing_match_the_statement(ops):
    world = make_world(nodes=4)
    month = parse_month(None)
    now = timezone.now()
    # Straddling the month's start (only this month's part counts) and running past now (only up to now).
    _booking(world, "alpha", world.nodes[:1], month.start - timedelta(hours=2), now + timedelta(hours=3))
    _booking(world, "beta", world.nodes[1:3], month.start - timedelta(hours=1), now + timedelta(hours=1),
             burst_part=1)
    # Booked at 8 GPUs per node; the pool changing later re-counts nothing (as on the statement).
    pool_update(actor=world.users["staff"], pool=world.pool, gpus_per_node=2)

    before = {(line.tenant.slug, line.pool.name): line for line in usage_for_period(
        start=month.start, end=month.end, tenant_ids=None)}
    s = scrape(Client())
    after = {(line.tenant.slug, line.pool.name): line for line in usage_for_period(
        start=month.start, end=month.end, tenant_ids=None)}
    assert s.value("portal_metrics_source_up", source="usage") == 1
    for tenant in ("alpha", "beta"):
        for billing, field in (("committed", "committed_used"), ("burst", "burst_used")):
            value = s.value("portal_usage_gpu_seconds", tenant=tenant, pool="h100", billing=billing)
            lo, hi = getattr(before[(tenant, "h100")], field), getattr(after[(tenant, "h100")], field)
            hours = Decimal(str(value)) / 3600
            assert lo - Decimal("0.01") <= hours <= hi + Decimal("0.01"), (tenant, billing, value)
    hours = (now - month.start).total_seconds() / 3600
    assert s.value("portal_usage_gpu_seconds", tenant="alpha", pool="h100", billing="burst") == 0
    assert s.value("portal_usage_gpu_seconds", tenant="alpha", pool="h100", billing="committed") == pytest.approx(
        8 * hours * 3600, abs=1800)
    assert s.value("portal_usage_gpu_seconds", tenant="beta", pool="h100", billing="burst") == pytest.approx(
        8 * hours * 3600, abs=1800)  # one of its two nodes is above the guarantee

    result = promtool_check(s.text)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr)


def test_the_usage_section_reads_one_statement_however_many_bookings(ops):
    world = make_world(nodes=4)
    month = parse_month(None)
    for i, node in enumerate(world.nodes):
        start = month.start + timedelta(minutes=10 * i)
        _booking(world, "alpha" if i % 2 else "beta", [node], start, start + timedelta(hours=1),
                 burst_part=i % 2)
    with CaptureQueriesContext(connection) as ctx:
        families = list(collectors.PortalCollector()._usage(timezone.now()))
    assert len(ctx.captured_queries) == 1, [q["sql"] for q in ctx.captured_queries]
    assert {s.labels["tenant"] for s in families[0].samples} == {"alpha", "beta"}


def test_every_tenant_with_a_quota_has_its_series_at_zero_before_any_booking(ops):
    make_world(nodes=2)
    s = scrape(Client())
    for tenant in ("alpha", "beta"):
        for billing in ("committed", "burst"):
            assert s.value("portal_usage_gpu_seconds", tenant=tenant, pool="h100", billing=billing) == 0
