"""Reads about virtual clusters; every user-facing one goes through for_user (the tenant scope)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from reservations.choices import CUDA_VERSIONS, NodeState
from reservations.models import Allocation, Node, Pool
from tenants.choices import BOOKING_ROLES
from tenants.models import Membership
from tenants.selectors import role_of

from .choices import (
    DEFAULT_MEMORY_PER_GPU_GIB,
    MAX_MEMORY_PER_GPU_GIB,
    MIG_PROFILES_BY_MODEL,
    ORCHESTRATOR_VERSIONS,
    ClusterStatus,
    FailedDuring,
)
from .models import ClusterCredential, ClusterTransition, PoolCapability, VirtualCluster

__all__ = [
    "Capabilities",
    "pool_capabilities",
    "clusters_for_user",
    "cluster_node_hostnames",
    "can_download_credentials",
    "credential_tenant_ids",
    "can_manage_cluster",
    "can_retry_cluster",
    "retry_refusal",
    "teardown_hold_reason",
    "failed_teardown_hold",
    "nodes_held_after_failed_teardown",
]


@dataclass(frozen=True)
class Capabilities:
    """What a pool supports: the menu a cluster spec is validated against."""

    cuda_versions: tuple[str, ...]
    orchestrator_versions: dict[str, tuple[str, ...]]
    mig_profiles: dict[str, int]
    max_memory_per_gpu_gib: int
    default_memory_per_gpu_gib: int


def pool_capabilities(pool: Pool) -> Capabilities:
    """Return the pool's own PoolCapability row, or defaults derived from its GPU model."""
    try:
        row = pool.capability  # one query, or none when the caller select_related() it
    except PoolCapability.DoesNotExist:
        row = None
    if row is not None:
        versions = {
            "slurm": tuple(row.slurm_versions) or ORCHESTRATOR_VERSIONS["slurm"],
            "kubernetes": tuple(row.kubernetes_versions) or ORCHESTRATOR_VERSIONS["kubernetes"],
        }
        return Capabilities(
            cuda_versions=tuple(row.cuda_versions) or CUDA_VERSIONS,
            orchestrator_versions=versions,
            mig_profiles={str(k): int(v) for k, v in (row.mig_profiles or {}).items()},
            max_memory_per_gpu_gib=row.max_memory_per_gpu_gib,
            default_memory_per_gpu_gib=min(DEFAULT_MEMORY_PER_GPU_GIB, row.max_memory_per_gpu_gib),
        )
    model = pool.gpu_model.lower()
    mig = next((profiles for needle, profiles in MIG_PROFILES_BY_MODEL if needle in model), {})
    return Capabilities(
        cuda_versions=CUDA_VERSIONS,
        orchestrator_versions=dict(ORCHESTRATOR_VERSIONS),
        mig_profiles=dict(mig),
        max_memory_per_gpu_gib=MAX_MEMORY_PER_GPU_GIB,
        default_memory_per_gpu_gib=DEFAULT_MEMORY_PER_GPU_GIB,
    )


def clusters_for_user(*, user) -> QuerySet[VirtualCluster]:
    """Return the clusters user may see, with everything the API and page show, in few queries."""
    return (
        VirtualCluster.objects.for_user(user)
        .select_related("reservation__pool", "tenant", "volume")
        .prefetch_related(
            Prefetch("transitions", queryset=ClusterTransition.objects.order_by("at", "id")),
            Prefetch("credentials", queryset=ClusterCredential.objects.current().order_by("kind"),
                     to_attr="current_credentials"),
            Prefetch("reservation__allocations",
                     queryset=Allocation.objects.filter(active=True).select_related("node").order_by("node__hostname"),
                     to_attr="active_allocations"),
        )
    )


def cluster_node_hostnames(cluster: VirtualCluster) -> list[str]:
    """Return the hostnames the cluster runs on (its reservation's active allocations)."""
    prefetched = getattr(cluster.reservation, "active_allocations", None)
    if prefetched is not None:
        return [a.node.hostname for a in prefetched]
    return list(
        Allocation.objects.filter(reservation_id=cluster.reservation_id, active=True)
        .order_by("node__hostname").values_list("node__hostname", flat=True)
    )


def can_download_credentials(*, user, cluster: VirtualCluster) -> bool:
    """Only the tenant's leads and members; viewers and platform staff get no tenant secrets."""
    return role_of(user=user, tenant=cluster.tenant) in BOOKING_ROLES


def credential_tenant_ids(*, user) -> frozenset[int]:
    """The tenants whose credentials user may download (can_download_credentials' rule for many clusters
    in one query): where they are a lead or member; platform staff as such, none."""
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    return frozenset(Membership.objects.filter(user=user, role__in=BOOKING_ROLES)
                     .values_list("tenant_id", flat=True))


def can_manage_cluster(*, user, cluster: VirtualCluster) -> bool:
    """Tear down early: staff, the tenant's lead, or the member who booked it."""
    if getattr(user, "is_staff", False):
        return True
    role = role_of(user=user, tenant=cluster.tenant)
    if role == "lead":
        return True
    return role == "member" and cluster.reservation.created_by_id == user.pk


def retry_refusal(*, cluster: VirtualCluster, now: datetime) -> str:
    """Why services.cluster_retry refuses the cluster ('' when it takes it): only a failed cluster, and one
    that failed provisioning only while its booking's window is not over (a failed teardown is retried
    whenever)."""
    if cluster.status != ClusterStatus.FAILED:
        return f"Cluster #{cluster.pk} is {cluster.status}; only a failed cluster can be retried."
    if cluster.failed_during != FailedDuring.TEARDOWN and cluster.reservation.period.upper <= now:
        return f"Reservation #{cluster.reservation_id} has ended; there is nothing to provision."
    return ""


def can_retry_cluster(*, user, cluster: VirtualCluster, now: datetime | None = None) -> bool:
    """Offer the retry where services.cluster_retry would take it: staff, and no retry_refusal."""
    return bool(getattr(user, "is_staff", False)) and not retry_refusal(cluster=cluster, now=now or timezone.now())


_HOLD_TEXT = "teardown of cluster #{} failed: held until its teardown is retried"


def teardown_hold_reason(cluster_id: int) -> str:
    """The state reason of a node provisioning holds in maintenance after the cluster's teardown failed for good."""
    return _HOLD_TEXT.format(cluster_id)


# The same text, read back: the cluster id where the reason has it.
_TEARDOWN_HOLD = re.compile(re.escape(_HOLD_TEXT).replace(re.escape("{}"), r"(\d+)"))


def failed_teardown_hold(node: Node) -> int | None:
    """Return the cluster whose failed teardown holds the node out of service (the portal's own hold), else None.

    The hold stands while the node is in maintenance for that reason (teardown_hold_reason) and the cluster is
    not deleted: the tenant's cluster, credentials, mounts and jobs may still be on the node until a retried
    teardown succeeds and gives it back. A node staff put in maintenance, or whose reason staff rewrote, is not
    held.
    """
    return nodes_held_after_failed_teardown([node]).get(node.pk)


def nodes_held_after_failed_teardown(nodes: Iterable[Node]) -> dict[int, int]:
    """Return {node id: cluster id} for the nodes a failed teardown holds (see failed_teardown_hold)."""
    claimed: dict[int, int] = {}
    for node in nodes:
        match = _TEARDOWN_HOLD.fullmatch(node.state_reason or "") if node.state == NodeState.MAINTENANCE else None
        if match is not None:
            claimed[node.pk] = int(match.group(1))
    if not claimed:
        return {}
    live = set(VirtualCluster.objects.filter(pk__in=set(claimed.values())).exclude(status=ClusterStatus.DELETED)
               .values_list("pk", flat=True))
    return {node_id: cluster_id for node_id, cluster_id in claimed.items() if cluster_id in live}
