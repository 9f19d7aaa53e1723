"""The reservation/cluster lifecycle through the services, in-process, on the real database."""

from __future__ import annotations

import threading
import time
import types
from datetime import timedelta

import pytest
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from portal.core import events
from portal.core.exceptions import InvalidInput, InvalidState, PermissionDenied
from portal.core.models import AuditLog
from provisioning import services
from provisioning.choices import PROVISION_PHASES, ClusterStatus
from provisioning.constants import LOCK_CLUSTER
from provisioning.models import ClusterTransition, StorageVolume, VirtualCluster
from reservations.choices import NodeState, ReservationStatus
from reservations.models import Allocation, Reservation
from reservations.services import node_update, reservation_cancel, reservation_update
from tenants.models import Tenant

from .conftest import book, now_slot

pytestmark = pytest.mark.django_db


@pytest.fixture
def captured(django_capture_on_commit_callbacks):
    """Collect every domain event (after commit) while the test runs."""
    seen: list[tuple[str, dict]] = []

    def record(event, payload):
        seen.append((event, payload))

    events.subscribe("*", record)
    yield seen
    events._subscribers["*"].remove(record)


def committed(callbacks_fixture, fn, *args, **kwargs):
    """Run fn and then the on-commit callbacks it registered (events, enqueues), as a real commit would."""
    with callbacks_fixture(execute=True):
        return fn(*args, **kwargs)


def provisioned(world, t0, who="alpha-lead", **kwargs) -> VirtualCluster:
    reservation = book(world, who, t0, **kwargs)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    cluster.refresh_from_db()
    return cluster


def statuses(reservation: Reservation) -> str:
    reservation.refresh_from_db()
    return reservation.status


def test_booking_creates_a_pending_cluster_with_the_pool_defaults(world, t0, django_capture_on_commit_callbacks):
    reservation = committed(django_capture_on_commit_callbacks, book, world, "alpha-member", t0,
                            orchestrator="kubernetes", cuda_version="12.6")

    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert cluster.status == ClusterStatus.PENDING
    assert (cluster.orchestrator, cluster.orchestrator_version, cluster.cuda_version) == ("kubernetes", "1.31", "12.6")
    assert cluster.backend == "simulated"
    assert cluster.tenant == world.tenants["alpha"]
    assert cluster.shared_storage_gib == 1024 and cluster.default_memory_per_gpu_gib == 64
    assert list(cluster.transitions.values_list("phase", flat=True)) == ["pending"]


def test_the_tick_provisions_ahead_of_start_activates_at_start_and_tears_down_at_end(
        world, t0, captured, django_capture_on_commit_callbacks):
    reservation = book(world, "alpha-lead", t0, hours=3, nodes=2)  # (no commit: the tick creates the cluster)
    end = t0 + timedelta(hours=3)

    assert services.lifecycle_tick(now=t0 - timedelta(minutes=31)) == {"created": 1, "reminders": 1}
    assert statuses(reservation) == ReservationStatus.CONFIRMED
    report = services.lifecycle_tick(now=t0 - timedelta(minutes=29))
    assert report == {"provisioning": 1}
    assert statuses(reservation) == ReservationStatus.PROVISIONING

    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert committed(django_capture_on_commit_callbacks, services.cluster_provision,
                     cluster_id=cluster.pk) == ClusterStatus.READY
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.READY
    # Every phase, in order, each with its own time; the start is a day away, so not active yet.
    phases = list(cluster.transitions.order_by("at", "id"))
    assert [t.phase for t in phases] == ["pending", *PROVISION_PHASES, "ready"]
    assert all(a.at <= b.at for a, b in zip(phases, phases[1:], strict=False))
    assert statuses(reservation) == ReservationStatus.PROVISIONING
    assert cluster.connection["slurm_account"] == "alpha" and cluster.connection["ssh_key"].startswith("SHA256:")

    services.lifecycle_tick(now=t0)
    assert statuses(reservation) == ReservationStatus.ACTIVE

    services.lifecycle_tick(now=end)
    assert statuses(reservation) == ReservationStatus.ENDING
    assert committed(django_capture_on_commit_callbacks, services.cluster_teardown,
                     cluster_id=cluster.pk) == ClusterStatus.DELETED
    assert statuses(reservation) == ReservationStatus.COMPLETED
    cluster.refresh_from_db()
    assert [t.phase for t in cluster.transitions.order_by("at", "id")][-2:] == ["tearing_down", "deleted"]
    assert not cluster.credentials.current().exists()
    assert StorageVolume.objects.get(cluster=cluster).status == "released"

    names = [name for name, _ in captured]
    assert "cluster.ready" in names and "cluster.deleted" in names
    ready = next(payload for name, payload in captured if name == "cluster.ready")
    assert ready == {"cluster_id": cluster.pk, "reservation_id": reservation.pk,
                     "tenant_id": world.tenants["alpha"].pk, "status": "ready",
                     "transition_id": cluster.transitions.get(phase="ready").pk}
    # Every transition is in the audit log with its time (actor None: the lifecycle worker).
    actions = list(AuditLog.objects.filter(object_type="provisioning.virtualcluster", object_id=str(cluster.pk))
                   .order_by("created_at", "id").values_list("action", flat=True))
    assert actions == ["cluster.create", *[f"cluster.{p}" for p in PROVISION_PHASES], "cluster.ready",
                       "cluster.tearing_down", "cluster.deleted"]
    res_actions = list(AuditLog.objects.filter(object_type="reservations.reservation", object_id=str(reservation.pk))
                       .order_by("created_at", "id").values_list("action", flat=True))
    assert res_actions == ["reservation.create", "reservation.starting_soon", "reservation.provisioning",
                           "reservation.active",
                           "reservation.ending", "reservation.completed"]


def test_a_booking_for_now_is_active_as_soon_as_its_cluster_is_ready(world):
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    assert statuses(reservation) == ReservationStatus.ACTIVE


def test_running_a_task_twice_changes_nothing_the_second_time(world, t0):
    cluster = provisioned(world, t0)
    transitions = ClusterTransition.objects.filter(cluster=cluster).count()
    audits = AuditLog.objects.count()

    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    assert services.lifecycle_tick(now=t0 - timedelta(minutes=10)) == {}
    assert ClusterTransition.objects.filter(cluster=cluster).count() == transitions
    assert AuditLog.objects.count() == audits


def test_a_duplicate_delivery_returns_while_another_worker_holds_the_cluster(world, t0):
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    held, release = threading.Event(), threading.Event()

    def other_worker():
        with connections["default"].cursor() as cur:  # a separate connection: this thread's own
            cur.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_CLUSTER, cluster.pk])
            held.set()
            release.wait(10)
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_CLUSTER, cluster.pk])
        connections["default"].close()

    thread = threading.Thread(target=other_worker)
    thread.start()
    try:
        assert held.wait(10)
        assert services.cluster_provision(cluster_id=cluster.pk) == "busy"
        assert cluster.pk in services.locked_keys(LOCK_CLUSTER)
    finally:
        release.set()
        thread.join()
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY


def test_reminders_are_events_sent_once_per_start_and_end(world, t0, captured, django_capture_on_commit_callbacks):
    reservation = book(world, "alpha-lead", t0, hours=2)
    for minutes in (70, 59, 45):
        committed(django_capture_on_commit_callbacks, services.lifecycle_tick, now=t0 - timedelta(minutes=minutes))
    starting = [p for name, p in captured if name == "reservation.starting_soon"]
    assert len(starting) == 1
    assert starting[0]["reservation_id"] == reservation.pk and starting[0]["start"] == t0.isoformat()

    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    end = t0 + timedelta(hours=2)
    for at in (t0, end - timedelta(minutes=50), end - timedelta(minutes=40)):
        committed(django_capture_on_commit_callbacks, services.lifecycle_tick, now=at)
    assert [p["end"] for name, p in captured if name == "reservation.ending_soon"] == [end.isoformat()]

    # Extended: the new end gets its own reminder.
    Reservation.objects.filter(pk=reservation.pk).update(
        period=(t0, end + timedelta(hours=1)), status=ReservationStatus.ACTIVE)
    committed(django_capture_on_commit_callbacks, services.lifecycle_tick, now=end - timedelta(minutes=1))
    assert [name for name, _ in captured].count("reservation.ending_soon") == 1
    committed(django_capture_on_commit_callbacks, services.lifecycle_tick, now=end + timedelta(minutes=30))
    assert [name for name, _ in captured].count("reservation.ending_soon") == 2


def test_a_booking_made_inside_its_reminder_hour_gets_no_starts_soon(world, captured,
                                                                    django_capture_on_commit_callbacks):
    from django.utils import timezone

    from reservations.timeutil import slot_floor

    start = slot_floor(timezone.now(), 60) + timedelta(hours=1)  # under an hour from now
    reservation = book(world, "alpha-lead", start, hours=2)
    committed(django_capture_on_commit_callbacks, services.lifecycle_tick, now=timezone.now())
    assert VirtualCluster.objects.filter(reservation=reservation).exists()  # provisioning did begin
    assert [name for name, _ in captured].count("reservation.starting_soon") == 0


def test_a_window_missed_entirely_fails_with_a_reason(world, t0):
    reservation = book(world, "alpha-lead", t0, hours=1)
    services.lifecycle_tick(now=t0 + timedelta(hours=2))
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.FAILED
    assert "window ended" in reservation.status_reason
    assert VirtualCluster.objects.get(reservation=reservation).status == ClusterStatus.FAILED


# --- spec à la carte ----------------------------------------------------------------------------


def test_spec_is_validated_against_the_pool_and_the_storage_quota(world, t0, django_capture_on_commit_callbacks):
    reservation = committed(django_capture_on_commit_callbacks, book, world, "alpha-lead", t0)
    cluster = VirtualCluster.objects.get(reservation=reservation)
    lead = world.users["alpha-lead"]

    cluster = services.cluster_configure(actor=lead, cluster=cluster, mig_profile="1g.10gb", cuda_version="12.4",
                                         orchestrator_version="24.11", default_memory_per_gpu_gib=120,
                                         shared_storage_gib=2048)
    assert (cluster.mig_profile, cluster.cuda_version, cluster.orchestrator_version) == ("1g.10gb", "12.4", "24.11")

    bad = {"mig_profile": "1g.5gb", "cuda_version": "11.0", "orchestrator_version": "1.30",
           "default_memory_per_gpu_gib": 4096, "shared_storage_gib": 11 * 1024}
    with pytest.raises(InvalidInput) as excinfo:
        services.cluster_configure(actor=lead, cluster=cluster, **bad)
    assert set(excinfo.value.fields) == set(bad)
    with pytest.raises(PermissionDenied):
        services.cluster_configure(actor=world.users["alpha-viewer"], cluster=cluster, cuda_version="12.6")
    with pytest.raises(PermissionDenied):
        services.cluster_configure(actor=world.users["alpha-member"], cluster=cluster, cuda_version="12.6")

    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    services.cluster_provision(cluster_id=cluster.pk)
    with pytest.raises(InvalidState):
        services.cluster_configure(actor=lead, cluster=cluster, cuda_version="12.6")
    cluster.refresh_from_db()
    detail = cluster.transitions.get(phase="installing_drivers").detail
    assert "CUDA 12.4" in detail and "MIG 1g.10gb" in detail


def test_storage_volumes_never_exceed_the_tenant_quota(world, t0):
    Tenant.objects.filter(slug="alpha").update(storage_quota_tib=1)
    first = book(world, "alpha-lead", t0)
    second = book(world, "alpha-lead", t0)
    VirtualCluster.objects.none()
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    clusters = [VirtualCluster.objects.get(reservation=r) for r in (first, second)]
    VirtualCluster.objects.filter(pk__in=[c.pk for c in clusters]).update(shared_storage_gib=700)

    assert services.cluster_provision(cluster_id=clusters[0].pk) == ClusterStatus.READY
    assert services.cluster_provision(cluster_id=clusters[1].pk) == ClusterStatus.FAILED
    clusters[1].refresh_from_db()
    assert "storage quota exceeded" in clusters[1].status_reason
    assert StorageVolume.objects.active().filter(tenant__slug="alpha").count() == 1


def test_each_tenant_gets_its_own_network_segment_and_the_database_forbids_sharing(world, t0):
    a = provisioned(world, t0, "alpha-lead")
    b = provisioned(world, t0, "beta-lead")
    alpha, beta = Tenant.objects.get(slug="alpha"), Tenant.objects.get(slug="beta")
    assert alpha.vlan_id and beta.vlan_id and alpha.vlan_id != beta.vlan_id
    assert alpha.cidr and beta.cidr and alpha.cidr != beta.cidr
    assert f"VLAN {alpha.vlan_id}" in a.transitions.get(phase="configuring_network").detail
    assert b.connection["slurm_account"] == "beta"
    with pytest.raises(IntegrityError), transaction.atomic():
        Tenant.objects.filter(pk=beta.pk).update(vlan_id=alpha.vlan_id)
    with pytest.raises(IntegrityError), transaction.atomic():
        Tenant.objects.filter(pk=beta.pk).update(cidr=alpha.cidr)


# --- failures and retries -----------------------------------------------------------------------


def test_backend_errors_retry_with_backoff_then_fail_visibly_and_staff_retry_succeeds(world, t0, settings, captured,
                                                                                    django_capture_on_commit_callbacks):
    settings.PORTAL_PROVISIONING_FAULTS = "installing_drivers=error"
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)

    delays = []
    for _attempt in range(2):
        with pytest.raises(services.RetryLater) as excinfo:
            services.cluster_provision(cluster_id=cluster.pk)
        delays.append(excinfo.value.countdown)
        time.sleep(excinfo.value.countdown + 0.05)
    # A duplicate that arrives long before the backoff ends does nothing (the tick or the retry comes later).
    VirtualCluster.objects.filter(pk=cluster.pk).update(next_attempt_at=timezone.now() + timedelta(minutes=1))
    assert services.cluster_provision(cluster_id=cluster.pk) == "waiting"
    VirtualCluster.objects.filter(pk=cluster.pk).update(next_attempt_at=timezone.now())
    assert 0.1 <= delays[0] <= 0.2 and 0.2 <= delays[1] <= 0.4  # 0.2 s · 2^(n-1), jittered to 50–100 %
    with django_capture_on_commit_callbacks(execute=True):
        assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.FAILED

    cluster.refresh_from_db()
    reservation.refresh_from_db()
    assert cluster.status == ClusterStatus.FAILED and cluster.attempts == 3
    assert "installing_drivers: injected transient fault" in cluster.status_reason
    assert reservation.status == ReservationStatus.FAILED and "cluster failed" in reservation.status_reason
    assert not Allocation.objects.filter(reservation=reservation, active=True).exists()
    failed = [p for name, p in captured if name == "cluster.failed"]
    assert failed and failed[0]["phase"] == "installing_drivers" and "injected" in failed[0]["reason"]
    assert AuditLog.objects.filter(action="cluster.attempt_failed", object_id=str(cluster.pk)).count() == 2

    with pytest.raises(PermissionDenied):
        services.cluster_retry(actor=world.users["alpha-lead"], cluster=cluster)
    settings.PORTAL_PROVISIONING_FAULTS = ""
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    reservation.refresh_from_db()
    # The start is a day away: back to confirmed, nodes held again; the tick provisions at lead time.
    assert reservation.status == ReservationStatus.CONFIRMED
    assert Allocation.objects.filter(reservation=reservation, active=True).count() == 1
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    assert statuses(reservation) == ReservationStatus.PROVISIONING
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    retry = ClusterTransition.objects.get(cluster=cluster, phase="pending", actor=world.users["staff"])
    assert retry.detail == "retried by staff"


def test_a_permanent_error_fails_at_once(world, t0, settings):
    settings.PORTAL_PROVISIONING_FAULTS = "attaching_storage=fatal"
    cluster = None
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.FAILED
    cluster.refresh_from_db()
    assert cluster.attempts == 1 and cluster.failed_during == "provisioning"


def test_the_acceptance_gate_holds_back_a_cluster_on_a_failed_node(world, t0, settings):
    reservation = book(world, "alpha-lead", t0, nodes=2)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    node = Allocation.objects.filter(reservation=reservation).first().node
    type(node).objects.filter(pk=node.pk).update(state=NodeState.FAILED)  # no event: the gate must catch it
    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"

    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.FAILED
    cluster.refresh_from_db()
    assert cluster.transitions.filter(phase="running_acceptance_tests").exists()
    assert f"acceptance gate: not available: {node.hostname} (failed)" in cluster.status_reason


GATE_CALLS: list[int] = []


def always_pass_gate(*, cluster):
    GATE_CALLS.append(cluster.pk)
    return services.GateResult(True, "custom gate passed")


def test_the_acceptance_gate_is_a_hook_chosen_by_setting(world, t0, settings):
    settings.PORTAL_ACCEPTANCE_GATE = f"{__name__}.always_pass_gate"
    cluster = provisioned(world, t0)
    assert GATE_CALLS[-1] == cluster.pk
    assert "custom gate passed" in cluster.transitions.get(phase="running_acceptance_tests").detail


# --- cancel, early teardown, node failure ---------------------------------------------------


def test_cancelling_tears_down_and_keeps_the_reservation_cancelled(world, t0):
    cluster = provisioned(world, t0)
    reservation_cancel(actor=world.users["alpha-lead"], reservation=cluster.reservation)
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED
    assert statuses(cluster.reservation) == ReservationStatus.CANCELLED


def test_early_teardown_by_the_lead_completes_the_reservation(world):
    start = now_slot(world)
    reservation = book(world, "alpha-member", start, hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    assert statuses(reservation) == ReservationStatus.ACTIVE

    for who in ("alpha-viewer", "beta-lead"):
        with pytest.raises(PermissionDenied):
            services.cluster_request_teardown(actor=world.users[who], cluster=cluster)
    services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.TEARING_DOWN
    assert cluster.transitions.get(phase="tearing_down").actor == world.users["alpha-lead"]
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED
    assert statuses(reservation) == ReservationStatus.COMPLETED
    with pytest.raises(InvalidState):
        services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)


def test_a_failed_node_is_swapped_for_a_spare_or_the_cluster_is_degraded(world, captured,
                                                                          django_capture_on_commit_callbacks):
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    held = sorted(Allocation.objects.filter(reservation=reservation, active=True).values_list("node__hostname",
                                                                                              flat=True))
    first = type(world.nodes[0]).objects.get(hostname=held[0])

    # node.state_changed → node_sync: the booking moves to a spare (reservations.node_replace_allocations) …
    with django_capture_on_commit_callbacks(execute=True):
        node_update(actor=world.users["staff"], node=first, state=NodeState.FAILED, reason="XID 79")
        assert services.node_sync(node_id=first.pk) == {"replaced": 1}
    replaced = next(p for name, p in captured if name == "node.replaced")
    # … and its node.replaced event brings the cluster along (the task our subscriber enqueues).
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=replaced["failed"],
                                          spare=replaced["spare"]) == "replaced"
    now_held = sorted(Allocation.objects.filter(reservation=reservation, active=True)
                      .values_list("node__hostname", flat=True))
    assert first.hostname not in now_held and len(now_held) == 2 and replaced["spare"] in now_held
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.READY
    assert AuditLog.objects.filter(action="cluster.node_swapped", object_id=str(cluster.pk)).exists()
    from provisioning.backends.simulated import SimulatedBackend

    assert sorted(SimulatedBackend().status(services.build_context(cluster.pk)).nodes) == now_held
    assert services.node_sync(node_id=first.pk) == {}  # a second delivery finds nothing left to move

    # No spare left: the reservation is degraded, and so is the cluster (and the tenant is told).
    for node in type(first).objects.exclude(hostname__in=now_held).exclude(pk=first.pk):
        type(node).objects.filter(pk=node.pk).update(state=NodeState.MAINTENANCE)
    second = type(first).objects.get(hostname=now_held[0])
    with django_capture_on_commit_callbacks(execute=True):
        node_update(actor=world.users["staff"], node=second, state=NodeState.FAILED, reason="ECC")
        assert services.node_sync(node_id=second.pk) == {"degraded": 1}
    lost = next(p for name, p in captured if name == "reservation.degraded")
    with django_capture_on_commit_callbacks(execute=True):
        assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=lost["node"],
                                              spare=None) == "degraded"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.DEGRADED and second.hostname in cluster.status_reason
    degraded = [p for name, p in captured if name == "cluster.degraded"]
    assert degraded and degraded[0]["node"] == second.hostname and "1 missing" in degraded[0]["reason"]


def test_a_node_swap_run_twice_is_audited_once(world, captured, django_capture_on_commit_callbacks):
    """cluster_nodes_changed is a task (acks late): a redelivered message, or a run again after a worker died
    in the backend's call, brings the cluster along again but is the same swap, not a second one."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)

    def fail_one() -> dict:
        host = Allocation.objects.filter(reservation=reservation, active=True).order_by("node__hostname").values_list(
            "node__hostname", flat=True).first()
        node = type(world.nodes[0]).objects.get(hostname=host)
        with django_capture_on_commit_callbacks(execute=True):
            node_update(actor=world.users["staff"], node=node, state=NodeState.FAILED, reason="XID 79")
            services.node_sync(node_id=node.pk)
        return [p for name, p in captured if name == "node.replaced"][-1]

    def swaps() -> list[tuple[str, str]]:
        return list(AuditLog.objects.filter(action="cluster.node_swapped", object_id=str(cluster.pk))
                    .order_by("id").values_list("before__node", "after__node"))

    first = fail_one()
    for _ in range(2):  # the message, then its redelivery
        assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=first["failed"],
                                              spare=first["spare"]) == "replaced"
    assert swaps() == [(first["failed"], first["spare"])]
    # Another swap of the same booking is another row.
    second = fail_one()
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=second["failed"],
                                          spare=second["spare"]) == "replaced"
    assert swaps() == [(first["failed"], first["spare"]), (second["failed"], second["spare"])]
    # No spare left: the node lost is audited once as well.
    held = list(Allocation.objects.filter(reservation=reservation, active=True).values_list("node_id", flat=True))
    type(world.nodes[0]).objects.exclude(pk__in=held).exclude(state=NodeState.FAILED).update(
        state=NodeState.MAINTENANCE)
    host = Allocation.objects.filter(reservation=reservation, active=True).values_list("node__hostname", flat=True)[0]
    with django_capture_on_commit_callbacks(execute=True):
        node_update(actor=world.users["staff"], node=type(world.nodes[0]).objects.get(hostname=host),
                    state=NodeState.FAILED, reason="ECC")
        services.node_sync(node_id=type(world.nodes[0]).objects.get(hostname=host).pk)
    for _ in range(2):
        assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=host, spare=None) == "degraded"
    assert list(AuditLog.objects.filter(action="cluster.node_lost", object_id=str(cluster.pk))
                .values_list("before__node", "after__node")) == [(host, None)]


def test_extending_a_live_cluster_is_applied_to_the_backend(world):
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    new_end = start + timedelta(hours=5)
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=new_end)
    assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    from provisioning.backends.simulated import SimulatedBackend

    assert SimulatedBackend().status(services.build_context(cluster.pk)).end == new_end


def test_simulated_phase_durations_are_configurable(world, t0, settings, monkeypatch):
    from provisioning.backends import simulated

    settings.PORTAL_SIMULATED_PHASE_SECONDS = '{"installing_drivers": 0.3, "default": 0}'
    # Which phase waited how long, as the backend asked: exact, where a wall-clock upper bound on
    # a 0 s phase would only measure how busy this machine is.
    paused: list[str] = []
    slept: list[tuple[str, float]] = []
    real_pause = simulated.SimulatedBackend._pause

    def pause(self, phase: str) -> None:
        paused.append(phase)
        real_pause(self, phase)

    def sleep(seconds: float) -> None:
        slept.append((paused[-1], seconds))
        time.sleep(seconds)

    monkeypatch.setattr(simulated.SimulatedBackend, "_pause", pause)
    monkeypatch.setattr(simulated, "time", types.SimpleNamespace(sleep=sleep))
    cluster = provisioned(world, t0)
    assert paused == list(PROVISION_PHASES)
    assert slept == [("installing_drivers", 0.3)]  # the named phase its time, every other the default 0
    at = {t.phase: t.at for t in cluster.transitions.all()}
    assert (at["running_acceptance_tests"] - at["installing_drivers"]).total_seconds() >= 0.3  # really waited


def test_reconcile_of_the_simulated_fleet(world, t0, settings, capsys):
    from django.core.management import call_command

    from provisioning.backends.simulated import SimulatedBackend

    settings.CACHES = {**settings.CACHES, "default": {**settings.CACHES["default"],
                                                      "KEY_PREFIX": f"prov-reconcile-{time.time_ns()}"}}
    cluster = provisioned(world, t0)
    backend = SimulatedBackend()
    ctx = services.build_context(cluster.pk)
    backend._forget(cluster.pk)  # the fleet lost it
    backend._store(services.build_context(cluster.pk).__class__(**{**ctx.__dict__, "cluster_id": 10**9}))  # a stray
    with pytest.raises(SystemExit):
        call_command("reconcile")
    out = capsys.readouterr().out
    assert f"simulated: orphan cluster-{10**9}" in out and f"simulated: missing cluster-{cluster.pk}" in out
    call_command("reconcile", "--fix")
    assert "2 drifts, 2 repaired" in capsys.readouterr().out
    assert backend.status(ctx).exists
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out


def test_reconcile_json_prints_only_json_lines(world, t0, settings, capsys):
    """--json promises JSON lines on stdout (one drift each), for a cron job or CI to parse: the plain-text
    summary it also printed there broke every parser at the last line; it goes to stderr."""
    import json

    from django.core.management import call_command

    from provisioning.backends.simulated import SimulatedBackend

    settings.CACHES = {**settings.CACHES, "default": {**settings.CACHES["default"],
                                                      "KEY_PREFIX": f"prov-reconcile-json-{time.time_ns()}"}}
    cluster = provisioned(world, t0)
    SimulatedBackend()._forget(cluster.pk)  # the fleet lost it
    with pytest.raises(SystemExit):
        call_command("reconcile", "--json")
    captured = capsys.readouterr()
    drifts = [json.loads(line) for line in captured.out.splitlines()]
    assert [(d["kind"], d["name"], d["repaired"]) for d in drifts] == [("missing", f"cluster-{cluster.pk}", False)]
    assert "1 drift, 0 repaired" in captured.err


def test_a_node_lost_while_building_hands_the_cluster_over_degraded(world, t0):
    reservation = book(world, "alpha-lead", t0, nodes=2)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    held = list(Allocation.objects.filter(reservation=reservation).values_list("node_id", flat=True))
    type(world.nodes[0]).objects.exclude(pk__in=held).update(state=NodeState.MAINTENANCE)  # no spare
    victim = type(world.nodes[0]).objects.get(pk=held[0])
    node_update(actor=world.users["staff"], node=victim, state=NodeState.FAILED, reason="GPU lost")
    assert services.node_sync(node_id=victim.pk) == {"degraded": 1}

    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.DEGRADED
    cluster.refresh_from_db()
    assert [t.phase for t in cluster.transitions.all()][-2:] == ["ready", "degraded"]
    assert "1 node missing:" in cluster.status_reason  # was "1 node(s) missing"
    assert services.build_context(cluster.pk).nodes == (type(victim).objects.get(pk=held[1]).hostname,)


def test_a_failed_teardown_keeps_its_nodes_out_of_service_until_a_retry_succeeds(
        world, settings, django_capture_on_commit_callbacks):
    """The tenant's cluster is still on its nodes: the next tenant's booking must not get them (Slurm downs a
    node whose cleanup failed). An early teardown shows it: the booked window is still ahead."""
    from reservations.models import Node
    from reservations.services import reservation_create

    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    (hostname,) = Allocation.objects.filter(reservation=reservation, active=True).values_list("node__hostname",
                                                                                              flat=True)
    free_before = Node.objects.filter(state=NodeState.AVAILABLE).count()
    services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)
    settings.PORTAL_PROVISIONING_FAULTS = "teardown=fatal"
    assert committed(django_capture_on_commit_callbacks, services.cluster_teardown,
                     cluster_id=cluster.pk) == ClusterStatus.FAILED
    assert statuses(reservation) == ReservationStatus.FAILED
    node = Node.objects.get(hostname=hostname)
    assert node.state == NodeState.MAINTENANCE
    assert node.state_reason.startswith(f"teardown of cluster #{cluster.pk} failed:")
    assert Node.objects.filter(state=NodeState.AVAILABLE).count() == free_before - 1
    # beta books the whole pool's free nodes for the rest of the window: the held node is not among them.
    later = start + timedelta(hours=1)
    free = Node.objects.filter(pool=world.pool, state=NodeState.AVAILABLE).count()
    taken = reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                               node_count=free, start=later, end=later + timedelta(hours=2))
    assert hostname not in set(taken.allocations.values_list("node__hostname", flat=True))

    settings.PORTAL_PROVISIONING_FAULTS = ""
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    assert committed(django_capture_on_commit_callbacks, services.cluster_teardown,
                     cluster_id=cluster.pk) == ClusterStatus.DELETED
    node.refresh_from_db()
    assert (node.state, node.state_reason) == (NodeState.AVAILABLE, "")
    assert statuses(reservation) == ReservationStatus.COMPLETED


def _held_after_a_failed_teardown(world, settings):
    """alpha's running cluster, torn down early with a fatal fault: (the cluster, the node it still holds)."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    node = Allocation.objects.get(reservation=reservation, active=True).node
    services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)
    settings.PORTAL_PROVISIONING_FAULTS = "teardown=fatal"
    services.cluster_teardown(cluster_id=cluster.pk)
    return cluster, node


def test_releasing_held_nodes_leaves_a_node_staff_moved_on_alone(world, settings, django_capture_on_commit_callbacks):
    from reservations.models import Node

    cluster, node = _held_after_a_failed_teardown(world, settings)
    node_update(actor=world.users["staff"], node=Node.objects.get(pk=node.pk), state=NodeState.FAILED,
                reason="PSU replaced, awaiting burn-in")
    settings.PORTAL_PROVISIONING_FAULTS = ""
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED
    node.refresh_from_db()
    assert (node.state, node.state_reason) == (NodeState.FAILED, "PSU replaced, awaiting burn-in")


@pytest.mark.django_db(transaction=True)
def test_releasing_held_nodes_leaves_a_node_staff_retire_meanwhile_alone(world, settings):
    """The same, racing: staff retire the held node while the retried teardown gives its nodes back (the
    release read the node as held, then waited for staff's change): the node stays retired, never bookable."""
    from reservations.models import Node
    from reservations.services import _lock_nodes
    from tests.racing import behind_a_lock

    cluster, node = _held_after_a_failed_teardown(world, settings)
    settings.PORTAL_PROVISIONING_FAULTS = ""
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)

    def staff_retires() -> None:
        _lock_nodes([node.pk])
        Node.objects.select_for_update().filter(pk=node.pk).update(state=NodeState.RETIRED, state_reason="scrapped")

    assert behind_a_lock(staff_retires, lambda: services.cluster_teardown(cluster_id=cluster.pk)) \
        == ClusterStatus.DELETED
    node.refresh_from_db()
    assert (node.state, node.state_reason) == (NodeState.RETIRED, "scrapped")


def test_releasing_held_nodes_leaves_a_node_an_open_repair_owns_to_its_repair(
        world, settings, django_capture_on_commit_callbacks):
    """A node held after a failed teardown that staff then sent to repair: the teardown's retry gives back
    the nodes it held, but not that one (its repair brings it back after a passing re-test)."""
    from provisioning.health.services import repair_open, repairs_reconcile
    from reservations.models import Node

    cluster, node = _held_after_a_failed_teardown(world, settings)
    assert Node.objects.get(pk=node.pk).state == NodeState.MAINTENANCE
    repair = repair_open(actor=world.users["staff"], node=Node.objects.get(pk=node.pk), reason="Xid 79 on GPU 3")

    settings.PORTAL_PROVISIONING_FAULTS = ""
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    assert committed(django_capture_on_commit_callbacks, services.cluster_teardown,
                     cluster_id=cluster.pk) == ClusterStatus.DELETED
    # was: available again, with repair #N still open: the health upkeep took it out a minute later
    assert Node.objects.get(pk=node.pk).state == NodeState.MAINTENANCE
    assert repair.node_id == node.pk and repairs_reconcile() == 0
    assert statuses(cluster.reservation) == ReservationStatus.COMPLETED


@pytest.mark.parametrize("count, noun", [(1, "node"), (2, "nodes")])
def test_the_timeline_counts_nodes_in_the_right_number(world, t0, count, noun):
    """A one-node cluster's timeline read "1 simulated nodes claimed" and "1 nodes answer; 1 nodes available"."""
    import re

    cluster = provisioned(world, t0, nodes=count)
    details = " | ".join(cluster.transitions.values_list("detail", flat=True))
    nodes = f"{count} {noun}"
    assert f"{count} simulated {noun} claimed" in cluster.transitions.get(phase="allocating_nodes").detail, details
    acceptance = cluster.transitions.get(phase="running_acceptance_tests").detail
    assert f"{nodes} answer" in acceptance and f"{nodes} available" in acceptance, details
    assert not re.search(r"\b1 nodes\b", details), details
