"""Rights and the tenant's burst flag are read again under the quota lock (found in a review: a booking or
extension that queued on the lock went through on a membership removed or downgraded, or burst disabled,
while it waited). Real threads on the real database."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction

from portal.core.exceptions import PermissionDenied, QuotaExceeded
from reservations.models import Reservation
from reservations.services import reservation_create
from tenants import services as tsvc
from tenants.models import Membership, Quota, Tenant

from .conftest import make_world, wait_for_lock_waiter
from .racing import behind_a_lock

pytestmark = pytest.mark.django_db(transaction=True)


def _hold_quota_lock(tenant, pool, locked: threading.Event, release: threading.Event):
    """Another transaction holding the (tenant, pool) quota row: e.g. a concurrent booking or quota edit."""
    try:
        with transaction.atomic():
            list(Quota.objects.select_for_update(of=("self",)).filter(tenant=tenant, pool=pool))
            locked.set()
            release.wait(30)
    finally:
        connection.close()




def _book_in_thread(result: dict, **kwargs):
    try:
        result["value"] = reservation_create(**kwargs)
    except BaseException as exc:  # noqa: BLE001
        result["value"] = exc
    finally:
        connection.close()


def _race(world, t0, who: str, change, node_count=1):
    tenant = Tenant.objects.get(slug="alpha")
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_quota_lock, args=(tenant, world.pool, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    booker = threading.Thread(target=_book_in_thread, args=(result,), kwargs=dict(
        actor=world.users[who], tenant=tenant, pool=world.pool, node_count=node_count,
        start=t0, end=t0 + timedelta(hours=2)))
    booker.start()
    wait_for_lock_waiter("tenants_quota")
    change()  # commits while the booking waits on the quota row
    release.set()
    holder.join(30)
    booker.join(30)
    return result["value"]


def test_booking_by_member_removed_while_it_waits_is_refused(t0):
    world = make_world()
    staff = world.users["staff"]
    membership = Membership.objects.get(user=world.users["alpha-member"], tenant__slug="alpha")

    out = _race(world, t0, "alpha-member", lambda: tsvc.membership_delete(actor=staff, membership=membership))

    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert isinstance(out, PermissionDenied), f"booked on a removed membership: {out!r}"
    assert not Reservation.objects.exists()


def test_booking_by_member_downgraded_to_viewer_while_it_waits_is_refused(t0):
    world = make_world()
    staff = world.users["staff"]
    membership = Membership.objects.get(user=world.users["alpha-member"], tenant__slug="alpha")

    out = _race(world, t0, "alpha-member",
                lambda: tsvc.membership_update(actor=staff, membership=membership, role="viewer"))

    assert isinstance(out, PermissionDenied), f"a viewer booked: {out!r}"
    assert not Reservation.objects.exists()


def test_burst_disabled_while_booking_waits_is_honoured(t0):
    world = make_world()  # max_nodes 3, burst 1, burst enabled
    staff = world.users["staff"]
    tenant = Tenant.objects.get(slug="alpha")

    out = _race(world, t0, "alpha-lead",
                lambda: tsvc.tenant_update(actor=staff, tenant=tenant, burst_enabled=False), node_count=4)

    assert Tenant.objects.get(pk=tenant.pk).burst_enabled is False
    assert isinstance(out, QuotaExceeded), f"booked as burst after burst was disabled: {out!r} " \
        f"{getattr(out, 'billing', '')}"


def test_extension_by_member_removed_while_it_waits_is_refused(t0):
    from reservations.services import reservation_update
    world = make_world()
    staff, member = world.users["staff"], world.users["alpha-member"]
    tenant = Tenant.objects.get(slug="alpha")
    r = reservation_create(actor=member, tenant=tenant, pool=world.pool, node_count=1, start=t0,
                           end=t0 + timedelta(hours=2))
    membership = Membership.objects.get(user=member, tenant=tenant)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_quota_lock, args=(tenant, world.pool, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}

    def extend():
        try:
            result["value"] = reservation_update(actor=member, reservation=r, end=t0 + timedelta(hours=8))
        except BaseException as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    t = threading.Thread(target=extend)
    t.start()
    wait_for_lock_waiter("tenants_quota")
    tsvc.membership_delete(actor=staff, membership=membership)
    release.set()
    holder.join(30)
    t.join(30)
    assert isinstance(result["value"], PermissionDenied), f"extended after removal: {result['value']!r}"


def test_shortening_needs_no_quota_and_keeps_its_billing(t0):
    """Giving nodes back early only lowers usage: a quota lowered or removed since must not stop it."""
    from reservations.services import reservation_update

    world = make_world()
    tenant, lead = Tenant.objects.get(slug="alpha"), world.users["alpha-lead"]
    r = reservation_create(actor=lead, tenant=tenant, pool=world.pool, node_count=3, start=t0,
                           end=t0 + timedelta(hours=10))
    tsvc.quota_update(actor=world.users["staff"], quota=Quota.objects.get(tenant=tenant, pool=world.pool),
                      max_nodes=1, burst_nodes=0)
    r = reservation_update(actor=lead, reservation=r, end=t0 + timedelta(hours=6))
    assert r.period.upper == t0 + timedelta(hours=6) and r.billing == "committed"
    tsvc.quota_delete(actor=world.users["staff"], quota=Quota.objects.get(tenant=tenant, pool=world.pool))
    r = reservation_update(actor=lead, reservation=r, start=t0 + timedelta(hours=1), end=t0 + timedelta(hours=2))
    assert (r.period.lower, r.period.upper) == (t0 + timedelta(hours=1), t0 + timedelta(hours=2))
    with pytest.raises(QuotaExceeded):  # growing it again is judged by the (now missing) quota
        reservation_update(actor=lead, reservation=r, end=t0 + timedelta(hours=3))


def test_burst_disabled_while_the_booking_runs_is_honoured(t0):
    """The burst flag was read without a lock: a booking past its quota lock read it while a change disabling
    burst was in flight, waited at its commit on the tenant row (its deferred foreign key) until the change had
    committed, and then committed as burst after burst was disabled (the test above covers only a booking that
    queued on the quota lock). The flag is now read key-share locked: the booking waits for the change and
    reads it."""
    world = make_world()  # max_nodes 3, burst 1, burst enabled
    tenant = Tenant.objects.get(slug="alpha")

    def disable_burst() -> None:  # tenant_update's transaction: the tenant row FOR UPDATE, burst off
        locked = Tenant.objects.select_for_update().get(pk=tenant.pk)
        locked.burst_enabled = False
        locked.save(update_fields=["burst_enabled"])

    # The booking queues on the tenant row (where depends on the code).
    out = behind_a_lock(disable_burst, lambda: reservation_create(
        actor=world.users["alpha-lead"], tenant=tenant, pool=world.pool, node_count=4, start=t0,
        end=t0 + timedelta(hours=2)))
    assert Tenant.objects.get(pk=tenant.pk).burst_enabled is False
    assert isinstance(out, QuotaExceeded), f"booked as burst after burst was disabled: {out!r} " \
        f"{getattr(out, 'billing', '')}"
    assert not Reservation.objects.exists()
