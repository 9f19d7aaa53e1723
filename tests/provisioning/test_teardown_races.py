"""The tenant's teardown beside the lifecycle tick, on the real database (found in a review of the provisioning
side; each test failed on the code before its fix)."""

import threading

import pytest
from django.db import connection

from portal.core.exceptions import InvalidState
from provisioning import services
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import ReservationStatus
from tests.provisioning.conftest import book, now_slot
from tests.racing import lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)


def _ready_cluster(world):
    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    return reservation, cluster


def test_the_teardown_button_as_the_window_ends_is_no_deadlock(world, monkeypatch):
    """The tick ending a window locked the reservation, then the cluster; the tenant's teardown locks the cluster,
    then the reservation. Pressed as the window ended, the two deadlocked and PostgreSQL aborted the tenant's
    request (a 500). The tick now takes the cluster's row first, as every other path does."""
    reservation, cluster = _ready_cluster(world)
    real_set_status = services.reservation_set_status
    locked, go = threading.Event(), threading.Event()
    outcome = {}

    def set_status_then_pause(**kwargs):
        result = real_set_status(**kwargs)
        if kwargs.get("status") == ReservationStatus.ENDING and not locked.is_set():
            locked.set()  # the tick holds what it locked so far; the tenant presses the button now
            go.wait(30)
        return result

    def tick():
        try:
            outcome["tick"] = services._tick_end(reservation.period.upper)
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["tick"] = exc
        finally:
            connection.close()

    def press():
        try:
            outcome["press"] = services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["press"] = exc
        finally:
            connection.close()

    monkeypatch.setattr(services, "reservation_set_status", set_status_then_pause)
    ticking = threading.Thread(target=tick)
    ticking.start()
    assert locked.wait(10)
    pressing = threading.Thread(target=press)
    pressing.start()
    while pressing.is_alive() and lock_waiters() < 1:
        pressing.join(0.02)
    go.set()
    for thread in (ticking, pressing):
        thread.join(30)
    assert outcome["tick"] == 1
    # The tick ended the window first; the button is refused (a 409), its teardown is the tick's.
    assert isinstance(outcome["press"], InvalidState), outcome["press"]
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.ENDING
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED  # the tick's task


def test_the_teardown_button_behind_a_failing_run_leaves_the_failed_cluster_to_staff(world, settings):
    """Pressed while a provisioning run recorded its failure (the cluster's row locked), the teardown read the
    reservation as it was before (provisioning), waited, and moved the now failed cluster to tearing_down
    (failed is no state a teardown request starts from): the tenant was told the teardown started, and the
    failed cluster staff could retry was gone. It is now refused, and the cluster stays failed."""
    from provisioning.backends.base import BackendError
    from provisioning.choices import FailedDuring
    from tests.racing import behind_a_lock

    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"
    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services._step(cluster.pk, done=None, enter=ClusterStatus.ALLOCATING_NODES)  # a run is under way

    def fail_the_run():
        services._record_failure(cluster.pk, BackendError("node h100-001 did not answer"),
                                 during=FailedDuring.PROVISIONING)

    outcome = behind_a_lock(
        fail_the_run,
        lambda: services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster),
        waits_on="provisioning_virtualcluster")
    assert isinstance(outcome, InvalidState), outcome
    cluster.refresh_from_db()
    reservation.refresh_from_db()
    assert cluster.status == ClusterStatus.FAILED and reservation.status == ReservationStatus.FAILED
    assert not cluster.transitions.filter(phase=ClusterStatus.TEARING_DOWN).exists()


def test_an_extension_just_before_the_tick_ends_the_window_is_kept(world):
    """The tick picked the reservations whose window had ended, then moved each to ending by its status alone: an
    extension committed in between (accepted, 200, the new end shown) was torn down at the old end anyway.
    The tick now checks the end again under the reservation's lock."""
    from datetime import timedelta

    from django.db import transaction

    from reservations.services import reservation_update

    reservation, cluster = _ready_cluster(world)
    old_end = reservation.period.upper
    holding, release = threading.Event(), threading.Event()
    outcome = {}

    def a_swap_holds_the_cluster_row():
        try:
            with transaction.atomic():
                VirtualCluster.objects.select_for_update().get(pk=cluster.pk)
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    def tick():
        try:
            outcome["tick"] = services._tick_end(old_end)  # the tick of the minute the window ends
        finally:
            connection.close()

    holder = threading.Thread(target=a_swap_holds_the_cluster_row)
    holder.start()
    assert holding.wait(10)
    ticking = threading.Thread(target=tick)
    ticking.start()
    while ticking.is_alive() and lock_waiters() < 1:  # the tick has read the ended windows and waits
        ticking.join(0.02)
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=old_end + timedelta(hours=2))
    release.set()
    for thread in (holder, ticking):
        thread.join(30)
    reservation.refresh_from_db()
    assert reservation.period.upper == old_end + timedelta(hours=2)
    assert reservation.status == ReservationStatus.ACTIVE and outcome["tick"] == 0
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.READY


def test_a_start_moved_just_before_the_tick_provisions_is_not_provisioned_early(world, t0, monkeypatch):
    """The tick picked the confirmed bookings due to provision, then moved each to provisioning by its status
    alone: a start moved a day later in between was provisioned a day early (its cluster claiming nodes other
    bookings may hold until then), and the booking could no longer move. begin_provisioning now checks the
    window again under the reservation's lock."""
    from datetime import timedelta

    from reservations.services import reservation_update

    reservation = book(world, "alpha-lead", t0, hours=2)
    services.lifecycle_tick(now=t0 - timedelta(hours=3))  # its pending cluster
    real_begin = services.begin_provisioning

    def moved_then_begin(**kwargs):
        reservation_update(actor=world.users["alpha-lead"], reservation=reservation, start=t0 + timedelta(days=1),
                           end=t0 + timedelta(days=1, hours=2))
        return real_begin(**kwargs)

    monkeypatch.setattr(services, "begin_provisioning", moved_then_begin)
    assert services._tick_start_provisioning(t0 - timedelta(minutes=10)) == 0
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CONFIRMED
    assert VirtualCluster.objects.get(reservation=reservation).status == ClusterStatus.PENDING


def test_an_extension_just_before_the_tick_fails_a_missed_window_is_kept(world, t0, monkeypatch):
    """The tick picked the confirmed bookings whose window had ended before provisioning started, then failed each
    by its status alone: an extension committed in between (accepted, 200, the new end shown) was failed anyway,
    its nodes released and its cluster failed. The tick now checks the end again under the booking's lock."""
    from datetime import timedelta

    from reservations.services import reservation_update

    reservation = book(world, "alpha-lead", t0, hours=2)
    services.lifecycle_tick(now=t0 - timedelta(hours=3))  # its pending cluster
    old_end = reservation.period.upper
    real_each = services._each

    def extended_then_each(ids, fn, what):
        ids = list(ids)  # the tick has read the ended windows …
        reservation_update(actor=world.users["alpha-lead"], reservation=reservation,
                           end=old_end + timedelta(hours=2))  # … and the tenant's extension commits
        return real_each(ids, fn, what)

    monkeypatch.setattr(services, "_each", extended_then_each)
    assert services._tick_fail_missed(old_end + timedelta(minutes=1)) == 0
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CONFIRMED
    assert reservation.period.upper == old_end + timedelta(hours=2)
    assert reservation.allocations.filter(active=True).exists()
    assert VirtualCluster.objects.get(reservation=reservation).status == ClusterStatus.PENDING
    # Its new end missed too, it fails as before: nodes given back, the pending cluster failed.
    monkeypatch.setattr(services, "_each", real_each)
    assert services._tick_fail_missed(old_end + timedelta(hours=2, minutes=1)) == 1
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.FAILED
    assert not reservation.allocations.filter(active=True).exists()
    assert VirtualCluster.objects.get(reservation=reservation).status == ClusterStatus.FAILED


def test_a_start_moved_just_before_the_tick_reminds_is_still_reminded_at_its_new_start(world, t0, monkeypatch):
    """The tick picked the clusters whose start was under an hour away, then marked each reminded for its start as
    it read it afterwards: a start moved a day later in between was marked reminded for the new start (and a
    starting_soon sent that no channel could tell truly), so no reminder came before the real start. The
    reminder now checks under the locks that the booking is still due, as the tick read it."""
    from datetime import timedelta

    from reservations.services import reservation_update

    reservation = book(world, "alpha-lead", t0, hours=2)
    services.lifecycle_tick(now=t0 - timedelta(hours=3))  # its pending cluster
    cluster = VirtualCluster.objects.get(reservation=reservation)
    moved = t0 + timedelta(days=1)
    real_each = services._each

    def moved_then_each(ids, fn, what):
        ids = list(ids)  # the tick has read what is due …
        if ids and what == "reminding of a start":
            reservation_update(actor=world.users["alpha-lead"], reservation=reservation, start=moved,
                               end=moved + timedelta(hours=2))  # … and the tenant's move commits
        return real_each(ids, fn, what)

    monkeypatch.setattr(services, "_each", moved_then_each)
    assert services._tick_reminders(t0 - timedelta(minutes=30)) == 0
    cluster.refresh_from_db()
    assert cluster.start_reminded_for is None
    # An hour before the new start, the tenant is reminded of it.
    monkeypatch.setattr(services, "_each", real_each)
    assert services._tick_reminders(moved - timedelta(minutes=30)) == 1
    cluster.refresh_from_db()
    assert cluster.start_reminded_for == moved
