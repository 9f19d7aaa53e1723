"""Virtual-cluster writes: the lifecycle tick, the phase runner, teardown, booking sync, spec, secrets.

How the pieces fit (DESIGN §5):

- A booking's ``reservation.confirmed`` event creates its cluster (``pending``); a backend
  that holds bookings (Slurm) gets the window at once via :func:`reservation_sync`.
- :func:`lifecycle_tick` (beat, every minute) reads the database and moves what is due:
  provisioning ``PORTAL_PROVISION_LEAD_MINUTES`` before start, active at start (once the
  cluster is ready), ending at end, reminders before start and end; and it resends any
  task whose message was lost (broker restart, worker killed), so no transition depends
  on one message surviving.
- :func:`cluster_provision` runs the phases in order, each recorded with its time; it
  holds a session advisory lock for the cluster, so a duplicate delivery returns at once,
  and PostgreSQL drops the lock if the worker dies, so a redelivery resumes where it
  stopped. Backend calls never run inside a transaction.
- Transient backend errors are retried with exponential backoff, counted in the
  database (not in the message); after PORTAL_PROVISIONING_MAX_ATTEMPTS the cluster and
  its reservation are ``failed`` with the reason, and staff can :func:`cluster_retry`.

Events (after commit): ``cluster.ready`` (+ recovered: true when a cluster degraded by a refused window
change is whole again, not built), ``cluster.failed`` (+ phase, reason),
``cluster.degraded`` (+ reason; + node and allocation_id when one was lost, none when the backend
refused a window change), ``cluster.deleted``, ``cluster.credentials_renewed`` (+ issued_at, expires_at,
previous_expires_at: a live cluster's kubeconfig issued again) — each with cluster_id, reservation_id,
tenant_id, status (the phase events also with transition_id, the row of that transition) — and
``reservation.starting_soon`` /
``reservation.ending_soon`` (reservation_id, tenant_id, cluster_id, start/end).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import transaction
from django.db.models import F, Q, Sum
from django.utils import timezone
from django.utils.module_loading import import_string

from portal.core import events
from portal.core.actors import STAFF_WORDS, actor_name
from portal.core.exceptions import Busy, InvalidInput, InvalidState, NotFound, PermissionDenied, QuotaExceeded
from portal.core.locks import advisory_lock, locked_keys
from portal.core.models import AuditLog
from portal.core.redact import without_secrets
from portal.core.services import audit_record, refuse_stale
from portal.core.words import count_of
from reservations.choices import HOLDING_STATUSES, NodeState, ReservationStatus
from reservations.models import Allocation, Node, Pool, Reservation
from reservations.services import node_replace_allocations, node_update, reservation_reopen, reservation_set_status
from tenants.models import Tenant
from tenants.services import tenant_update

from . import crypto
from .backends.base import (
    BackendConflict,
    BackendError,
    BackendWait,
    ClusterContext,
    DrainIncomplete,
    Drift,
    PhaseResult,
    ProvisioningBackend,
    RepairGuard,
)
from .backends.registry import backend_for_orchestrator, configured_backends, get_backend, holds_bookings
from .choices import (
    CREDENTIAL_FILENAMES,
    DEFAULT_ORCHESTRATOR_VERSION,
    LIVE_STATUSES,
    PROVISION_PHASES,
    PROVISIONING_STATUSES,
    ClusterStatus,
    CredentialKind,
    FailedDuring,
    TransitionSource,
    VolumeStatus,
)
from .conf import setting, setting_float, setting_int
from .constants import LOCK_BOOKING, LOCK_CLUSTER, LOCK_NODE_SYNC, LOCK_TENANT_NETWORK, LOCK_TICK
from .models import ClusterCredential, ClusterTransition, NodeDrain, PoolCapability, StorageVolume, VirtualCluster
from .selectors import (
    can_download_credentials,
    can_manage_cluster,
    pool_capabilities,
    retry_refusal,
    teardown_hold_reason,
)

__all__ = [
    "RetryLater",
    "GateResult",
    "acceptance_gate",
    "node_state_gate",
    "cluster_create_for_reservation",
    "storage_window_guard",
    "cluster_configure",
    "begin_provisioning",
    "cluster_provision",
    "cluster_teardown",
    "cluster_request_teardown",
    "cluster_retry",
    "cluster_cleanup_failed",
    "reservation_sync",
    "node_sync",
    "cluster_nodes_changed",
    "lifecycle_tick",
    "credential_download",
    "credentials_rotate",
    "reconcile",
]

logger = logging.getLogger(__name__)

OUT_OF_SERVICE = (NodeState.FAILED, NodeState.DRAINING, NodeState.MAINTENANCE, NodeState.RETIRED)
_PHASE_METHOD: dict[str, str] = {
    ClusterStatus.ALLOCATING_NODES: "allocate_nodes",
    ClusterStatus.CONFIGURING_NETWORK: "configure_network",
    ClusterStatus.ATTACHING_STORAGE: "attach_storage",
    ClusterStatus.INSTALLING_DRIVERS: "install_drivers",
    ClusterStatus.RUNNING_ACCEPTANCE_TESTS: "verify",
}
# A retry message arriving this much before its backoff ends waits instead of being dropped.
_EARLY_SLACK_SECONDS = 5.0
_SECRET_KINDS = {"kubeconfig": CredentialKind.KUBECONFIG, "ssh_key": CredentialKind.SSH_KEY}


class RetryLater(Exception):
    """Tell the task to run again in countdown seconds (backoff, or a teardown still in progress)."""

    def __init__(self, countdown: float, reason: str = "") -> None:
        super().__init__(reason or f"retry in {countdown:.1f}s")
        self.countdown = countdown
        self.reason = reason


class _Stop(Exception):
    """The cluster moved on under us (teardown requested, failed elsewhere): stop quietly."""


# --- plumbing ---------------------------------------------------------------------------


def _send(task_name: str, *args: Any, countdown: float | None = None) -> None:
    """Publish a task now; a broker outage is logged and left to the tick to repair."""
    from . import tasks

    try:
        getattr(tasks, task_name).apply_async(
            args=list(args), countdown=countdown, retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1},
        )
    except Exception:  # noqa: BLE001 - any broker error: the database still says what to do
        logger.warning("could not enqueue %s%r; the lifecycle tick will resend it", task_name, args, exc_info=True)


def _enqueue(task_name: str, *args: Any) -> None:
    """Publish a task once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: _send(task_name, *args))


def _backoff(attempt: int) -> float:
    """Exponential backoff with jitter: base · 2^(attempt-1), capped, times 0.5–1."""
    base = setting_float("PORTAL_PROVISIONING_RETRY_BACKOFF_SECONDS", 15.0)
    cap = setting_float("PORTAL_PROVISIONING_RETRY_BACKOFF_MAX_SECONDS", 600.0)
    delay = min(cap, base * (2 ** max(0, attempt - 1)))
    return delay * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not security


def _lock_cluster(cluster_id: int) -> VirtualCluster:
    # of=self: lock the cluster row only, not the joined reservation and tenant rows.
    return (VirtualCluster.objects.select_for_update(of=("self",)).select_related("reservation", "tenant")
            .get(pk=cluster_id))


def _cluster_event(name: str, cluster: VirtualCluster, **extra: Any) -> None:
    events.emit(name, cluster_id=cluster.pk, reservation_id=cluster.reservation_id, tenant_id=cluster.tenant_id,
                status=cluster.status, **extra)


# A live cluster's kubeconfig was issued again (a capped token renewed, a window change, a rebuilt namespace).
CREDENTIALS_RENEWED = "cluster.credentials_renewed"

_PHASE_EVENTS = {
    ClusterStatus.READY: "cluster.ready",
    ClusterStatus.FAILED: "cluster.failed",
    ClusterStatus.DEGRADED: "cluster.degraded",
    ClusterStatus.DELETED: "cluster.deleted",
}


def _transition(
    cluster: VirtualCluster, phase: str, *, actor: Any = None, source: str = TransitionSource.LIFECYCLE,
    detail: str = "", event_extra: dict[str, Any] | None = None,
) -> ClusterTransition:
    """Move a locked cluster to phase: the status, its timestamp, the audit row, the event."""
    now = timezone.now()
    previous = cluster.status
    # The detail is what the team reads (its cluster's page, the API, its Slack channel): a backend's error in
    # it goes without the credentials it may carry; the whole error is in last_error (admin) and the log.
    detail = without_secrets(detail, limit=500)
    if phase == ClusterStatus.TEARING_DOWN and previous != phase:
        # Teardown is a pipeline of its own: the attempts provisioning spent do not count against it.
        cluster.attempts = 0
        cluster.next_attempt_at = None
    cluster.status = phase
    cluster.phase_started_at = now
    cluster.heartbeat_at = now
    cluster.status_reason = detail[:500]
    cluster.save()
    transition = ClusterTransition.objects.create(
        cluster=cluster, phase=phase, previous=previous, at=now, source=source, detail=detail[:500],
        actor=actor if getattr(actor, "pk", None) else None,
    )
    audit_record(actor=actor, action=f"cluster.{phase}", obj=cluster, tenant_id=cluster.tenant_id,
                 before={"status": previous}, after={"status": phase, "detail": detail[:500], "source": source})
    if phase in _PHASE_EVENTS:
        extra = dict(event_extra or {})
        if phase in (ClusterStatus.FAILED, ClusterStatus.DEGRADED):
            extra.setdefault("reason", detail[:500])
        # transition_id names this transition: a subscriber handed the event late (the outbox retried it) tells it
        # as it was, not as whichever transition of the phase is the newest by then.
        _cluster_event(_PHASE_EVENTS[phase], cluster, transition_id=transition.pk, **extra)
    return transition


def _allocated_hostnames(reservation_id: int) -> tuple[str, ...]:
    active = list(Allocation.objects.filter(reservation_id=reservation_id, active=True)
                  .order_by("node__hostname").values_list("node__hostname", flat=True))
    if active:
        return tuple(active)
    # A failed reservation's allocations were released; its cluster still ran on them.
    return tuple(Allocation.objects.filter(reservation_id=reservation_id, replaced_at__isnull=True)
                 .order_by("node__hostname").values_list("node__hostname", flat=True).distinct())


def build_context(cluster_id: int) -> ClusterContext:
    """Read everything a backend needs about the cluster, fresh from the database (two queries)."""
    cluster = VirtualCluster.objects.select_related(
        "reservation__pool__capability", "tenant", "volume").get(pk=cluster_id)
    reservation, pool, tenant = cluster.reservation, cluster.reservation.pool, cluster.tenant
    caps = pool_capabilities(pool)
    volume = getattr(cluster, "volume", None)
    return ClusterContext(
        cluster_id=cluster.pk,
        reservation_id=reservation.pk,
        tenant_slug=tenant.slug,
        pool_name=pool.name,
        gpu_model=pool.gpu_model,
        gpus_per_node=pool.gpus_per_node,
        nodes=_allocated_hostnames(reservation.pk),
        start=reservation.period.lower,
        end=reservation.period.upper,
        orchestrator=cluster.orchestrator,
        orchestrator_version=cluster.orchestrator_version,
        cuda_version=cluster.cuda_version,
        mig_profile=cluster.mig_profile,
        mig_instances_per_gpu=caps.mig_profiles.get(cluster.mig_profile) if cluster.mig_profile else None,
        default_memory_per_gpu_gib=cluster.default_memory_per_gpu_gib,
        shared_storage_gib=cluster.shared_storage_gib,
        vlan_id=tenant.vlan_id,
        cidr=tenant.cidr,
        volume_name=volume.name if volume is not None else "",
        backend_state=dict(cluster.backend_state),
        status=cluster.status,
        created_at=cluster.created_at,
    )


@contextlib.contextmanager
def _backend(name: str) -> Iterator[ProvisioningBackend]:
    backend = get_backend(name)
    try:
        yield backend
    finally:
        backend.close()


# --- the acceptance gate (the hook the health checks replace) --------------------------


@dataclass
class GateResult:
    passed: bool
    detail: str
    nodes: dict[str, str] = field(default_factory=dict)


def node_state_gate(*, cluster: VirtualCluster) -> GateResult:
    """The default gate: every node of the cluster is ``available`` in the portal (none failed/draining)."""
    nodes = dict(Node.objects.filter(
        allocations__reservation_id=cluster.reservation_id, allocations__active=True
    ).values_list("hostname", "state"))
    bad = {host: state for host, state in nodes.items() if state != NodeState.AVAILABLE}
    if not nodes:
        return GateResult(False, "no nodes are allocated", nodes)
    if bad:
        return GateResult(False, "not available: " + ", ".join(f"{h} ({s})" for h, s in sorted(bad.items())), nodes)
    return GateResult(True, f"{count_of(len(nodes), 'node')} available", nodes)


def acceptance_gate(*, cluster: VirtualCluster) -> GateResult:
    """Decide whether the cluster may be handed over; run in ``running_acceptance_tests``.

    The hook: ``PORTAL_ACCEPTANCE_GATE`` names a function ``f(*, cluster) -> GateResult``
    (dotted path; default :func:`node_state_gate`). The health-check integration points it
    at real GPU checks (DCGM, burn, NCCL). A gate that does not pass counts as a transient
    failure: retried with backoff, then the cluster fails with the gate's detail. A gate
    may raise RetryLater to be asked again later (checks still running) without counting.
    """
    gate: Callable[..., GateResult] = import_string(
        setting("PORTAL_ACCEPTANCE_GATE", "provisioning.services.node_state_gate"))
    return gate(cluster=cluster)


# --- creating and configuring ------------------------------------------------------------


def cluster_create_for_reservation(*, reservation_id: int) -> VirtualCluster | None:
    """Create the reservation's pending cluster if it has none (idempotent; nests in a transaction)."""
    with transaction.atomic():
        reservation = (Reservation.objects.select_for_update(of=("self",)).select_related("pool", "tenant")
                       .filter(pk=reservation_id).first())
        if reservation is None:
            return None
        existing = VirtualCluster.objects.filter(reservation=reservation).first()
        if existing is not None or reservation.status not in HOLDING_STATUSES:
            return existing
        caps = pool_capabilities(reservation.pool)
        # The default storage, at most what the tenant's clusters overlapping this booking leave (the rule of
        # cluster_configure, under its lock): a default that overlapped them made one of them fail when provisioned.
        tenant = _lock_tenant_storage(reservation.tenant_id)
        others = (_clusters_sharing_storage(tenant_id=tenant.pk, period=reservation.period, exclude_cluster_id=None)
                  .aggregate(total=Sum("shared_storage_gib"))["total"] or 0)
        storage = max(0, min(setting_int("PORTAL_DEFAULT_SHARED_STORAGE_GIB", 1024),
                             tenant.storage_quota_tib * 1024 - others))
        cluster = VirtualCluster.objects.create(
            reservation=reservation,
            tenant=tenant,
            backend=backend_for_orchestrator(reservation.orchestrator),
            orchestrator=reservation.orchestrator,
            orchestrator_version=DEFAULT_ORCHESTRATOR_VERSION.get(reservation.orchestrator, ""),
            cuda_version=reservation.cuda_version,
            default_memory_per_gpu_gib=caps.default_memory_per_gpu_gib,
            shared_storage_gib=storage,
        )
        ClusterTransition.objects.create(cluster=cluster, phase=ClusterStatus.PENDING, at=cluster.phase_started_at,
                                         detail="booked")
        audit_record(actor=None, action="cluster.create", obj=cluster, tenant_id=tenant.pk,
                     after=_spec_snapshot(cluster))
        if holds_bookings(cluster.backend):
            _enqueue("sync_reservation", reservation.pk)
    return cluster


def _spec_snapshot(cluster: VirtualCluster) -> dict[str, Any]:
    return {
        "orchestrator": cluster.orchestrator,
        "orchestrator_version": cluster.orchestrator_version,
        "cuda_version": cluster.cuda_version,
        "mig_profile": cluster.mig_profile,
        "default_memory_per_gpu_gib": cluster.default_memory_per_gpu_gib,
        "shared_storage_gib": cluster.shared_storage_gib,
    }


def validate_spec(*, cluster: VirtualCluster, spec: dict[str, Any]) -> dict[str, str]:
    """Check a spec against what the cluster's pool supports and the tenant's storage quota."""
    caps = pool_capabilities(cluster.reservation.pool)
    errors: dict[str, str] = {}
    versions = caps.orchestrator_versions.get(cluster.orchestrator, ())
    if spec["orchestrator_version"] not in versions:
        errors["orchestrator_version"] = f"{cluster.orchestrator} versions offered: {', '.join(versions)}."
    if spec["cuda_version"] not in caps.cuda_versions:
        errors["cuda_version"] = f"This pool offers CUDA {', '.join(caps.cuda_versions)}."
    if spec["mig_profile"] and spec["mig_profile"] not in caps.mig_profiles:
        offered = ", ".join(caps.mig_profiles) or "none (this GPU model has no MIG)"
        errors["mig_profile"] = f"MIG profiles of {cluster.reservation.pool.gpu_model}: {offered}."
    memory = spec["default_memory_per_gpu_gib"]
    if not 1 <= memory <= caps.max_memory_per_gpu_gib:
        errors["default_memory_per_gpu_gib"] = f"Between 1 and {caps.max_memory_per_gpu_gib} GiB."
    quota_gib = cluster.tenant.storage_quota_tib * 1024
    if not 0 <= spec["shared_storage_gib"] <= quota_gib:
        errors["shared_storage_gib"] = f"Between 0 and the tenant's storage quota ({quota_gib} GiB)."
    return errors


_NOT_HOLDING_STORAGE = (ClusterStatus.DELETED, ClusterStatus.FAILED, ClusterStatus.TEARING_DOWN)


def _clusters_sharing_storage(*, tenant_id: int, period: Any, exclude_cluster_id: int | None) -> Any:
    """The tenant's other clusters whose storage counts against a cluster in period: live clusters of held
    bookings whose window overlaps it. One rule for configuring a cluster, changing a booking's window and
    attaching a volume (call it under the tenant row lock)."""
    return (VirtualCluster.objects.filter(tenant_id=tenant_id).exclude(pk=exclude_cluster_id)
            .exclude(status__in=_NOT_HOLDING_STORAGE)
            .filter(reservation__status__in=HOLDING_STATUSES, reservation__period__overlap=period))


def _lock_tenant_storage(tenant_id: int) -> Tenant:
    """The tenant row lock that serialises one tenant's storage decisions (configure, window change, volume)."""
    return Tenant.objects.select_for_update(no_key=True).get(pk=tenant_id)


def _storage_left_for(cluster: VirtualCluster) -> int:
    """GiB of the tenant's storage quota that the tenant's other clusters leave to this one while its
    booking runs: their volumes (or the volumes they will take) if their bookings overlap its window.
    Takes the tenant row lock that volume allocation and window changes take (_ensure_volume,
    storage_window_guard), so two changes at once cannot both count the same room. A storage change
    accepted here can no longer make another cluster of the tenant fail for lack of storage when it is
    provisioned."""
    tenant = _lock_tenant_storage(cluster.tenant_id)
    # The window as it is now, read under the lock: the caller's copy was read before it, and a move of the
    # booking (storage_window_guard holds this lock) may have committed meanwhile.
    period = Reservation.objects.values_list("period", flat=True).get(pk=cluster.reservation_id)
    others = (_clusters_sharing_storage(tenant_id=tenant.pk, period=period, exclude_cluster_id=cluster.pk)
              .aggregate(total=Sum("shared_storage_gib"))["total"] or 0)
    return max(0, tenant.storage_quota_tib * 1024 - others)


def storage_window_guard(reservation: Reservation, period: Any) -> None:
    """Refuse a booking's new window where its cluster's storage and that of the tenant's other clusters
    overlapping the new window exceed the tenant's storage quota — the rule cluster_configure applies
    (registered with reservations.services.window_change_guards). A window inside the old one overlaps
    nothing new and is never refused (a quota lowered since must not stop a booking from shrinking)."""
    old = reservation.period
    if old.lower <= period.lower and period.upper <= old.upper:
        return
    cluster = (VirtualCluster.objects.filter(reservation_id=reservation.pk).exclude(status__in=_NOT_HOLDING_STORAGE)
               .values("pk", "tenant_id").first())
    if cluster is None:
        return
    tenant = _lock_tenant_storage(cluster["tenant_id"])
    # Read under the lock: a configure of this cluster or of another one that committed meanwhile is seen.
    own = VirtualCluster.objects.values_list("shared_storage_gib", flat=True).get(pk=cluster["pk"])
    if not own:
        return
    others = (_clusters_sharing_storage(tenant_id=tenant.pk, period=period, exclude_cluster_id=cluster["pk"])
              .aggregate(total=Sum("shared_storage_gib"))["total"] or 0)
    quota = tenant.storage_quota_tib * 1024
    if own + others > quota:
        raise QuotaExceeded(
            f"Storage quota exceeded: the tenant's other clusters in the new window hold {others} GiB and this "
            f"booking's cluster {own} GiB, more than the {quota} GiB ({tenant.storage_quota_tib} TiB) storage "
            "quota. Lower the cluster's shared storage, or choose another window.")


def cluster_configure(*, actor: Any, cluster: VirtualCluster, **changes: Any) -> VirtualCluster:
    """Choose the cluster's spec à la carte, before provisioning starts (lead, or the booking member)."""
    allowed = ("orchestrator_version", "cuda_version", "mig_profile", "default_memory_per_gpu_gib",
               "shared_storage_gib")
    unknown = set(changes) - set(allowed)
    if unknown:
        raise InvalidInput(f"{sorted(unknown)[0]}: cannot be changed.",
                           fields={k: "Cannot be changed." for k in unknown})
    with transaction.atomic(durable=True):
        cluster = VirtualCluster.objects.select_for_update(of=("self",)).select_related(
            "reservation__pool", "tenant").get(pk=cluster.pk)
        if not can_manage_cluster(user=actor, cluster=cluster):
            raise PermissionDenied("Only the tenant's lead or the member who booked it can change the cluster.")
        if cluster.status != ClusterStatus.PENDING:
            raise InvalidState(f"Cluster #{cluster.pk} is {cluster.status}; its spec can change only while pending.")
        if cluster.reservation.status not in HOLDING_STATUSES:
            raise InvalidState(f"Reservation #{cluster.reservation_id} is {cluster.reservation.status}; "
                               "its cluster can no longer change.")
        before = _spec_snapshot(cluster)
        sent = {k: v for k, v in changes.items() if v is not None}
        spec = {**before, **sent}
        spec["mig_profile"] = spec["mig_profile"] or ""
        # Only what the caller changes is judged: a value set earlier that no longer fits (the
        # tenant's storage quota was lowered since) must not block changing another field. The
        # storage itself is checked again, under a lock, when it is allocated.
        errors = {k: v for k, v in validate_spec(cluster=cluster, spec=spec).items() if k in sent}
        if "shared_storage_gib" in sent and "shared_storage_gib" not in errors:
            left = _storage_left_for(cluster)
            if spec["shared_storage_gib"] > left:
                errors["shared_storage_gib"] = (
                    f"The tenant's other clusters in this window hold its storage quota but {left} GiB; "
                    f"at most {left} GiB.")
        if errors:
            first = next(iter(errors))
            raise InvalidInput(f"{first}: {errors[first]}", fields=errors)
        if all(spec[key] == before[key] for key in allowed):
            return cluster  # no change: nothing saved, and no audit entry of a change from A to A
        for key in allowed:
            setattr(cluster, key, spec[key])
        cluster.save()
        audit_record(actor=actor, action="cluster.configure", obj=cluster, tenant_id=cluster.tenant_id,
                     before=before, after=_spec_snapshot(cluster))
    return cluster


# --- provisioning ------------------------------------------------------------------------


def begin_provisioning(*, reservation_id: int, now: datetime | None = None, dispatch: bool = True,
                       actor: Any = None) -> VirtualCluster | None:
    """Move a confirmed reservation to provisioning and send its cluster's provisioning task."""
    now = now or timezone.now()
    lead = timedelta(minutes=setting_int("PORTAL_PROVISION_LEAD_MINUTES", 30))
    with transaction.atomic():
        # Due by its window as it is under the reservation's lock: the caller read it before, and a start moved
        # later since (allowed while confirmed) must not be provisioned ahead of its new lead time.
        if not _lock_reservation_if(reservation_id, period__startswith__lte=now + lead, period__endswith__gt=now):
            return None
        reservation = reservation_set_status(
            reservation_id=reservation_id, status=ReservationStatus.PROVISIONING,
            expected=(ReservationStatus.CONFIRMED,), reason="provisioning lead time reached", actor=actor)
        if reservation is None:
            return None
        cluster = cluster_create_for_reservation(reservation_id=reservation_id)
        if cluster is None:
            return None
        VirtualCluster.objects.filter(pk=cluster.pk).update(dispatched_at=now)
        if dispatch:
            _enqueue("provision_cluster", cluster.pk)
    return cluster


def cluster_provision(*, cluster_id: int) -> str:
    """Run the cluster's remaining phases; safe to call any number of times, from any worker.

    Return what happened ("ready", "busy", "not due", …); raise RetryLater when a
    transient failure should be tried again after a backoff.
    """
    with advisory_lock(LOCK_CLUSTER, cluster_id) as held:
        if not held:
            return "busy"
        try:
            return _provision_locked(cluster_id)
        except RetryLater as exc:
            _expect_retry(cluster_id, exc)
            raise


# How long a task waits for a lock another worker holds (a cluster's, a node's) before it asks again later.
LOCK_WAIT_S = 10.0
_CLUSTER_BUSY = "cluster busy (provisioning or teardown running)"


@contextlib.contextmanager
def _held_or_retry(namespace: int, key: int, *, busy: str, wait: float | None = None):
    """Hold an advisory lock for the block, waiting up to wait (LOCK_WAIT_S); RetryLater if it stays taken."""
    with advisory_lock(namespace, key, wait=LOCK_WAIT_S if wait is None else wait) as held:
        if not held:
            raise RetryLater(5, busy)
        yield


def _expect_retry(cluster_id: int, exc: RetryLater) -> None:
    """Say when this cluster's own task comes back (a backoff, the acceptance gate's checks still
    running, a teardown in progress): the lifecycle tick resends work only once that time has passed
    without it, instead of starting a second chain of retries beside the first."""
    VirtualCluster.objects.filter(pk=cluster_id).update(
        next_attempt_at=timezone.now() + timedelta(seconds=exc.countdown))


def _provision_locked(cluster_id: int) -> str:
    cluster = VirtualCluster.objects.select_related("reservation", "tenant").filter(pk=cluster_id).first()
    if cluster is None:
        return "gone"
    reservation = cluster.reservation
    if reservation.status != ReservationStatus.PROVISIONING:
        return "not due"
    if cluster.status in LIVE_STATUSES:
        _activate_if_started(reservation)
        return cluster.status
    if cluster.status not in PROVISIONING_STATUSES:
        return cluster.status
    if cluster.next_attempt_at:
        early = (cluster.next_attempt_at - timezone.now()).total_seconds()
        if early > _EARLY_SLACK_SECONDS:
            return "waiting"  # an early duplicate; the backoff's own message (or the tick) comes later
        if early > 0:
            time.sleep(early)  # the retry's own message, a little ahead (clocks of two machines)
    start = 0 if cluster.status == ClusterStatus.PENDING else PROVISION_PHASES.index(cluster.status)
    done: tuple[str, PhaseResult] | None = None
    try:
        with _backend(cluster.backend) as backend:
            for phase in PROVISION_PHASES[start:]:
                _step(cluster_id, done=done, enter=phase)
                done = (phase, _run_phase(backend, phase, cluster_id))
    except _Stop:
        return "stopped"
    except BackendWait as exc:
        # The backend is waiting on the previous booking (its window, its teardown): no attempt is spent.
        logger.info("cluster %s waits: %s", cluster_id, exc.message)
        raise RetryLater(exc.countdown, exc.message) from exc
    except BackendConflict as exc:
        _repair_conflicts(exc, own_reservation_id=reservation.pk)
        return _record_failure(cluster_id, exc, during=FailedDuring.PROVISIONING)
    except _GateFailed as exc:
        return _record_failure(cluster_id, BackendError(f"acceptance gate: {exc}"), during=FailedDuring.PROVISIONING)
    except BackendError as exc:
        return _record_failure(cluster_id, exc, during=FailedDuring.PROVISIONING)
    except SoftTimeLimitExceeded:
        # A phase that outlives the task's time limit counts as a failed attempt; uncounted, the tick
        # resent it for ever and the cluster sat in that phase until its window ended.
        return _record_failure(cluster_id, _timed_out(cluster_id), during=FailedDuring.PROVISIONING)
    return _finish_ready(cluster_id, done=done)


def _timed_out(cluster_id: int) -> BackendError:
    phase = VirtualCluster.objects.values_list("status", flat=True).get(pk=cluster_id)
    return BackendError(f"{phase} did not finish within the task time limit")


class _GateFailed(Exception):
    pass


def _step(cluster_id: int, *, done: tuple[str, PhaseResult] | None, enter: str) -> VirtualCluster:
    """In one transaction: keep what the finished phase produced, then enter the next phase.

    The cluster row lock orders this against a teardown request; a cluster that moved on
    (its reservation is no longer provisioning, or it left the pipeline) stops the run.
    """
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if done is not None:
            _absorb(cluster, *done)
        if cluster.reservation.status != ReservationStatus.PROVISIONING or \
                cluster.status not in PROVISIONING_STATUSES:
            raise _Stop
        if enter == ClusterStatus.READY:
            if cluster.status == ClusterStatus.RUNNING_ACCEPTANCE_TESTS:
                cluster.attempts = 0
                cluster.next_attempt_at = None
                cluster.last_error = ""
                _transition(cluster, ClusterStatus.READY, detail="acceptance tests passed")
                missing = cluster.reservation.missing_nodes
                if missing:  # a node failed with no spare while we built: handed over short
                    _transition(cluster, ClusterStatus.DEGRADED, source=TransitionSource.NODE,
                                detail=f"{count_of(missing, 'node')} missing: failed with no spare free")
                _activate_if_started(cluster.reservation)
        elif cluster.status == enter:  # resuming a phase a crash interrupted: run it again, no new record
            cluster.heartbeat_at = timezone.now()
            cluster.save(update_fields=["heartbeat_at", "updated_at"])
        else:
            _transition(cluster, enter)
    return cluster


def _run_phase(backend: ProvisioningBackend, phase: str, cluster_id: int) -> PhaseResult:
    """Do the portal's part of the phase, then the backend's."""
    ssh_fingerprint = None
    if phase == ClusterStatus.CONFIGURING_NETWORK:
        cluster = VirtualCluster.objects.select_related("tenant").get(pk=cluster_id)
        _ensure_tenant_network(cluster.tenant_id)
        ssh_fingerprint = _ensure_ssh_key(cluster)
    elif phase == ClusterStatus.ATTACHING_STORAGE:
        _ensure_volume(cluster_id)
    ctx = build_context(cluster_id)
    if phase == ClusterStatus.ALLOCATING_NODES and not ctx.nodes:
        raise BackendError("the reservation holds no nodes", transient=False)
    result = getattr(backend, _PHASE_METHOD[phase])(ctx)
    if ssh_fingerprint:
        result.connection.setdefault("ssh_key", ssh_fingerprint)
    if phase == ClusterStatus.RUNNING_ACCEPTANCE_TESTS:
        gate = acceptance_gate(cluster=VirtualCluster.objects.get(pk=cluster_id))
        if not gate.passed:
            raise _GateFailed(gate.detail)
        result.detail = "; ".join(filter(None, [result.detail, gate.detail]))
    return result


def _absorb(cluster: VirtualCluster, phase: str, result: PhaseResult) -> None:
    """Keep what a phase produced on the locked cluster: connection details, backend state, secrets."""
    cluster.connection = {**cluster.connection, **result.connection}
    cluster.backend_state = {**cluster.backend_state, **result.backend_state}
    cluster.heartbeat_at = timezone.now()
    cluster.save(update_fields=["connection", "backend_state", "heartbeat_at", "updated_at"])
    for name, plaintext in result.secrets.items():
        _store_secret(cluster, _SECRET_KINDS[name], plaintext, replace=True)
    if result.detail:
        ClusterTransition.objects.filter(
            pk=ClusterTransition.objects.filter(cluster=cluster, phase=phase).order_by("-at", "-id").values("pk")[:1]
        ).update(detail=result.detail[:500])


# A cluster in these states has given back its volume and credentials (_release_artefacts) or is doing so.
_ARTEFACTS_RELEASED = (ClusterStatus.TEARING_DOWN, ClusterStatus.DELETED, ClusterStatus.FAILED)


def _keep_secrets(cluster_id: int, result: PhaseResult) -> None:
    """Store the credentials a change produced (a kubeconfig valid to a new end), replacing the old ones, and the
    state the backend keeps about them (when a Kubernetes token expires)."""
    if not result.secrets:
        return
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if cluster.status in _ARTEFACTS_RELEASED:
            # A repair (reconcile) that rebuilt the namespace while the teardown finished: the cluster's
            # credentials were wiped and must stay so; nothing it made is the tenant's to download.
            logger.warning("cluster %s is %s: the credentials a late change produced are not kept", cluster_id,
                           cluster.status)
            return
        previous = dict(cluster.backend_state)
        for name, plaintext in result.secrets.items():
            _store_secret(cluster, _SECRET_KINDS[name], plaintext, replace=True)
        if result.backend_state:
            cluster.backend_state = {**cluster.backend_state, **result.backend_state}
            cluster.save(update_fields=["backend_state", "updated_at"])
        if "kubeconfig" in result.secrets and cluster.status in LIVE_STATUSES:
            # The kubeconfig the team downloaded stops working when its token expires (at once when the
            # namespace was rebuilt): tell them a new one is on the cluster page.
            state = cluster.backend_state
            _cluster_event(CREDENTIALS_RENEWED, cluster, issued_at=state.get("token_issued_at"),
                           expires_at=state.get("token_expires_at"),
                           previous_expires_at=previous.get("token_expires_at"))


def _finish_ready(cluster_id: int, *, done: tuple[str, PhaseResult] | None) -> str:
    try:
        cluster = _step(cluster_id, done=done, enter=ClusterStatus.READY)
    except _Stop:
        return "stopped"
    if cluster.status == ClusterStatus.READY:
        logger.info("cluster %s is ready", cluster_id)
    return cluster.status


def _activate_if_started(reservation: Reservation) -> None:
    if reservation.period.lower <= timezone.now():
        reservation_set_status(reservation_id=reservation.pk, status=ReservationStatus.ACTIVE,
                               expected=(ReservationStatus.PROVISIONING,), reason="cluster ready, window started")


def _record_failure(cluster_id: int, exc: BackendError, *, during: str) -> str:
    """Count a failed attempt; schedule a retry (RetryLater) or fail the cluster for good."""
    max_attempts = setting_int("PORTAL_PROVISIONING_MAX_ATTEMPTS", 5)
    retry_in: float | None = None
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if not _still_in(cluster, during):
            # It moved on while the backend call ran (the tenant asked for a teardown, the booking was
            # cancelled): that pipeline owns the cluster now; this failure is not its to record.
            logger.info("cluster %s failed during %s after moving on to %s: %s", cluster_id, during,
                        cluster.status, exc.message)
            return "stopped"
        cluster.attempts += 1
        cluster.last_error = exc.message[:2000]
        if exc.transient and cluster.attempts < max_attempts:
            retry_in = _backoff(cluster.attempts)
            cluster.next_attempt_at = timezone.now() + timedelta(seconds=retry_in)
            cluster.save(update_fields=["attempts", "last_error", "next_attempt_at", "updated_at"])
            audit_record(actor=None, action="cluster.attempt_failed", obj=cluster, tenant_id=cluster.tenant_id,
                         after={"phase": cluster.status, "attempt": cluster.attempts,
                                "error": without_secrets(exc.message, limit=500),
                                "retry_in_s": round(retry_in, 1)})
        else:
            cluster.next_attempt_at = None
            cluster.failed_during = during
            phase = cluster.status
            told = without_secrets(exc.message, limit=None)  # the team reads it; last_error keeps it whole
            reason = f"{phase}: {told}"[:480] + (f" (after {cluster.attempts} attempts)"
                                                 if cluster.attempts > 1 else "")
            _transition(cluster, ClusterStatus.FAILED, detail=reason, event_extra={"phase": phase})
            # A teardown that failed for good leaves the tenant's cluster on its nodes (read before the
            # reservation's failure releases its allocations): they must not go to the next booking.
            held = _allocated_hostnames(cluster.reservation_id) if during == FailedDuring.TEARDOWN else ()
            expected = ((ReservationStatus.PROVISIONING, ReservationStatus.CONFIRMED)
                        if during == FailedDuring.PROVISIONING else (ReservationStatus.ENDING,))
            reservation_set_status(reservation_id=cluster.reservation_id, status=ReservationStatus.FAILED,
                                   expected=expected, reason=f"cluster failed: {reason}")
    if retry_in is not None:
        logger.warning("cluster %s attempt failed (%s); retrying in %.1fs", cluster_id, exc.message, retry_in)
        raise RetryLater(retry_in, exc.message)
    logger.error("cluster %s failed during %s: %s", cluster_id, during, exc.message)
    if during == FailedDuring.PROVISIONING:
        _cleanup_failed(cluster_id)
    elif during == FailedDuring.TEARDOWN:
        _hold_nodes_of_failed_teardown(cluster_id, held, exc.message)
    return ClusterStatus.FAILED


def _teardown_hold_reason(cluster_id: int) -> str:
    """The start of teardown_hold_reason(cluster_id), to find the nodes held for the cluster."""
    return f"teardown of cluster #{cluster_id} failed"


def _hold_nodes_of_failed_teardown(cluster_id: int, hostnames: tuple[str, ...], error: str) -> None:
    """Take the nodes a failed teardown left the cluster on out of service (maintenance), as Slurm downs a
    node whose cleanup failed: the next tenant's booking must not get them with this tenant's cluster,
    credentials or mounts still there. The state change moves their running and future bookings to
    spares (node_sync). A staff retry that tears the cluster down gives them back."""
    # The reason is shown to the tenants booked on the node (their nodes, in the API) until node_sync moves
    # their bookings: it names the cluster staff retry, never the backend's error, which names the failed
    # tenant's objects (its namespace, its Slurm reservation). The error stays on that cluster and in the log.
    reason = teardown_hold_reason(cluster_id)
    for node in Node.objects.filter(hostname__in=hostnames, state=NodeState.AVAILABLE).order_by("pk"):
        # Only from available, compared under the node's locks: a change staff made since the read stands.
        node = node_update(actor=None, node=node, state=NodeState.MAINTENANCE, reason=reason,
                           only_from=(NodeState.AVAILABLE,))
        if node.state == NodeState.MAINTENANCE:
            logger.error("node %s held in maintenance: %s (%s)", node.hostname, reason, error)


def _release_nodes_of_failed_teardown(cluster_id: int) -> None:
    """Give back the nodes held for the cluster's failed teardown, once a teardown has succeeded (only
    those still in maintenance for that reason: staff may have moved them on meanwhile). A node an open
    health repair owns meanwhile stays out: node_update refuses it, and the repair's rejoin brings it back."""
    prefix = _teardown_hold_reason(cluster_id) + ":"
    for node in Node.objects.filter(state=NodeState.MAINTENANCE, state_reason__startswith=prefix).order_by("pk"):
        try:
            # Only from maintenance, compared under the node's locks: staff retiring it meanwhile stands.
            node_update(actor=None, node=node, state=NodeState.AVAILABLE, reason="", only_from=(NodeState.MAINTENANCE,))
        except InvalidState as exc:
            logger.warning("node %s stays out of service after cluster %s's teardown: %s", node.hostname,
                           cluster_id, exc.detail)


def _still_in(cluster: VirtualCluster, during: str) -> bool:
    """Whether the locked cluster is still where a run of the pipeline `during` left it (see _step)."""
    if during == FailedDuring.PROVISIONING:
        return (cluster.status in PROVISIONING_STATUSES
                and cluster.reservation.status == ReservationStatus.PROVISIONING)
    return cluster.status == ClusterStatus.TEARING_DOWN


# backend_state key of a failed cluster whose backend objects are not all gone yet.
_CLEANUP_PENDING = "cleanup_pending"


def cluster_cleanup_failed(*, cluster_id: int) -> str:
    """Go on removing what a failed provisioning built, until the backend says it is gone (a task's work)."""
    with advisory_lock(LOCK_CLUSTER, cluster_id) as held:
        if not held:
            return "busy"
        return _cleanup_failed(cluster_id)


def _cleanup_failed(cluster_id: int) -> str:
    """Remove what a failed provisioning built (it frees the nodes in the backend too); hold the cluster's lock.

    The booking's nodes were released with the failure, so another booking may be handed them at
    once: a backend whose teardown finishes later (a Kubernetes namespace terminating, then the
    nodes' claim lifted) or that failed is asked again (a cleanup_failed_cluster task, resent by the
    tick if lost) until it is done, instead of leaving the nodes claimed until the window ends.
    """
    cluster = VirtualCluster.objects.filter(pk=cluster_id).first()
    if cluster is None or cluster.status != ClusterStatus.FAILED or cluster.failed_during != FailedDuring.PROVISIONING:
        return "not due"
    done = False
    try:
        with _backend(cluster.backend) as backend:
            done = backend.teardown(build_context(cluster_id))
    except BackendError as exc:
        logger.warning("cleanup of failed cluster %s: %s (retrying)", cluster_id, exc.message)
    poll = setting_float("PORTAL_TEARDOWN_POLL_SECONDS", 5.0)
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        _release_artefacts(cluster)
        if cluster.status != ClusterStatus.FAILED:
            return cluster.status
        state = dict(cluster.backend_state)
        if done:
            state.pop(_CLEANUP_PENDING, None)
            cluster.next_attempt_at = None
        else:
            state[_CLEANUP_PENDING] = True
            cluster.next_attempt_at = timezone.now() + timedelta(seconds=poll)
            cluster.dispatched_at = timezone.now()
            transaction.on_commit(lambda: _send("cleanup_failed_cluster", cluster_id, countdown=poll))
        cluster.backend_state = state
        cluster.save(update_fields=["backend_state", "next_attempt_at", "dispatched_at", "updated_at"])
    return "cleaned up" if done else "cleanup in progress"


def _repair_conflicts(exc: BackendConflict, *, own_reservation_id: int) -> None:
    """Converge the backend objects in our way from the database (stale bookings), so a retry passes."""
    from .backends.slurm import parse_reservation_name

    for name in exc.conflicting:
        parsed = parse_reservation_name(name)
        if parsed is None or parsed[1] == own_reservation_id:
            continue
        logger.info("booking %s is in the way of %s in the backend; converging it first", name, own_reservation_id)
        try:
            reservation_sync(reservation_id=parsed[1], repair=False)
        except (BackendError, RetryLater):
            logger.warning("could not converge conflicting booking %s", name, exc_info=True)


# --- per-tenant artefacts --------------------------------------------------------------------


def _store_secret(cluster: VirtualCluster, kind: str, plaintext: str, *, public_part: str = "",
                  fingerprint: str = "", replace: bool = False) -> ClusterCredential:
    """Encrypt and keep a credential (inside the caller's transaction). Never logs the plaintext."""
    current = ClusterCredential.objects.select_for_update().filter(cluster=cluster, kind=kind,
                                                                   revoked_at__isnull=True).first()
    if current is not None:
        if not replace:
            return current
        current.revoked_at = timezone.now()
        current.ciphertext = ""
        current.save(update_fields=["revoked_at", "ciphertext"])
    credential = ClusterCredential.objects.create(
        cluster=cluster, kind=kind, ciphertext=crypto.encrypt(plaintext), public_part=public_part,
        fingerprint=fingerprint,
    )
    audit_record(actor=None, action="cluster.credential_issued", obj=credential, tenant_id=cluster.tenant_id,
                 after={"kind": kind, "fingerprint": fingerprint})
    return credential


def _ensure_ssh_key(cluster: VirtualCluster) -> str:
    """Give the cluster its SSH key pair once (a resumed phase keeps the first); return its fingerprint."""
    current = ClusterCredential.objects.filter(cluster=cluster, kind=CredentialKind.SSH_KEY,
                                               revoked_at__isnull=True).values_list("fingerprint", flat=True).first()
    if current is not None:
        return current
    pair = crypto.ssh_keypair(f"{cluster.tenant.slug}@gpu-portal-r{cluster.reservation_id}")
    with transaction.atomic():
        credential = _store_secret(_lock_cluster(cluster.pk), CredentialKind.SSH_KEY, pair.private_openssh,
                                   public_part=pair.public_openssh, fingerprint=pair.fingerprint)
    return credential.fingerprint


def _vlan_range() -> range:
    low, _, high = str(setting("PORTAL_TENANT_VLAN_RANGE", "100-3999")).partition("-")
    return range(int(low), int(high or low) + 1)


def _free_network() -> tuple[int, str]:
    used_vlans = set(Tenant.objects.exclude(vlan_id=None).values_list("vlan_id", flat=True))
    vlan = next((v for v in _vlan_range() if v not in used_vlans), None)
    supernet = ipaddress.ip_network(setting("PORTAL_TENANT_SUPERNET", "10.64.0.0/10"))
    prefix = setting_int("PORTAL_TENANT_PREFIXLEN", 22)
    used = [ipaddress.ip_network(c) for c in Tenant.objects.exclude(cidr="").values_list("cidr", flat=True)]
    cidr = next((net for net in supernet.subnets(new_prefix=prefix) if not any(net.overlaps(u) for u in used)), None)
    if vlan is None or cidr is None:
        raise BackendError("no free VLAN or CIDR left for a new tenant network segment", transient=False)
    return vlan, str(cidr)


def _ensure_tenant_network(tenant_id: int) -> None:
    """Give the tenant its network segment (VLAN + CIDR, unique across tenants) if it has none.

    The database refuses a duplicate (unique VLAN, GiST exclusion on CIDR); the lock just
    keeps our own assignments from picking the same free values at once.
    """
    tenant = Tenant.objects.get(pk=tenant_id)
    if tenant.vlan_id and tenant.cidr:
        return
    with advisory_lock(LOCK_TENANT_NETWORK, 0, wait=30) as held:
        if not held:
            raise BackendError("timed out waiting to assign a network segment")
        for _attempt in range(5):
            tenant.refresh_from_db()
            if tenant.vlan_id and tenant.cidr:
                return
            vlan, cidr = _free_network()
            try:
                tenant_update(actor=None, tenant=tenant, vlan_id=tenant.vlan_id or vlan, cidr=tenant.cidr or cidr)
                return
            except InvalidInput:  # another writer (an admin) took it meanwhile: pick again
                continue
    raise BackendError("could not assign a network segment")


def _ensure_volume(cluster_id: int) -> None:
    """Record the cluster's shared volume, within the tenant's storage quota (locked, so never oversold)."""
    with transaction.atomic():
        cluster = VirtualCluster.objects.select_related("tenant").get(pk=cluster_id)
        if cluster.shared_storage_gib == 0:
            return
        # The tenant row lock serialises quota checks of one tenant's clusters.
        tenant = _lock_tenant_storage(cluster.tenant_id)
        volume = StorageVolume.objects.filter(cluster=cluster).first()
        if (volume is not None and volume.status == VolumeStatus.ACTIVE
                and volume.size_gib == cluster.shared_storage_gib):
            return
        # Judged as configuring the cluster and changing its booking's window are (_clusters_sharing_storage):
        # against the volumes of the tenant's clusters whose bookings overlap this one's window. Counting every
        # active volume refused a booking provisioned ahead of its start while the one before it still ran —
        # storage its configuration had been promised.
        period = Reservation.objects.values_list("period", flat=True).get(pk=cluster.reservation_id)
        sharing = _clusters_sharing_storage(tenant_id=tenant.pk, period=period, exclude_cluster_id=cluster.pk)
        used = (StorageVolume.objects.filter(tenant=tenant, status=VolumeStatus.ACTIVE, cluster__in=sharing)
                .aggregate(total=Sum("size_gib"))["total"] or 0)
        quota = tenant.storage_quota_tib * 1024
        if used + cluster.shared_storage_gib > quota:
            raise BackendError(
                f"storage quota exceeded: {used} GiB in use in its window + {cluster.shared_storage_gib} GiB asked "
                f"> {quota} GiB ({tenant.storage_quota_tib} TiB)", transient=False)
        name = f"{tenant.slug}-r{cluster.reservation_id}"
        if volume is None:
            volume = StorageVolume(tenant=tenant, cluster=cluster, name=name)
        volume.size_gib = cluster.shared_storage_gib
        volume.status = VolumeStatus.ACTIVE
        volume.released_at = None
        volume.mount_path = "/shared"
        volume.save()
        audit_record(actor=None, action="cluster.volume_attached", obj=volume, tenant_id=tenant.pk,
                     after={"name": name, "size_gib": volume.size_gib})


def _release_artefacts(cluster: VirtualCluster) -> None:
    """Free the volume's quota and wipe the credentials (inside the caller's transaction)."""
    now = timezone.now()
    StorageVolume.objects.filter(cluster=cluster, status=VolumeStatus.ACTIVE).update(
        status=VolumeStatus.RELEASED, released_at=now)
    ClusterCredential.objects.filter(cluster=cluster, revoked_at__isnull=True).update(revoked_at=now, ciphertext="")


# --- teardown ------------------------------------------------------------------------------


def _teardown_wanted(cluster: VirtualCluster, reservation: Reservation, now: datetime) -> bool:
    if cluster.status == ClusterStatus.DELETED:
        return False
    if cluster.status == ClusterStatus.FAILED and cluster.failed_during == FailedDuring.TEARDOWN:
        return False  # staff retry restarts it
    if cluster.status == ClusterStatus.TEARING_DOWN:
        return True
    if reservation.status in (ReservationStatus.ENDING, ReservationStatus.CANCELLED, ReservationStatus.COMPLETED):
        return True
    return reservation.status == ReservationStatus.FAILED and reservation.period.upper <= now


def cluster_teardown(*, cluster_id: int) -> str:
    """Remove the cluster from its backend and release its artefacts; then complete the reservation."""
    with advisory_lock(LOCK_CLUSTER, cluster_id) as held:
        if not held:
            return "busy"
        cluster = VirtualCluster.objects.select_related("reservation").filter(pk=cluster_id).first()
        if cluster is None:
            return "gone"
        if not _teardown_wanted(cluster, cluster.reservation, timezone.now()):
            return "not due" if cluster.status != ClusterStatus.DELETED else ClusterStatus.DELETED
        if cluster.status != ClusterStatus.TEARING_DOWN:
            with transaction.atomic():
                locked = _lock_cluster(cluster_id)
                if locked.status != ClusterStatus.TEARING_DOWN:
                    _transition(locked, ClusterStatus.TEARING_DOWN, detail=f"reservation {cluster.reservation.status}")
        try:
            with _backend(cluster.backend) as backend:
                done = backend.teardown(build_context(cluster_id))
        except BackendError as exc:
            return _record_failure(cluster_id, exc, during=FailedDuring.TEARDOWN)
        except SoftTimeLimitExceeded:
            return _record_failure(cluster_id, _timed_out(cluster_id), during=FailedDuring.TEARDOWN)
        if not done:
            VirtualCluster.objects.filter(pk=cluster_id).update(heartbeat_at=timezone.now())
            poll = RetryLater(setting_float("PORTAL_TEARDOWN_POLL_SECONDS", 5.0), "teardown in progress")
            _expect_retry(cluster_id, poll)
            raise poll
        with transaction.atomic():
            cluster = _lock_cluster(cluster_id)
            if cluster.status != ClusterStatus.TEARING_DOWN:
                return cluster.status
            _release_artefacts(cluster)
            cluster.attempts = 0
            cluster.next_attempt_at = None
            cluster.last_error = ""
            failed_teardown = cluster.failed_during == FailedDuring.TEARDOWN
            cluster.failed_during = ""
            _transition(cluster, ClusterStatus.DELETED, detail="torn down")
            reservation_set_status(reservation_id=cluster.reservation_id, status=ReservationStatus.COMPLETED,
                                   expected=(ReservationStatus.ENDING,), reason="window over, cluster torn down")
            if failed_teardown:
                reservation_set_status(reservation_id=cluster.reservation_id, status=ReservationStatus.COMPLETED,
                                       expected=(ReservationStatus.FAILED,), reason="teardown retried by staff")
        if failed_teardown:
            _release_nodes_of_failed_teardown(cluster_id)
        return ClusterStatus.DELETED


def cluster_request_teardown(*, actor: Any, cluster: VirtualCluster) -> VirtualCluster:
    """End a provisioning or running cluster now (the tenant's teardown button).

    The reservation goes to ending, then completed; its nodes stay booked until the booked
    end (it is paid for), but nothing of the tenant remains on them.
    """
    with transaction.atomic(durable=True):
        cluster = _lock_cluster(cluster.pk)
        if not can_manage_cluster(user=actor, cluster=cluster):
            raise PermissionDenied("Only the tenant's lead or the member who booked it can tear the cluster down.")
        reservation = cluster.reservation
        if reservation.status not in (ReservationStatus.PROVISIONING, ReservationStatus.ACTIVE):
            raise InvalidState(f"Reservation #{reservation.pk} is {reservation.status}; "
                               "cancel a booking that has not started instead.")
        # The tenant reads these words (the booking's reason, the cluster's history): a staff account is
        # "platform staff" there; the transition's actor keeps the account for staff.
        who = actor_name(actor, viewer=None, staff=STAFF_WORDS) or "the system"
        if cluster.status in _ARTEFACTS_RELEASED:
            # The reservation above was read with the cluster, before its row lock was granted: a run that
            # failed (or a teardown that began) meanwhile is seen here, on the locked row.
            raise InvalidState(f"Cluster #{cluster.pk} is {cluster.status}; there is no running cluster to tear down.")
        if reservation_set_status(reservation_id=reservation.pk, status=ReservationStatus.ENDING,
                                  expected=(ReservationStatus.PROVISIONING, ReservationStatus.ACTIVE),
                                  reason=f"torn down early by {who}",
                                  actor=actor) is None:
            status = Reservation.objects.values_list("status", flat=True).get(pk=reservation.pk)
            raise InvalidState(f"Reservation #{reservation.pk} is {status}; its cluster is not torn down early.")
        _transition(cluster, ClusterStatus.TEARING_DOWN, actor=actor, source=TransitionSource.API,
                    detail=f"requested by {who}")
        cluster.dispatched_at = timezone.now()
        cluster.save(update_fields=["dispatched_at"])
        _enqueue("teardown_cluster", cluster.pk)
    return cluster


# --- staff retry --------------------------------------------------------------------------


def cluster_retry(*, actor: Any, cluster: VirtualCluster, source: str = TransitionSource.ADMIN) -> VirtualCluster:
    """Try a failed cluster again (staff): provisioning from the start, or the teardown that failed."""
    if not getattr(actor, "is_staff", False):
        raise PermissionDenied("Only platform staff can retry a failed cluster.")
    now = timezone.now()
    with transaction.atomic(durable=True):
        cluster = _lock_cluster(cluster.pk)
        refusal = retry_refusal(cluster=cluster, now=now)
        if refusal:
            raise InvalidState(refusal)
        reservation = cluster.reservation
        cluster.attempts = 0
        cluster.next_attempt_at = None
        cluster.dispatched_at = now
        cluster.backend_state.pop(_CLEANUP_PENDING, None)  # provisioning again claims what it needs
        if cluster.failed_during == FailedDuring.TEARDOWN:
            _transition(cluster, ClusterStatus.TEARING_DOWN, actor=actor, source=source, detail="teardown retried")
            _enqueue("teardown_cluster", cluster.pk)
        else:
            if reservation.status == ReservationStatus.FAILED:
                reservation_reopen(reservation_id=reservation.pk, actor=actor, reason="cluster retried by staff")
            cluster.failed_during = ""
            cluster.last_error = ""
            _transition(cluster, ClusterStatus.PENDING, actor=actor, source=source, detail="retried by staff")
            lead = timedelta(minutes=setting_int("PORTAL_PROVISION_LEAD_MINUTES", 30))
            if reservation.period.lower - lead <= now:
                begin_provisioning(reservation_id=reservation.pk, now=now, actor=actor)
            elif holds_bookings(cluster.backend):
                _enqueue("sync_reservation", reservation.pk)
        audit_record(actor=actor, action="cluster.retry", obj=cluster, tenant_id=cluster.tenant_id,
                     after={"status": cluster.status})
    return cluster


# --- bookings held in the backend, node changes ------------------------------------------


def reservation_sync(*, reservation_id: int, repair: bool = True) -> str:
    """Make the backend's copy of a booking match the database (create, update or delete it).

    For Slurm this is the ``<tenant>-<id>`` reservation from booking to end; for any backend
    a live cluster gets a changed window applied. Idempotent and level-triggered: it reads
    the current state and converges, whatever event (or none) led here.
    """
    cluster = VirtualCluster.objects.select_related("reservation").filter(reservation_id=reservation_id).first()
    if cluster is None:
        return "no cluster"
    holds = holds_bookings(cluster.backend)
    # The booking's lock, then the cluster's (as provisioning and teardown hold it): a sync never runs
    # beside a teardown, which it would undo (booking again what the teardown released), nor beside a
    # provisioning run writing the same backend booking.
    with (_held_or_retry(LOCK_BOOKING, reservation_id, wait=30, busy="booking busy"),
          _held_or_retry(LOCK_CLUSTER, cluster.pk, busy=_CLUSTER_BUSY)):
        return _reservation_sync_locked(cluster, reservation_id, holds=holds, repair=repair)


def _reservation_sync_locked(cluster: VirtualCluster, reservation_id: int, *, holds: bool, repair: bool) -> str:
    cluster.refresh_from_db()
    reservation = Reservation.objects.get(pk=reservation_id)
    now = timezone.now()
    holding = reservation.status in HOLDING_STATUSES and reservation.period.upper > now
    if not holds and cluster.status not in LIVE_STATUSES:
        if holding and cluster.status in PROVISION_PHASES:
            # Half built (a run backing off, or waiting on its acceptance checks, lets go of the lock): what the
            # finished phases made holds the old window (a Kubernetes node claim's end), and nothing applies the
            # new one once it is ready. The change follows the build: the caller asks again.
            raise RetryLater(_backoff(1), "the cluster is being built; its window changes once it is ready")
        return "nothing to sync"
    with _backend(cluster.backend) as backend:
        ctx = build_context(cluster.pk)
        try:
            if holding and cluster.status in LIVE_STATUSES:
                try:
                    _keep_secrets(cluster.pk, backend.update_window(ctx))
                except BackendError as exc:
                    if not exc.transient:
                        _window_refused(cluster.pk, ctx, exc.message)
                    raise
                _window_held(cluster.pk)
                return "updated"
            if holding and holds and cluster.status in PROVISIONING_STATUSES:
                _book(backend, ctx, repair=repair)
                return "booked"
            if (not holding and holds and cluster.status in
                    (ClusterStatus.PENDING, ClusterStatus.DELETED, ClusterStatus.FAILED)):
                backend.release_booking(ctx)
                return "released"
        except BackendError as exc:
            if not exc.transient:
                logger.error("booking %s cannot be synced: %s", reservation_id, exc.message)
                return "refused"
            raise RetryLater(_backoff(1), exc.message)
    return "nothing to sync"


# The start of a live cluster's status_reason when its backend refused the booking's window for good.
_WINDOW_REFUSED = "the {backend} backend refused the window change"


def _window_refused(cluster_id: int, ctx: ClusterContext, error: str) -> None:
    """A live cluster whose backend refused its booking's new window for good: the portal shows the new end
    while the backend keeps the old one (the tenant's jobs stop then). Degrade it with the reason, as a failed
    node swap does, so the team and the platform channel hear of it (cluster.degraded); a cluster already
    degraded gets the refusal as its reason. The same refusal again (a redelivered sync) changes nothing."""
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if cluster.status not in LIVE_STATUSES:
            return
        reason = without_secrets(
            f"{_WINDOW_REFUSED.format(backend=cluster.backend)}: the booking ends "
            f"{ctx.end.astimezone(UTC):%Y-%m-%d %H:%M} UTC, but the backend still holds the cluster's previous "
            f"window (its jobs stop at that end). "
            f"Change the end again, or ask the platform team (reconcile --fix once the cause is cleared). "
            f"Backend: {error}", limit=500)
        if cluster.status == ClusterStatus.DEGRADED and cluster.status_reason == reason:
            return
        _transition(cluster, ClusterStatus.DEGRADED, source=TransitionSource.LIFECYCLE, detail=reason)


def _window_held(cluster_id: int) -> None:
    """The backend took the booking's window: a cluster degraded only by an earlier refusal of it is whole again
    (one degraded before that, by a lost node, stays degraded)."""
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if cluster.status != ClusterStatus.DEGRADED or not cluster.status_reason.startswith(
                _WINDOW_REFUSED.format(backend=cluster.backend)):
            return
        # Degraded from ready by refusals alone: each refusal since the last ready was degraded → degraded.
        since_ready = cluster.transitions.filter(
            pk__gt=cluster.transitions.filter(phase=ClusterStatus.READY).order_by("-pk").values("pk")[:1])
        if cluster.reservation.missing_nodes or since_ready.exclude(
                detail__startswith=_WINDOW_REFUSED.format(backend=cluster.backend)).exists():
            return
        # recovered: the notification says the cluster is whole again, not that one was built.
        _transition(cluster, ClusterStatus.READY, detail="the backend holds the window again",
                    event_extra={"recovered": True})


def _book(backend: ProvisioningBackend, ctx: ClusterContext, *, repair: bool) -> None:
    try:
        backend.book(ctx)
    except BackendConflict as exc:
        if not repair:
            raise
        _repair_conflicts(exc, own_reservation_id=ctx.reservation_id)
        backend.book(ctx)


def node_sync(*, node_id: int) -> dict[str, int]:
    """Follow a node's state: drain or resume it in the backends; move its bookings off it if out of service.

    The bookings are moved by ``reservations.node_replace_allocations`` (the one mechanism,
    also used by the health checks; a second call finds nothing left to move). Its
    ``node.replaced`` / ``reservation.degraded`` events bring each cluster along
    (:func:`cluster_nodes_changed`).
    """
    # One sync of a node at a time, reading the state under the lock: two tasks (drain, then resume)
    # can no longer reach the backend in the other order and leave it drained beside an available node.
    with _held_or_retry(LOCK_NODE_SYNC, node_id, wait=3 * LOCK_WAIT_S, busy="node sync busy"):
        return _node_sync_locked(node_id)


def _node_sync_locked(node_id: int) -> dict[str, int]:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return {}
    out = node.state in OUT_OF_SERVICE
    unfinished = []  # drains to try again (a pod whose disruption budget said "not now")
    for name in configured_backends():
        try:
            with _backend(name) as backend:
                if out:
                    backend.drain_node(node.hostname, f"{node.state}: {node.state_reason}".strip(": "))
                else:
                    backend.resume_node(node.hostname)
        except BackendError as exc:
            if out and isinstance(exc, DrainIncomplete):
                logger.warning("node %s: %s backend: %s (tried again)", node.hostname, name, exc.message)
                unfinished.append(f"{name}: {exc.message}")
            else:
                logger.warning("node %s: %s backend: %s (reconcile will repair)", node.hostname, name, exc.message)
    if not out:
        NodeDrain.objects.filter(node_id=node_id).delete()  # back in service: nothing left to drain
        return {}
    try:
        outcomes = node_replace_allocations(node=node, reason=f"{node.hostname} is {node.state}")
    except InvalidState:  # back in service before we got here: nothing to move
        outcomes = []
    except Busy as exc:
        # A move kept losing to concurrent changes (deadlocks), nothing of it written: the task runs the sync
        # again shortly (the moves already done are found done), rather than failing with bookings left here.
        raise RetryLater(_backoff(1), f"moving the bookings off {node.hostname}: {exc.detail}") from exc
    if unfinished:
        # The bookings have moved; the drain itself is tried again (it is idempotent, and a second move
        # finds nothing left) with growing waits, and the tick sends it again once the task's retries are
        # spent (_tick_redrive_drains), until it completes: a disruption budget may hold a pod for as long
        # as its replacement takes to start, Slurm jobs for as long as they take to end.
        reason = f"drain of {node.hostname} not finished: {'; '.join(unfinished)}"
        raise RetryLater(_drain_unfinished(node_id, reason), reason)
    NodeDrain.objects.filter(node_id=node_id).delete()
    return dict(Counter(outcome["result"] for outcome in outcomes))


def _drain_unfinished(node_id: int, reason: str) -> float:
    """Record one more unfinished try of the node's drain; return how long to wait before the next (exponential
    with jitter, capped by PORTAL_PROVISIONING_RETRY_BACKOFF_MAX_SECONDS, well inside the broker's visibility
    timeout). Called under the node's sync lock."""
    now = timezone.now()
    drain, _ = NodeDrain.objects.get_or_create(node_id=node_id, defaults={"since": now})
    drain.attempts += 1
    countdown = _backoff(drain.attempts)
    drain.next_attempt_at = now + timedelta(seconds=countdown)
    drain.last_error = without_secrets(reason, limit=500)
    drain.save(update_fields=["attempts", "next_attempt_at", "last_error"])
    return countdown


def cluster_nodes_changed(*, reservation_id: int, failed: str, spare: str | None,
                          allocation_id: int | None = None) -> str:
    """Bring a cluster along after its reservation lost node failed (to spare, or to nothing: degraded).

    Holds the cluster's lock, as provisioning and teardown do: a swap never runs beside a teardown
    (it would build again what the teardown removed) nor beside a provisioning run (whose later
    phases read the new node set; the swap follows once the run is over). RetryLater when the lock
    stays taken. allocation_id: the booking's allocation the node lost (it names the failure in the
    cluster.degraded this may cause; None from a message queued before events carried it).
    """
    cluster_id = VirtualCluster.objects.filter(reservation_id=reservation_id).values_list("pk", flat=True).first()
    if cluster_id is None:
        return "nothing to do"
    with _held_or_retry(LOCK_CLUSTER, cluster_id, busy=_CLUSTER_BUSY):
        return _cluster_nodes_changed_locked(cluster_id, reservation_id=reservation_id, failed=failed, spare=spare,
                                             allocation_id=allocation_id)


def _cluster_nodes_changed_locked(cluster_id: int, *, reservation_id: int, failed: str, spare: str | None,
                                  allocation_id: int | None = None) -> str:
    cluster = VirtualCluster.objects.select_related("reservation").get(pk=cluster_id)
    # A failed cluster's booking was let go of (its nodes went back to others): a swap that waited for
    # the failing run must not hold the window in the backend again.
    if cluster.status in (ClusterStatus.DELETED, ClusterStatus.TEARING_DOWN, ClusterStatus.FAILED):
        return "nothing to do"
    reservation = cluster.reservation
    holding = reservation.status in HOLDING_STATUSES and reservation.period.upper > timezone.now()
    built = cluster.status in LIVE_STATUSES or cluster.status in PROVISION_PHASES
    with transaction.atomic():
        if not _swap_audited(cluster, reservation_id=reservation_id, failed=failed, spare=spare):
            audit_record(actor=None, action="cluster.node_swapped" if spare else "cluster.node_lost", obj=cluster,
                         tenant_id=cluster.tenant_id, before={"node": failed}, after={"node": spare})
    try:
        with _backend(cluster.backend) as backend:
            ctx = build_context(cluster.pk)
            if built and spare:
                backend.swap_node(ctx, failed, spare)
            elif built:
                # The node set shrank, maybe to nothing: the backend lets go of the lost node either way.
                _keep_secrets(cluster.pk, backend.update_window(ctx))
            elif holds_bookings(cluster.backend) and holding:
                _book(backend, ctx, repair=True)  # with no node left, the backend lets go of the booking
    except BackendError as exc:
        _degrade(cluster.pk, f"could not replace {failed} in the {cluster.backend} backend: {exc.message}", failed,
                 allocation_id)
        return "degraded"
    if spare is None:
        missing = Reservation.objects.values_list("missing_nodes", flat=True).get(pk=reservation_id)
        _degrade(cluster.pk, f"{failed} failed and no spare node is free ({missing} missing)", failed, allocation_id)
        return "degraded"
    return "replaced"


def _swap_audited(cluster: VirtualCluster, *, reservation_id: int, failed: str, spare: str | None) -> bool:
    """Whether the cluster's audit already holds this swap (the task runs again: a redelivered message, a
    worker that died in the backend's call). Hold the cluster's lock.

    The reservation records each swap once (reservation.replace_node, in the swap's own transaction): the
    cluster has its row for each of those, so the same pair swapped twice (the node came back and failed
    again) is two rows, and a late copy of the first message adds none.
    """
    swapped = AuditLog.objects.filter(
        action="reservation.replace_node", object_type=Reservation._meta.label_lower, object_id=str(reservation_id),
        after__failed=failed, **({"after__spare": spare} if spare else {"after__result": "degraded"}))
    audited = AuditLog.objects.filter(
        action="cluster.node_swapped" if spare else "cluster.node_lost", object_type=cluster._meta.label_lower,
        object_id=str(cluster.pk), before__node=failed, after__node=spare)
    return audited.count() >= max(1, swapped.count())


def _degrade(cluster_id: int, reason: str, hostname: str, allocation_id: int | None = None) -> None:
    extra: dict[str, Any] = {"node": hostname}
    if allocation_id is not None:
        extra["allocation_id"] = allocation_id  # names the failure, as reservation.degraded's does
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        if cluster.status == ClusterStatus.READY:
            _transition(cluster, ClusterStatus.DEGRADED, source=TransitionSource.NODE, detail=reason,
                        event_extra=extra)


# --- the lifecycle tick -------------------------------------------------------------------


def lifecycle_tick(*, now: datetime | None = None) -> dict[str, int]:
    """Do whatever is due (beat, every minute); idempotent, and only one runs at a time."""
    now = now or timezone.now()
    with advisory_lock(LOCK_TICK, 0) as held:
        if not held:
            return {"skipped": 1}
        report = {
            "created": _tick_create_missing(),
            "provisioning": _tick_start_provisioning(now),
            "missed": _tick_fail_missed(now),
            "active": _tick_activate(now),
            "ending": _tick_end(now),
            "reminders": _tick_reminders(now),
            "redispatched": _tick_redispatch(now),
            "credentials": _tick_renew_credentials(now),
            "drains": _tick_redrive_drains(now),
        }
    return {key: value for key, value in report.items() if value}


def _each(ids: Any, fn: Callable[[int], object], what: str) -> int:
    """Apply fn to each id; count the truthy results. One bad row is logged, never stops the tick."""
    count = 0
    for item in list(ids):
        try:
            if fn(item):
                count += 1
        except Exception:  # noqa: BLE001 - the scheduler must go on for every other tenant
            logger.exception("lifecycle tick: %s failed for %s", what, item)
    return count


# A credential that expires before its booking ends is issued again once this share of its lifetime has passed;
# a renewal asked for and not done yet (the API server down, the sync retrying) is not asked again before this.
RENEW_AFTER_LIFETIME_SHARE = 0.75
RENEW_RESEND_AFTER = timedelta(minutes=10)


def _tick_renew_credentials(now: datetime) -> int:
    """Have a live cluster's kubeconfig issued again (reservation_sync applies the window and issues a new one)
    when its token, capped by the API server below the booking's end, has used most of its lifetime."""
    due = []
    for cluster_id, reservation_id, state, end in VirtualCluster.objects.filter(
            status__in=LIVE_STATUSES, backend_state__token_expires_at__isnull=False,
            reservation__status__in=HOLDING_STATUSES, reservation__period__endswith__gt=now,
    ).values_list("pk", "reservation_id", "backend_state", "reservation__period__endswith"):
        if state.get("token_expires_at") is None:
            continue  # the API server said nothing of an expiry
        try:
            issued = datetime.fromisoformat(state["token_issued_at"])
            expires = datetime.fromisoformat(state["token_expires_at"])
        except (KeyError, TypeError, ValueError):
            logger.warning("cluster %s: unreadable token expiry in its backend state", cluster_id)
            continue
        asked = state.get("token_renewal_asked_at")
        if (expires < end and now >= issued + (expires - issued) * RENEW_AFTER_LIFETIME_SHARE
                and (asked is None or now >= datetime.fromisoformat(asked) + RENEW_RESEND_AFTER)):
            due.append((cluster_id, reservation_id))

    def ask(item: tuple[int, int]) -> bool:
        cluster_id, reservation_id = item
        with transaction.atomic():
            cluster = _lock_cluster(cluster_id)
            cluster.backend_state = {**cluster.backend_state, "token_renewal_asked_at": now.isoformat()}
            cluster.save(update_fields=["backend_state", "updated_at"])
        _send("sync_reservation", reservation_id)
        return True

    return _each(due, ask, "renewing a kubeconfig")


def _tick_create_missing() -> int:
    ids = Reservation.objects.filter(status__in=HOLDING_STATUSES, cluster__isnull=True).values_list("id", flat=True)
    return _each(ids, lambda rid: cluster_create_for_reservation(reservation_id=rid), "creating a cluster")


def _tick_start_provisioning(now: datetime) -> int:
    lead = timedelta(minutes=setting_int("PORTAL_PROVISION_LEAD_MINUTES", 30))
    ids = Reservation.objects.filter(
        status=ReservationStatus.CONFIRMED, period__startswith__lte=now + lead, period__endswith__gt=now,
    ).order_by("period").values_list("id", flat=True)
    return _each(ids, lambda rid: begin_provisioning(reservation_id=rid, now=now), "starting provisioning")


def _lock_reservation_if(reservation_id: int, **window: Any) -> bool:
    """Lock the reservation's row and tell whether it still matches window (a tick read it before the lock: a
    start or end moved since must be judged as it is now)."""
    return Reservation.objects.select_for_update(of=("self",)).filter(
        pk=reservation_id, **window).values_list("pk", flat=True).first() is not None


def _lock_if_ended(reservation_id: int, now: datetime) -> tuple[VirtualCluster | None, bool]:
    """Lock the booking's cluster row, then its own — the order the tenant's teardown and a failing run take
    them (the other order deadlocked with the teardown button pressed as the window ended) — and return the
    cluster and whether the window has still ended by now (an extension committed since keeps the booking)."""
    cluster = VirtualCluster.objects.select_for_update().filter(reservation_id=reservation_id).first()
    return cluster, _lock_reservation_if(reservation_id, period__endswith__lte=now)


def _tick_fail_missed(now: datetime) -> int:
    def fail(rid: int) -> bool:
        with transaction.atomic():
            cluster, ended = _lock_if_ended(rid, now)
            if not ended:
                return False
            if reservation_set_status(reservation_id=rid, status=ReservationStatus.FAILED,
                                      expected=(ReservationStatus.CONFIRMED,),
                                      reason="the window ended before provisioning could start") is None:
                return False
            if cluster is not None and cluster.status == ClusterStatus.PENDING:
                cluster.failed_during = FailedDuring.PROVISIONING
                _transition(cluster, ClusterStatus.FAILED, detail="the window ended before provisioning started")
        return True

    ids = Reservation.objects.filter(status=ReservationStatus.CONFIRMED, period__endswith__lte=now)
    return _each(ids.values_list("id", flat=True), fail, "failing a missed window")


def _tick_activate(now: datetime) -> int:
    ids = Reservation.objects.filter(status=ReservationStatus.PROVISIONING, period__startswith__lte=now,
                                     cluster__status__in=LIVE_STATUSES).values_list("id", flat=True)
    return _each(ids, lambda rid: reservation_set_status(
        reservation_id=rid, status=ReservationStatus.ACTIVE, expected=(ReservationStatus.PROVISIONING,),
        reason="window started"), "activating")


def _tick_end(now: datetime) -> int:
    def end(rid: int) -> bool:
        with transaction.atomic():
            cluster, ended = _lock_if_ended(rid, now)
            if not ended:
                return False
            if reservation_set_status(reservation_id=rid, status=ReservationStatus.ENDING,
                                      expected=(ReservationStatus.PROVISIONING, ReservationStatus.ACTIVE),
                                      reason="window ended") is None:
                return False
            if cluster is not None:
                VirtualCluster.objects.filter(pk=cluster.pk).update(dispatched_at=now)
                _enqueue("teardown_cluster", cluster.pk)
        return True

    ids = Reservation.objects.filter(status__in=(ReservationStatus.PROVISIONING, ReservationStatus.ACTIVE),
                                     period__endswith__lte=now).values_list("id", flat=True)
    return _each(ids, end, "ending")


def _tick_reminders(now: datetime) -> int:
    before_start = timedelta(minutes=setting_int("PORTAL_REMIND_BEFORE_START_MINUTES", 60))
    before_end = timedelta(minutes=setting_int("PORTAL_REMIND_BEFORE_END_MINUTES", 60))
    # Never for a booking made after its reminder's moment (booked 30 minutes ahead: no "starts in 1 h"),
    # as notifications.selectors.reminders_due has it.
    starting = Q(
        reservation__status__in=(ReservationStatus.CONFIRMED, ReservationStatus.PROVISIONING),
        reservation__period__startswith__lte=now + before_start, reservation__period__startswith__gt=now,
        reservation__created_at__lte=F("reservation__period__startswith") - before_start,
    ) & ~Q(start_reminded_for=F("reservation__period__startswith"))
    ending = Q(
        reservation__status__in=(ReservationStatus.ACTIVE, ReservationStatus.PROVISIONING),
        reservation__period__endswith__lte=now + before_end, reservation__period__endswith__gt=now,
        reservation__created_at__lte=F("reservation__period__endswith") - before_end,
    ) & ~Q(end_reminded_for=F("reservation__period__endswith"))
    return (_each(VirtualCluster.objects.filter(starting).values_list("id", flat=True),
                  lambda cid: _remind(cid, "start", due=starting), "reminding of a start")
            + _each(VirtualCluster.objects.filter(ending).values_list("id", flat=True),
                    lambda cid: _remind(cid, "end", due=ending), "reminding of an end"))


def _remind(cluster_id: int, which: str, *, due: Q | None = None) -> int:
    """Emit reservation.starting_soon / ending_soon once per start/end instant (a moved one is reminded again).

    due: the tick's filter, checked again under the cluster's and then the booking's lock (the order _tick_end
    takes them): a start or end moved (or a booking cancelled) after the tick read it is reminded at its new
    time, not marked reminded for it now.
    """
    with transaction.atomic():
        cluster = _lock_cluster(cluster_id)
        reservation = Reservation.objects.select_for_update(of=("self",)).get(pk=cluster.reservation_id)
        if due is not None and not VirtualCluster.objects.filter(due, pk=cluster_id).exists():
            return 0
        instant = reservation.period.lower if which == "start" else reservation.period.upper
        field_name = "start_reminded_for" if which == "start" else "end_reminded_for"
        if getattr(cluster, field_name) == instant:
            return 0
        setattr(cluster, field_name, instant)
        cluster.save(update_fields=[field_name, "updated_at"])
        name = "reservation.starting_soon" if which == "start" else "reservation.ending_soon"
        events.emit(name, reservation_id=reservation.pk, tenant_id=reservation.tenant_id, cluster_id=cluster.pk,
                    **{which: instant.isoformat()})
        audit_record(actor=None, action=name, obj=reservation, tenant_id=reservation.tenant_id,
                     after={which: instant.isoformat()})
    return 1


def _tick_redrive_drains(now: datetime) -> int:
    """Send node_changed again for each unfinished drain whose next try is well overdue (the task's retries are
    spent, or its message was lost) and whose sync is not running. The row's next try moves on first, so the
    next tick does not send it twice; a drain that completes, or a node back in service, deletes its row."""
    grace = timedelta(seconds=setting_int("PORTAL_PROVISIONING_REDISPATCH_SECONDS", 180))
    running = locked_keys(LOCK_NODE_SYNC)
    due = [node_id for node_id in NodeDrain.objects.filter(next_attempt_at__lte=now - grace)
           .values_list("node_id", flat=True) if node_id not in running]
    for node_id in due:
        with transaction.atomic():
            if NodeDrain.objects.filter(node_id=node_id, next_attempt_at__lte=now - grace).update(
                    next_attempt_at=now + grace):
                _enqueue("node_changed", node_id)
    return len(due)


def _tick_redispatch(now: datetime) -> int:
    """Resend work whose message was lost: not running (no lock held), not sent recently, not backing off."""
    stale = now - timedelta(seconds=setting_int("PORTAL_PROVISIONING_REDISPATCH_SECONDS", 180))
    running = locked_keys(LOCK_CLUSTER)
    idle = (Q(dispatched_at__isnull=True) | Q(dispatched_at__lt=stale)) & \
        (Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
    provisioning = VirtualCluster.objects.filter(
        idle, reservation__status=ReservationStatus.PROVISIONING, status__in=PROVISIONING_STATUSES,
    ).values_list("id", flat=True)
    cleanup = VirtualCluster.objects.filter(
        idle, status=ClusterStatus.FAILED, failed_during=FailedDuring.PROVISIONING,
        **{f"backend_state__{_CLEANUP_PENDING}": True},
    ).values_list("id", flat=True)
    teardown = VirtualCluster.objects.filter(idle).exclude(status=ClusterStatus.DELETED).exclude(
        status=ClusterStatus.FAILED, failed_during=FailedDuring.TEARDOWN,
    ).filter(
        Q(status=ClusterStatus.TEARING_DOWN)
        | Q(reservation__status__in=(ReservationStatus.ENDING, ReservationStatus.CANCELLED,
                                     ReservationStatus.COMPLETED))
        | Q(reservation__status=ReservationStatus.FAILED, reservation__period__endswith__lte=now)
    ).values_list("id", flat=True)
    def resend(task_name: str) -> Callable[[int], bool]:
        def send(cluster_id: int) -> bool:
            if cluster_id in running:
                return False
            VirtualCluster.objects.filter(pk=cluster_id).update(dispatched_at=now)
            _send(task_name, cluster_id)
            return True
        return send

    return (_each(provisioning, resend("provision_cluster"), "resending provisioning")
            + _each(teardown, resend("teardown_cluster"), "resending teardown")
            + _each(cleanup, resend("cleanup_failed_cluster"), "resending a failed cluster's cleanup"))


# --- credentials ---------------------------------------------------------------------------


def credential_download(*, actor: Any, cluster: VirtualCluster, kind: str, record: bool = True) -> tuple[str, bytes]:
    """Return (filename, plaintext) of a current credential, for the tenant's leads and members only.

    record=False is for a HEAD request: the same checks and answer, but no body goes out, so no download
    is audited (a link checker or a client probing the size would otherwise fill the log with downloads).
    """
    if not can_download_credentials(user=actor, cluster=cluster):
        raise PermissionDenied("Only the tenant's leads and members can download its credentials.")
    credential = ClusterCredential.objects.current().filter(cluster=cluster, kind=kind).first()
    if credential is None:
        raise NotFound("This cluster has no such credential (yet).")
    try:
        plaintext = crypto.decrypt(credential.ciphertext)
    except crypto.SecretUnreadable:
        raise InvalidState("This credential cannot be decrypted with the portal's current keys; ask platform "
                           "staff to restore the key it was stored with (PORTAL_FERNET_KEYS).") from None
    if record:
        with transaction.atomic(durable=True):
            audit_record(actor=actor, action="cluster.credential_download", obj=credential,
                         tenant_id=cluster.tenant_id, after={"kind": kind, "fingerprint": credential.fingerprint})
    filename = f"{cluster.tenant.slug}-r{cluster.reservation_id}-{CREDENTIAL_FILENAMES[kind]}"
    return filename, plaintext


def credentials_rotate(*, actor: Any = None, batch_size: int = 200) -> tuple[int, list[int]]:
    """Re-encrypt every stored secret with the primary key (the first of PORTAL_FERNET_KEYS).

    Return (how many were re-encrypted, the ids of those no configured key decrypts). One whose key was
    dropped too early is left as stored (it reads again once its key is back) and does not stop the others:
    they must all be under the new key before the old one goes.
    """
    rotated = 0
    unreadable: list[int] = []
    last_id = 0
    while True:
        with transaction.atomic():
            batch = list(ClusterCredential.objects.select_for_update().filter(pk__gt=last_id)
                         .exclude(ciphertext="").order_by("pk")[:batch_size])
            if not batch:
                break
            now = timezone.now()
            done = []
            for credential in batch:
                try:
                    credential.ciphertext = crypto.rotate(credential.ciphertext)
                except crypto.SecretUnreadable:
                    unreadable.append(credential.pk)
                    continue
                credential.rotated_at = now
                done.append(credential)
            ClusterCredential.objects.bulk_update(done, ["ciphertext", "rotated_at"])
            last_id = batch[-1].pk
            rotated += len(done)
    if unreadable:
        logger.error("%s cannot be decrypted with PORTAL_FERNET_KEYS and %s not re-encrypted: %s",
                     count_of(len(unreadable), "cluster credential"), "was" if len(unreadable) == 1 else "were",
                     ", ".join(f"#{pk}" for pk in unreadable))
    if rotated or unreadable:
        with transaction.atomic():
            audit_record(actor=actor, action="cluster.credentials_rotated",
                         obj=ClusterCredential.objects.order_by("pk").first(),
                         after={"count": rotated, "unreadable": unreadable})
    return rotated, unreadable


# --- reconcile -----------------------------------------------------------------------------


def reconcile(*, fix: bool = False, backend_name: str | None = None) -> list[dict[str, Any]]:
    """Compare each configured backend with the database, both ways; repair when fix."""
    now = timezone.now()
    names = [backend_name] if backend_name else configured_backends()
    wanted_q = (
        Q(reservation__status__in=HOLDING_STATUSES, reservation__period__endswith__gt=now)
        & ~Q(status__in=(ClusterStatus.DELETED, ClusterStatus.FAILED, ClusterStatus.TEARING_DOWN))
    )
    out: list[dict[str, Any]] = []
    node_states = dict(Node.objects.values_list("hostname", "state"))
    tenants = set(Tenant.objects.values_list("slug", flat=True))
    for name in names:
        ids = VirtualCluster.objects.filter(wanted_q, backend=name).values_list("id", flat=True)
        wanted = [build_context(cluster_id) for cluster_id in ids]

        def live(reservation_id: int, name: str = name) -> bool:
            """Asked after the backend was read, of what looks orphaned there: booked (and pushed to the
            backend) since `wanted` was read, so not an orphan (its cluster row may not exist yet)."""
            holding = Q(status__in=HOLDING_STATUSES, period__endswith__gt=timezone.now())
            return (VirtualCluster.objects.filter(wanted_q, backend=name, reservation_id=reservation_id).exists()
                    or Reservation.objects.filter(holding, pk=reservation_id, cluster__isnull=True).exists())

        drifts: list[Drift] = []
        # A backend that cannot be read (or stops answering half-way) is reported beside what was found and
        # repaired before, and the next backend is still compared.
        try:
            with _backend(name) as backend:
                drifts += backend.reconcile(wanted, fix=fix, tenants=tenants, live=live,
                                            guard=_repair_guard(wanted_q))
                drifts += backend.reconcile_nodes(node_states, fix=fix, guard=_node_repair_guard)
        except BackendError as exc:
            drifts.append(Drift("unreachable", name, f"backend unreachable: {exc.message}"))
        for drift in drifts:
            if drift.secrets and drift.cluster_id is not None:
                _keep_secrets(drift.cluster_id, PhaseResult(secrets=drift.secrets, backend_state=drift.backend_state))
            out.append({"backend": name, "kind": drift.kind, "name": drift.name, "detail": drift.detail,
                        "repaired": drift.repaired})
    for drift in out:
        logger.warning("reconcile %s: %s %s: %s%s", drift["backend"], drift["kind"], drift["name"], drift["detail"],
                       " (repaired)" if drift["repaired"] else "")
    return out


def _repair_guard(wanted_q: Q) -> RepairGuard:
    """How reconcile --fix repairs one wanted cluster: under the cluster's lock, as provisioning, teardown, syncs
    and swaps run, and only while the cluster is as `wanted` read it. A repair in a backend that holds
    bookings gives it the booking's window, so a cluster degraded by a refusal of that window is ready again.

    Without it a teardown that ran between that read and the repair (the tenant's button, a cancel, the
    window's end) had its work undone: the repair built the cluster again as "missing". A cluster a running
    task holds, or that moved on or changed since, is left alone (reported unrepaired; the next run compares
    it again)."""

    def guard(ctx: ClusterContext, repair: Callable[[], object]) -> object:
        with advisory_lock(LOCK_CLUSTER, ctx.cluster_id) as held:
            if not held:
                raise BackendError(f"left alone: a task holds cluster #{ctx.cluster_id} ({_CLUSTER_BUSY})")
            if not VirtualCluster.objects.filter(wanted_q, pk=ctx.cluster_id).exists():
                raise BackendError(f"left alone: cluster #{ctx.cluster_id} is being torn down or no longer wanted")
            fresh = build_context(ctx.cluster_id)
            if (fresh.nodes, fresh.start, fresh.end, fresh.status) != (ctx.nodes, ctx.start, ctx.end, ctx.status):
                raise BackendError(f"left alone: cluster #{ctx.cluster_id} changed while reconcile ran")
            outcome = repair()
            # A backend that holds bookings (Slurm) was just given this one as the database has it, window
            # and all, as a sync does: a cluster degraded only because it refused that window is whole again.
            if holds_bookings(VirtualCluster.objects.values_list("backend", flat=True).get(pk=ctx.cluster_id)):
                _window_held(ctx.cluster_id)
            return outcome

    return guard


def _node_repair_guard(hostname: str, state: str, repair: Callable[[], object]) -> object:
    """How reconcile --fix drains or resumes one node: under the node's sync lock (node_sync's), and only while
    the node is in (or out of) service as reconcile read it before reading the backend. Without it a node that
    failed after that read, and that its sync had drained, was resumed by the old state (and one put back
    was drained). One whose sync is running, or whose state moved across, is left alone (reported)."""
    node_id = Node.objects.filter(hostname=hostname).values_list("pk", flat=True).first()
    if node_id is None:
        raise BackendError(f"left alone: {hostname} is no longer a portal node")
    with advisory_lock(LOCK_NODE_SYNC, node_id) as held:
        if not held:
            raise BackendError(f"left alone: a sync of {hostname} is running")
        now = Node.objects.values_list("state", flat=True).get(pk=node_id)
        if (now in OUT_OF_SERVICE) != (state in OUT_OF_SERVICE):
            raise BackendError(f"left alone: {hostname} is {now} now")
        return repair()


# --- pool capabilities (staff, from the admin) ---------------------------------------------

__all__ += ["CAPABILITY_FIELDS", "pool_capability_errors", "pool_capability_set", "pool_capability_delete"]

CAPABILITY_FIELDS = ("cuda_versions", "slurm_versions", "kubernetes_versions", "mig_profiles",
                     "max_memory_per_gpu_gib")


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def pool_capability_errors(values: dict[str, Any]) -> dict[str, str]:
    """Return {field: why} for what pool_capabilities and validate_spec could not use (empty when fine)."""
    errors: dict[str, str] = {}
    mig = values.get("mig_profiles")
    if mig is not None and not (isinstance(mig, dict) and all(
            isinstance(name, str) and name.strip() and _whole(count, 1) for name, count in mig.items())):
        errors["mig_profiles"] = ('An object of MIG profile → instances per GPU (a whole number, at least 1), '
                                  'e.g. {"1g.10gb": 7}; {} for no MIG.')
    memory = values.get("max_memory_per_gpu_gib")
    if memory is not None and not _whole(memory, 1):
        errors["max_memory_per_gpu_gib"] = "At least 1 GiB."
    return errors


def _capability_snapshot(row: PoolCapability) -> dict[str, Any]:
    return {f: getattr(row, f) for f in CAPABILITY_FIELDS}


def pool_capability_set(*, actor: Any, pool: Pool, expected: dict[str, Any] | None = None,
                        **values: Any) -> PoolCapability:
    """Create or change what the pool's nodes support (staff); checked as clusters use it, audited.

    Only the fields given are written. expected ({field: value}, what an edit page showed for the fields it
    changes): refused (InvalidState) if any is no longer so, or the row is gone, checked under the pool's lock."""
    errors = pool_capability_errors(values)
    if errors:
        raise InvalidInput("; ".join(f"{k}: {v}" for k, v in errors.items()), fields=errors)
    with transaction.atomic(durable=True):
        # The pool row serialises writers of its capability row, the first one (a create) included.
        Pool.objects.select_for_update(no_key=True).filter(pk=pool.pk).values_list("pk", flat=True).first()
        row = PoolCapability.objects.filter(pool_id=pool.pk).first()
        expected = {k: v for k, v in (expected or {}).items() if k in CAPABILITY_FIELDS}
        refuse_stale(k for k, v in expected.items() if row is None or getattr(row, k) != v)
        before = _capability_snapshot(row) if row is not None else None
        row = row or PoolCapability(pool_id=pool.pk)
        for key in CAPABILITY_FIELDS:
            if key in values:
                setattr(row, key, values[key])
        if before is not None and before == _capability_snapshot(row):
            return row  # nothing changed: no write, no audit entry
        row.save()
        audit_record(actor=actor, action="pool.capability.update" if before else "pool.capability.create", obj=row,
                     before=before, after={"pool": pool.name, **_capability_snapshot(row)})
    return row


def pool_capability_delete(*, actor: Any, capability: PoolCapability) -> None:
    """Remove the pool's capability row: its clusters get the defaults of its GPU model again. Audited."""
    with transaction.atomic(durable=True):
        row = PoolCapability.objects.select_for_update().select_related("pool").filter(pk=capability.pk).first()
        if row is None:
            return
        audit_record(actor=actor, action="pool.capability.delete", obj=row,
                     before={"pool": row.pool.name, **_capability_snapshot(row)})
        row.delete()
