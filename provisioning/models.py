"""Virtual clusters: one per reservation, phased like Together AI's, with per-tenant artefacts."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.querysets import TenantScopedQuerySet

from .choices import (
    ClusterStatus,
    CredentialKind,
    FailedDuring,
    TransitionSource,
    VolumeStatus,
)

__all__ = ["VirtualCluster", "ClusterTransition", "ClusterCredential", "StorageVolume", "PoolCapability", "NodeDrain"]


class VirtualClusterQuerySet(TenantScopedQuerySet):
    pass


class VirtualCluster(models.Model):
    """The tenant's environment on its reserved nodes; status is the current phase."""

    reservation = models.OneToOneField(
        "reservations.Reservation", on_delete=models.PROTECT, related_name="cluster"
    )
    # Denormalised from the reservation so the one tenant scope (for_user) is a plain join.
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="clusters")
    status = models.CharField(max_length=32, choices=ClusterStatus.choices, default=ClusterStatus.PENDING)
    status_reason = models.CharField(max_length=500, blank=True, default="")
    phase_started_at = models.DateTimeField(default=timezone.now)
    backend = models.CharField(max_length=16)

    # The spec, à la carte, validated against the pool (services.cluster_configure).
    orchestrator = models.CharField(max_length=16)
    orchestrator_version = models.CharField(max_length=16)
    cuda_version = models.CharField(max_length=16)
    mig_profile = models.CharField(max_length=16, blank=True, default="")
    default_memory_per_gpu_gib = models.PositiveIntegerField()
    shared_storage_gib = models.PositiveIntegerField()

    # Non-secret connection details (login host, Slurm account and reservation, namespace …).
    connection = models.JSONField(default=dict, blank=True)
    # What the backend needs to find its artefacts again (reservation name, namespace …).
    backend_state = models.JSONField(default=dict, blank=True)

    # Work bookkeeping: the lifecycle tick redispatches a task that was lost (broker restart,
    # killed worker) from these, so no transition depends on one message surviving.
    dispatched_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    failed_during = models.CharField(max_length=16, choices=FailedDuring.choices, blank=True, default="")

    # Reminders sent, by the instant they were for (a moved start/end is reminded again).
    start_reminded_for = models.DateTimeField(null=True, blank=True)
    end_reminded_for = models.DateTimeField(null=True, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = VirtualClusterQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["status"]),
            models.Index(fields=["tenant", "status"]),
            # The lists' order (cluster page, API, admin), newest first.
            models.Index(fields=["-created_at", "-id"], name="cluster_recent"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(default_memory_per_gpu_gib__gte=1),
                name="%(app_label)s_%(class)s_memory_positive",
                violation_error_message="Default memory per GPU must be at least 1 GiB.",
            ),
        ]

    def __str__(self) -> str:
        return f"cluster #{self.pk} ({self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in (ClusterStatus.READY, ClusterStatus.DEGRADED)


class ClusterTransitionQuerySet(TenantScopedQuerySet):
    tenant_path = "cluster__tenant"


class ClusterTransition(models.Model):
    """One phase entered: when, by whom (null = the lifecycle worker), why."""

    cluster = models.ForeignKey(VirtualCluster, on_delete=models.CASCADE, related_name="transitions")
    phase = models.CharField(max_length=32, choices=ClusterStatus.choices)
    previous = models.CharField(max_length=32, choices=ClusterStatus.choices, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    source = models.CharField(max_length=16, choices=TransitionSource.choices, default=TransitionSource.LIFECYCLE)
    detail = models.CharField(max_length=500, blank=True, default="")

    objects = ClusterTransitionQuerySet.as_manager()

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["cluster", "at"])]

    def __str__(self) -> str:
        return f"{self.cluster_id}: {self.previous or '∅'} → {self.phase} at {self.at:%Y-%m-%d %H:%M:%S}"


class ClusterCredentialQuerySet(TenantScopedQuerySet):
    tenant_path = "cluster__tenant"

    def current(self):
        return self.filter(revoked_at__isnull=True)


class ClusterCredential(models.Model):
    """A secret handed to the tenant, stored only as a Fernet token (MultiFernet, rotating keys)."""

    cluster = models.ForeignKey(VirtualCluster, on_delete=models.CASCADE, related_name="credentials")
    kind = models.CharField(max_length=16, choices=CredentialKind.choices)
    ciphertext = models.TextField(help_text="Fernet token; the plaintext is never stored.")
    public_part = models.TextField(blank=True, default="", help_text="Not secret, e.g. the SSH public key.")
    fingerprint = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ClusterCredentialQuerySet.as_manager()

    class Meta:
        ordering = ["cluster_id", "kind"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "kind"],
                condition=Q(revoked_at__isnull=True),
                name="%(app_label)s_%(class)s_one_current_per_kind",
                violation_error_message="A cluster has one current credential of each kind.",
            ),
        ]

    def __str__(self) -> str:
        # Never the secret: this is what admin, logs and tracebacks print.
        return f"{self.kind} of cluster #{self.cluster_id} ({self.fingerprint or 'no fingerprint'})"

    __repr__ = __str__


class StorageVolumeQuerySet(TenantScopedQuerySet):
    def active(self):
        return self.filter(status=VolumeStatus.ACTIVE)


class StorageVolume(models.Model):
    """The tenant's shared volume of one cluster; active volumes count against storage_quota_tib."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="volumes")
    cluster = models.OneToOneField(VirtualCluster, on_delete=models.CASCADE, related_name="volume")
    name = models.CharField(max_length=100)
    size_gib = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=VolumeStatus.choices, default=VolumeStatus.ACTIVE)
    mount_path = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)

    objects = StorageVolumeQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(size_gib__gte=1),
                name="%(app_label)s_%(class)s_size_positive",
                violation_error_message="A volume holds at least 1 GiB.",
            ),
            models.UniqueConstraint(
                fields=["name"],
                condition=Q(status=VolumeStatus.ACTIVE),
                name="%(app_label)s_%(class)s_unique_active_name",
                violation_error_message="An active volume with that name exists.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.size_gib} GiB, {self.status})"


class PoolCapability(models.Model):
    """What a pool's nodes support, for validating cluster specs; without a row, defaults apply."""

    pool = models.OneToOneField("reservations.Pool", on_delete=models.CASCADE, related_name="capability")
    cuda_versions = ArrayField(models.CharField(max_length=16), blank=True, default=list,
                               help_text="Empty: every CUDA version the portal offers.")
    slurm_versions = ArrayField(models.CharField(max_length=16), blank=True, default=list)
    kubernetes_versions = ArrayField(models.CharField(max_length=16), blank=True, default=list)
    mig_profiles = models.JSONField(default=dict, blank=True,
                                    help_text='{"1g.10gb": 7, …}: profile → instances per GPU. Empty: no MIG.')
    max_memory_per_gpu_gib = models.PositiveIntegerField(default=240)

    class Meta:
        verbose_name_plural = "pool capabilities"

    def __str__(self) -> str:
        return f"capabilities of {self.pool_id}"


class NodeDrain(models.Model):
    """A drain some backend could not finish yet (a pod's disruption budget said "not now", Slurm jobs still
    ending): node_sync tries it again with growing waits and the lifecycle tick sends it again once those
    retries are spent, until it completes (the row is then deleted) or the node is back in service."""

    node = models.OneToOneField("reservations.Node", on_delete=models.CASCADE, related_name="+")
    # When the drain was first found unfinished: the age operators are alerted on.
    since = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    # When the next try is due (the task's retry); the tick sends one again once this is well past.
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_error = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["next_attempt_at"], name="node_drain_due")]

    def __str__(self) -> str:
        return f"unfinished drain of node {self.node_id} since {self.since:%Y-%m-%d %H:%M}"
