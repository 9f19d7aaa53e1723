"""The booking statement (services.BOOK_FUNCTION) judges as the Python services did, at the edges of its numbers:
a quota saved before today's limits (the admin took up to 2^31-1 for each number) still books."""
from datetime import timedelta

import pytest

from reservations.models import Reservation
from reservations.services import reservation_create
from tenants.models import Quota

from .conftest import make_world

# Outside a test transaction: the booking runs as its own one statement (no Idempotency-Key), as in production.
pytestmark = pytest.mark.django_db(transaction=True)
INT_MAX = 2**31 - 1


@pytest.fixture
def tx_world():
    return make_world()


@pytest.mark.parametrize("key", [None, "k-1"])
def test_a_legacy_duration_limit_past_what_an_integer_holds_in_seconds_still_books(tx_world, t0, key):
    world = tx_world
    Quota.objects.filter(tenant=world.tenants["alpha"]).update(max_duration_hours=INT_MAX)
    booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=1, start=t0, end=t0 + timedelta(hours=2), idempotency_key=key)
    assert Reservation.objects.get(pk=booked.pk).billing == "committed"


@pytest.mark.parametrize("key", [None, "k-1"])
def test_legacy_quota_numbers_whose_sum_passes_an_integer_still_book(tx_world, t0, key):
    world = tx_world
    Quota.objects.filter(tenant=world.tenants["alpha"]).update(max_nodes=INT_MAX, burst_nodes=INT_MAX)
    booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=2, start=t0, end=t0 + timedelta(hours=2), idempotency_key=key)
    assert (booked.billing, booked.burst_part_nodes) == ("committed", 0)


def test_the_audit_row_says_when_the_booking_was_made_not_when_it_was_asked_for(tx_world, t0):
    """audit_record stamped the row with the clock as it wrote it: a booking that queued on its tenant's quota lock
    is recorded as made after the wait, as its reservation's allocations and the events after it are."""
    import time

    from django.utils import timezone

    from portal.core.models import AuditLog

    from .racing import behind_a_lock

    world = tx_world
    released: list = []

    def hold():
        Quota.objects.select_for_update().get(tenant=world.tenants["alpha"], pool=world.pool)

        def then():
            time.sleep(0.3)
            released.append(timezone.now())
        return then

    booked = behind_a_lock(hold, lambda: reservation_create(
        actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool, node_count=1, start=t0,
        end=t0 + timedelta(hours=1)), waits_on="tenants_quota")
    assert isinstance(booked, Reservation), booked
    audit = AuditLog.objects.get(action="reservation.create", object_id=str(booked.pk))
    assert audit.created_at >= released[0], (audit.created_at, released[0])


@pytest.mark.parametrize("key", [None, "k-1"])
def test_a_database_that_has_not_met_this_release_s_migrate_yet_still_books(tx_world, t0, key):
    """The booking function is created by migrate (post_migrate); a release deployed onto a database whose
    migrations are all applied, without running migrate again (the step skipped when `migrate --check` finds
    nothing to apply), books as the Python services did instead of failing every booking until a migrate."""
    from django.db import connection

    from reservations import services

    world = tx_world
    with connection.cursor() as cur:
        cur.execute(f"DROP FUNCTION {services.BOOK_FUNCTION}")
    try:
        booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=t0, end=t0 + timedelta(hours=1), idempotency_key=key)
        assert Reservation.objects.filter(pk=booked.pk).exists()
    finally:
        services.install_booking_function()
