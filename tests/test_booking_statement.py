"""The booking statement (reservations.services.BOOK_FUNCTION): one PL/pgSQL call makes a new booking's decisions
under its locks. Its judgement of the quota is SQL; the words of a refusal are _judge_quota's: the two must agree."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portal.core.exceptions import QuotaExceeded
from portal.core.models import AuditLog, OutboxEvent
from reservations import selectors, services
from reservations.services import reservation_create
from tenants.models import Quota

from .conftest import make_world
from .test_booking_properties import outer

H = timedelta(hours=1)


class _Rollback(Exception):
    pass


@pytest.mark.django_db
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 4)), max_size=4),
       max_nodes=st.integers(0, 8), burst_nodes=st.integers(0, 4), burst_enabled=st.booleans(),
       max_hours=st.sampled_from([None, None, 2, 4, 6]), n=st.integers(1, 6), offset=st.integers(0, 6),
       hours=st.integers(1, 5))
def test_the_statement_judges_the_quota_as_judge_quota_words_it(t0, held, max_nodes, burst_nodes, burst_enabled,
                                                                   max_hours, n, offset, hours):
    try:
        with outer():  # a savepoint per example, rolled back
            world = make_world(nodes=40, max_nodes=100, burst_nodes=0)
            tenant, pool, lead = world.tenants["alpha"], world.pool, world.users["alpha-lead"]
            for at, count, length in held:  # the tenant's bookings so far, under a roomy quota
                reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=count, start=t0 + at * H,
                                   end=t0 + (at + length) * H)
            Quota.objects.filter(tenant=tenant, pool=pool).update(max_nodes=max_nodes, burst_nodes=burst_nodes,
                                                                  max_duration_hours=max_hours)
            tenant.burst_enabled = burst_enabled
            tenant.save(update_fields=["burst_enabled"])
            start, end = t0 + offset * H, t0 + (offset + hours) * H
            peak = selectors.tenant_peak_usage(tenant_id=tenant.pk, pool_id=pool.pk, start=start, end=end)
            try:
                expected = services._judge_quota(
                    tenant=tenant, pool=pool, node_count=n, start=start, end=end, max_nodes=max_nodes,
                    burst_nodes=burst_nodes, max_duration_hours=max_hours, burst_enabled=burst_enabled, peak=peak)
            except QuotaExceeded as exc:
                expected = exc.detail
            try:
                booked = reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=n, start=start, end=end)
                got = (booked.billing, booked.burst_part_nodes)
                stored = type(booked).objects.get(pk=booked.pk)
                assert (stored.billing, stored.burst_part_nodes) == got
            except QuotaExceeded as exc:
                got = exc.detail
            assert got == expected
            raise _Rollback
    except _Rollback:
        pass


@pytest.mark.django_db
def test_migrate_installed_this_releases_booking_statement():
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_proc WHERE proname = %s", [services.BOOK_FUNCTION])
        assert cur.fetchone()[0] == 1
        services.install_booking_function()  # again: nothing to do
        cur.execute("SELECT count(*) FROM pg_proc WHERE proname = %s", [services.BOOK_FUNCTION])
        assert cur.fetchone()[0] == 1
    # Named by its definition: another definition is another function, and a release calls only its own.
    assert services.BOOK_FUNCTION.startswith("reservations_book_")
    assert services.BOOK_FUNCTION[len("reservations_book_"):] in __import__("hashlib").sha256(
        (services._BOOK_SIGNATURE + services._BOOK_OPTIONS + services._BOOK_BODY).encode()).hexdigest()


def test_a_statement_parameter_the_function_does_not_know_is_refused_when_rendered():
    """Written from the services' SQL: a constant that gains a parameter must not render as something else."""
    assert services._plpgsql("SELECT %(tenant)s, 5 %% 2") == "SELECT p_tenant, 5 % 2"
    with pytest.raises(KeyError):
        services._plpgsql("SELECT %(brand_new)s")


@pytest.mark.django_db(transaction=True)
@override_settings(PORTAL_EVENTS_INLINE=False)
def test_a_booking_is_one_statement_with_its_audit_row_and_event(t0):

    world = make_world(nodes=4, max_nodes=2, burst_nodes=1)
    lead = world.users["alpha-lead"]
    OutboxEvent.objects.all().delete()
    with CaptureQueriesContext(connection) as captured:
        booked = reservation_create(actor=lead, tenant=world.tenants["alpha"], pool=world.pool, node_count=3,
                                    start=t0, end=t0 + 2 * H)
    statements = [q["sql"] for q in captured.captured_queries]
    booking = [s for s in statements if services.BOOK_FUNCTION in s]
    assert len(booking) == 1, statements
    # No transaction of its own around it: the statement is one (no savepoints, no second write).
    assert not any(s.upper().startswith(("SAVEPOINT", "INSERT", "UPDATE")) for s in statements), statements
    assert (booked.billing, booked.burst_part_nodes) == ("burst", 1)
    audit = AuditLog.objects.get(action="reservation.create")
    assert (audit.actor_id, audit.object_type, audit.object_id, audit.tenant_id, audit.before) == (
        lead.pk, "reservations.reservation", str(booked.pk), world.tenants["alpha"].pk, {})
    assert audit.after == {"start": services.format_utc(t0), "end": services.format_utc(t0 + 2 * H),
                           "node_count": 3, "status": "confirmed", "billing": "burst", "name": ""}
    event = OutboxEvent.objects.get()
    assert (event.event, event.payload) == ("reservation.confirmed",
                                            {"reservation_id": booked.pk, "tenant_id": world.tenants["alpha"].pk})


# The tables a booking's own statements read rows of. Its deferred foreign-key checks run at the commit, outside the
# function and after the read of the counters below.
_BOOKING_TABLES = ("reservations_allocation", "reservations_node", "reservations_reservation", "tenants_quota",
                   "tenants_tenant", "tenants_membership", "reservations_pool")


def _seq_scans_this_transaction() -> dict[str, int]:
    with connection.cursor() as cur:
        cur.execute("SELECT relname, seq_scan FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
                    [list(_BOOKING_TABLES)])
        return dict(cur.fetchall())


@pytest.mark.django_db
def test_the_statement_reads_through_indexes_even_when_planned_on_empty_tables(t0):
    """A connection keeps the function's plans. Planned while the tables were empty (a fresh deployment, or statistics
    taken just after a clean-up), the free-node pick scanned every allocation row of the fleet at each booking from
    then on. In the benchmark, one run in two took 2-3 ms more PostgreSQL CPU per booking that way. The function's
    statements now read through their indexes whatever the statistics say."""
    world = make_world(nodes=6, max_nodes=6, burst_nodes=0)
    lead = world.users["alpha-lead"]
    with connection.cursor() as cur:
        cur.execute("ANALYZE " + ", ".join(_BOOKING_TABLES))  # empty or nearly: and the plans are made again
    book = {"actor": lead, "tenant": world.tenants["alpha"], "pool": world.pool, "node_count": 2, "start": t0,
            "end": t0 + H, "name": "", "orchestrator": "slurm", "cuda_version": services.DEFAULT_CUDA_VERSION}
    services._book_statement(**book)
    before = _seq_scans_this_transaction()
    services._book_statement(**book)  # the statement alone (the service's checks before it read small tables)
    after = _seq_scans_this_transaction()
    assert {t: after.get(t, 0) - before.get(t, 0) for t in _BOOKING_TABLES} == dict.fromkeys(_BOOKING_TABLES, 0)


@pytest.mark.django_db
def test_the_function_keeps_generic_plans_that_use_indexes():
    with connection.cursor() as cur:
        cur.execute("SELECT proconfig FROM pg_proc WHERE proname = %s", [services.BOOK_FUNCTION])
        assert sorted(cur.fetchone()[0]) == ["enable_seqscan=off", "plan_cache_mode=force_generic_plan"]
