"""A booking's window change against the tenant's storage quota (found in a review: a move or an extension
oversold the quota that cluster configuration guards, and a cluster failed only when it was provisioned)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from portal.core.exceptions import QuotaExceeded
from provisioning import services
from provisioning.choices import ClusterStatus
from provisioning.models import StorageVolume, VirtualCluster
from reservations.models import Reservation
from reservations.services import reservation_update
from tenants.models import Tenant

from .conftest import book

pytestmark = pytest.mark.django_db


def _one_tib_tenant_with_two_bookings(world, t0, *, later_by: timedelta = timedelta(days=3)):
    """Alpha (1 TiB of storage) books now+1d and later; each cluster takes the default 1 TiB volume."""
    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=1)
    first = book(world, "alpha-lead", t0)
    second = book(world, "alpha-lead", t0 + later_by)
    clusters = [services.cluster_create_for_reservation(reservation_id=r.pk) for r in (first, second)]
    assert [c.shared_storage_gib for c in clusters] == [1024, 1024]
    return first, second, clusters


def test_moving_a_booking_into_another_ones_window_cannot_oversell_the_storage_quota(world, t0):
    """Each cluster held the whole 1 TiB, in windows three days apart (configure accepts that). Moving the later
    booking onto the first one's window was accepted, so both clusters then held 2 TiB at once, and the one
    provisioned second failed ("storage quota exceeded") when its nodes were due. The move is now refused
    (409 quota_exceeded, naming storage) and nothing changes; a booking whose cluster takes no storage moves."""
    first, second, (_, later) = _one_tib_tenant_with_two_bookings(world, t0)
    client = world.client("alpha-lead")
    body = {"start": t0.isoformat(), "end": (t0 + timedelta(hours=2)).isoformat()}
    r = client.patch(f"/api/v1/reservations/{second.pk}/", body, format="json")
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded", r.json()
    assert "storage" in r.json()["detail"] and "1024 GiB" in r.json()["detail"], r.json()
    second.refresh_from_db()
    assert second.period.lower == t0 + timedelta(days=3)
    assert set(second.allocations.filter(active=True).values_list("period", flat=True)) == {second.period}

    # The room is the cluster's: with less storage asked, the same move fits.
    services.cluster_configure(actor=world.users["alpha-lead"], cluster=later, shared_storage_gib=0)
    r = client.patch(f"/api/v1/reservations/{second.pk}/", body, format="json")
    assert r.status_code == 200, r.json()


def test_extending_into_another_bookings_window_is_refused_and_shrinking_is_not(world, t0):
    """Back to back (the second starts when the first ends): an extension of the first into the second's window
    would make both 1 TiB volumes overlap; it is refused. Shortening (nothing new overlaps) is never refused,
    even with the quota lowered below what the cluster holds."""
    first, second, _ = _one_tib_tenant_with_two_bookings(world, t0, later_by=timedelta(hours=2))
    lead = world.users["alpha-lead"]
    with pytest.raises(QuotaExceeded, match="storage"):
        reservation_update(actor=lead, reservation=first, end=t0 + timedelta(hours=3))
    first.refresh_from_db()
    assert first.period.upper == t0 + timedelta(hours=2)
    with pytest.raises(QuotaExceeded, match="storage"):
        reservation_update(actor=lead, reservation=second, start=t0 + timedelta(hours=1))
    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=0)
    shorter = reservation_update(actor=lead, reservation=first, end=t0 + timedelta(hours=1))
    assert shorter.period.upper == t0 + timedelta(hours=1)


def test_a_cluster_that_is_gone_or_failed_holds_no_storage_for_a_window_change(world, t0):
    """The same rule as configuration: a failed or torn-down cluster's storage is not counted."""
    first, second, (early, _) = _one_tib_tenant_with_two_bookings(world, t0)
    VirtualCluster.objects.filter(pk=early.pk).update(status=ClusterStatus.FAILED)
    moved = reservation_update(actor=world.users["alpha-lead"], reservation=second, start=t0 + timedelta(hours=1),
                               end=t0 + timedelta(hours=3))
    assert moved.period.lower == t0 + timedelta(hours=1)
    assert Reservation.objects.get(pk=second.pk).period.lower == t0 + timedelta(hours=1)
    assert not StorageVolume.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_window_changes_at_once_cannot_both_take_the_same_storage(world, t0, monkeypatch):
    """Two moves of one tenant's bookings in different pools (so no quota row serialises them), each fitting the
    storage quota on its own, into the window of a third booking: both were judged on what the other had not
    committed yet. The storage check takes the tenant row lock (as configuring and attaching a volume do): the
    second move waits there for the first, sees it, and is refused."""
    import threading

    from django.db import connection

    from reservations import services as reservations_services
    from reservations.models import Node, Pool
    from reservations.services import reservation_create
    from tenants.models import Quota

    other_pool = Pool.objects.create(name="a100", gpu_model="A100-SXM", gpus_per_node=8)
    Node.objects.create(hostname="a100-001", pool=other_pool)
    Quota.objects.create(tenant=world.tenants["alpha"], pool=other_pool, max_nodes=1)
    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=1)
    lead = world.users["alpha-lead"]
    here = book(world, "alpha-lead", t0)
    b = book(world, "alpha-lead", t0 + timedelta(days=3))
    c = reservation_create(actor=lead, tenant=world.tenants["alpha"], pool=other_pool, node_count=1,
                           start=t0 + timedelta(days=6), end=t0 + timedelta(days=6, hours=2))
    for r in (here, b, c):
        cluster = services.cluster_create_for_reservation(reservation_id=r.pk)
        VirtualCluster.objects.filter(pk=cluster.pk).update(shared_storage_gib=512)

    # Both moves hold their own locks (booking, quota row of their pool, nodes) and reach the storage check
    # together; each would fit on its own.
    both_there = threading.Barrier(2, timeout=20)
    real_guards = list(reservations_services.window_change_guards)

    def meeting_first(reservation, period):
        both_there.wait()
        for guard in real_guards:
            guard(reservation, period)

    monkeypatch.setattr(reservations_services, "window_change_guards", [meeting_first])
    results: dict[int, object] = {}

    def move(reservation):
        try:
            results[reservation.pk] = reservation_update(actor=lead, reservation=reservation, start=t0,
                                                         end=t0 + timedelta(hours=2))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results[reservation.pk] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=move, args=(r,)) for r in (b, c)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    results = list(results.values())
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(refused) == 1 and "storage" in str(refused[0]), results
    moved = [r for r in (b, c) if Reservation.objects.get(pk=r.pk).period.lower == t0]
    assert len(moved) == 1


@pytest.mark.django_db(transaction=True)
def test_a_storage_change_racing_a_move_of_its_own_booking_sees_the_new_window(world, t0, monkeypatch):
    """The configure read the booking's window before it waited for the tenant row lock: a move of that booking
    (its cluster holding no storage yet, so accepted) that committed meanwhile onto another booking's window was
    not seen, and the cluster got the storage the other one holds. The window is read under the lock."""
    import threading

    from django.db import connection

    from portal.core.exceptions import InvalidInput

    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=1)
    lead = world.users["alpha-lead"]
    here = book(world, "alpha-lead", t0)
    later = book(world, "alpha-lead", t0 + timedelta(days=3))
    services.cluster_create_for_reservation(reservation_id=here.pk)  # 1024 GiB, the whole quota
    cluster = services.cluster_create_for_reservation(reservation_id=later.pk)
    VirtualCluster.objects.filter(pk=cluster.pk).update(shared_storage_gib=0)
    real_lock = services._lock_tenant_storage
    seen = {}

    def move_in_other_request():
        try:
            seen["moved"] = reservation_update(actor=lead, reservation=later, start=t0, end=t0 + timedelta(hours=2))
        except Exception as exc:  # noqa: BLE001 - asserted below
            seen["moved"] = exc
        finally:
            connection.close()

    def lock_after_a_move(tenant_id):
        if "started" not in seen:  # the configure has read its cluster and booking; the move commits now
            seen["started"] = True
            worker = threading.Thread(target=move_in_other_request)
            worker.start()
            worker.join(30)
        return real_lock(tenant_id)

    monkeypatch.setattr(services, "_lock_tenant_storage", lock_after_a_move)
    with pytest.raises(InvalidInput) as excinfo:
        services.cluster_configure(actor=lead, cluster=cluster, shared_storage_gib=1024)
    assert isinstance(seen["moved"], Reservation), seen
    assert "at most 0 GiB" in excinfo.value.fields["shared_storage_gib"]
    assert VirtualCluster.objects.get(pk=cluster.pk).shared_storage_gib == 0


def test_back_to_back_bookings_each_get_the_whole_storage_quota_when_provisioned(world, t0):
    """Configuration lets two bookings that follow each other hold the whole quota each (their windows do not
    overlap), but attaching a volume counted every active volume of the tenant whatever its window: the second
    booking is provisioned half an hour before it starts, while the first still runs with its volume, and its
    cluster failed with "storage quota exceeded" — storage the configuration had promised it. The volume is now
    judged as the configuration is: against the volumes of the tenant's clusters whose bookings overlap its own
    window. Overlapping bookings are still refused."""
    first, second, (early, late) = _one_tib_tenant_with_two_bookings(world, t0, later_by=timedelta(hours=2))
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    assert services.cluster_provision(cluster_id=early.pk) == ClusterStatus.READY
    services.lifecycle_tick(now=t0 + timedelta(minutes=110))
    assert Reservation.objects.get(pk=second.pk).status == "provisioning"
    assert services.cluster_provision(cluster_id=late.pk) == ClusterStatus.READY, \
        VirtualCluster.objects.get(pk=late.pk).status_reason
    assert StorageVolume.objects.active().filter(tenant__slug="alpha").count() == 2


def test_a_new_cluster_gets_no_more_storage_than_its_window_leaves(world, t0):
    """A new cluster took the default storage (1 TiB, capped at the quota) whatever the tenant's other clusters in
    its window held: with a 1 TiB quota, two overlapping bookings each got 1 TiB, and the one provisioned second
    failed ("storage quota exceeded") when its nodes were due. A new cluster now gets the default capped at what
    the tenant's overlapping clusters leave; a later booking outside that window still gets the default."""
    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=1)
    first = book(world, "alpha-lead", t0)
    services.cluster_create_for_reservation(reservation_id=first.pk)
    VirtualCluster.objects.filter(reservation=first).update(shared_storage_gib=768)
    second = book(world, "alpha-lead", t0 + timedelta(hours=1))
    apart = book(world, "alpha-lead", t0 + timedelta(days=2))
    assert services.cluster_create_for_reservation(reservation_id=second.pk).shared_storage_gib == 256
    assert services.cluster_create_for_reservation(reservation_id=apart.pk).shared_storage_gib == 1024
    services.lifecycle_tick(now=t0 + timedelta(minutes=50))
    for reservation in (first, second):
        cluster = VirtualCluster.objects.get(reservation=reservation)
        assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY, cluster.status_reason
