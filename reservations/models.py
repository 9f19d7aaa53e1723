from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.constraints import ExclusionConstraint
from django.contrib.postgres.fields import DateTimeRangeField, RangeOperators
from django.contrib.postgres.indexes import GistIndex
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Func, Q
from django.db.models.functions import Lower

from tenants.models import slug_validator
from tenants.querysets import TenantScopedQuerySet

from .choices import (
    DEFAULT_CUDA_VERSION,
    FINAL_STATUSES,
    AllocationKind,
    Billing,
    NodeState,
    Orchestrator,
    ReservationStatus,
)


class Pool(models.Model):
    """A flavour of identical GPU nodes, e.g. h100-sxm with 8 GPUs each."""

    name = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    gpu_model = models.CharField(max_length=100)
    gpus_per_node = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    slot_minutes = models.PositiveSmallIntegerField(default=60)
    on_demand_rate = models.DecimalField(
        max_digits=10, decimal_places=4, default=0, help_text="Price per GPU-hour for burst bookings."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(gpus_per_node__gte=1) & Q(slot_minutes__gte=1) & Q(slot_minutes__lte=1440)
                & Q(on_demand_rate__gte=0),
                name="%(app_label)s_%(class)s_positive",
                violation_error_message="GPUs per node and slot length must be positive.",
            ),
        ]

    def __str__(self) -> str:
        return self.name


NODE_HOSTNAME_TAKEN = "A node with that hostname exists (hostnames are compared ignoring case)."


class Node(models.Model):
    hostname = models.CharField(max_length=253, unique=True)
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="nodes")
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.AVAILABLE)
    state_reason = models.CharField(max_length=255, blank=True, default="")
    gpus = models.JSONField(default=list, blank=True, help_text="GPU inventory: [{index, uuid, serial}]")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["hostname"]
        indexes = [models.Index(fields=["pool", "state"])]
        constraints = [
            # H100-001 and h100-001 are one host in DNS terms: two nodes for it would book the machine twice.
            models.UniqueConstraint(Lower("hostname"), name="node_hostname_ci_unique",
                                    violation_error_message=NODE_HOSTNAME_TAKEN),
        ]

    def __str__(self) -> str:
        return self.hostname


class ReservationQuerySet(TenantScopedQuerySet):
    def holding(self):
        from .choices import HOLDING_STATUSES

        return self.filter(status__in=HOLDING_STATUSES)

    def meeting(self, *, start=None, end=None):
        """The reservations whose period meets [start, end) (either side may be open): upper(period) > start and
        lower(period) < end, written as overlaps with [start, ∞) and (−∞, end) — equal for the bounded, non-empty
        periods the table holds — so the GiST index on period finds them, not a walk past every finished one."""
        from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

        qs = self
        if start is not None:
            qs = qs.filter(period__overlap=DateTimeTZRange(start, None, "[)"))
        if end is not None:
            qs = qs.filter(period__overlap=DateTimeTZRange(None, end, "[)"))
        return qs


class Reservation(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="reservations")
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="reservations")
    node_count = models.PositiveIntegerField()
    period = DateTimeRangeField()
    name = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(max_length=16, choices=ReservationStatus.choices, default=ReservationStatus.CONFIRMED)
    status_reason = models.CharField(max_length=500, blank=True, default="")
    # Nodes lost to failures with no spare to replace them; > 0 means the reservation is degraded.
    missing_nodes = models.PositiveIntegerField(default=0)
    billing = models.CharField(max_length=16, choices=Billing.choices, default=Billing.COMMITTED)
    # Of a burst booking's nodes, how many are above the guarantee (as the booking preview showed): usage
    # bills that share of its node-hours at the on-demand rate, the rest as committed. 0 when committed.
    burst_part_nodes = models.PositiveIntegerField(default=0, db_default=0)
    # What it is billed at, the pool's as it was booked (a later change to the pool's rate or GPUs per node
    # leaves issued statements alone; an extension keeps them). Left out of an insert (the ORM, raw SQL),
    # the database fills them from the pool (trigger of migration 0013).
    on_demand_rate = models.DecimalField(max_digits=10, decimal_places=4, editable=False)
    gpus_per_node = models.PositiveSmallIntegerField(editable=False)
    # When it was cancelled: usage counts a reservation cancelled while running up to this moment.
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # When its cluster's teardown failed and released its nodes (it ran): usage counts what it held up
    # to this moment, also once a staff retry completes it. Null for every other reservation (one that
    # failed while provisioning never ran and counts nothing).
    released_at = models.DateTimeField(null=True, blank=True)
    orchestrator = models.CharField(max_length=16, choices=Orchestrator.choices, default=Orchestrator.SLURM)
    cuda_version = models.CharField(max_length=16, default=DEFAULT_CUDA_VERSION)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ReservationQuerySet.as_manager()

    class Meta:
        ordering = ["period", "id"]
        indexes = [
            models.Index(fields=["tenant", "pool", "status"]),
            # The default order (staff API list, admin changelist): a page is read off the index.
            models.Index(fields=["period", "id"], name="reservation_period_id"),
            # The same lists filtered by status (?status=active): a page of active bookings read off the
            # index, not found by walking past every completed one before it.
            models.Index(fields=["status", "period", "id"], name="reservation_status_period_id"),
            # A window's reservations (the API list's ?start/?end, ReservationQuerySet.meeting): found by overlap.
            GistIndex(fields=["period"], name="reservation_period_gist"),
            # The quota peak's completed-early branch (selectors._PEAK_SQL): the tenant's completed
            # reservations that end after a window starts, not its whole history.
            models.Index(F("tenant"), F("pool"),
                         Func(F("period"), function="upper", output_field=models.DateTimeField()),
                         condition=Q(status="completed"), name="reservation_completed_until"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(node_count__gte=1),
                name="%(app_label)s_%(class)s_node_count_positive",
                violation_error_message="A reservation needs at least one node.",
            ),
            models.CheckConstraint(
                condition=Q(period__isempty=False) & Q(period__lower_inf=False) & Q(period__upper_inf=False),
                name="%(app_label)s_%(class)s_period_bounded",
                violation_error_message="A reservation needs a non-empty, bounded period.",
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.tenant} {self.node_count}×{self.pool}"

    @property
    def start(self):
        return self.period.lower

    @property
    def end(self):
        return self.period.upper

    @property
    def is_over(self) -> bool:
        """Completed, cancelled or failed: nothing about it changes any more."""
        return self.status in FINAL_STATUSES


class AllocationQuerySet(TenantScopedQuerySet):
    tenant_path = "reservation__tenant"


class Allocation(models.Model):
    """One node held for one period. The exclusion constraint is what forbids double-booking."""

    reservation = models.ForeignKey(
        Reservation, null=True, blank=True, on_delete=models.CASCADE, related_name="allocations"
    )
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    period = DateTimeRangeField()
    kind = models.CharField(max_length=16, choices=AllocationKind.choices, default=AllocationKind.RESERVATION)
    active = models.BooleanField(default=True)
    note = models.CharField(max_length=255, blank=True, default="")
    # When a node swap took the node from the booking (a spare, or nothing, took the rest of the
    # window): the booking held the node over its period up to this instant — nothing, when it is at
    # or before the period's start (moved before it began). Null for every other allocation.
    replaced_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AllocationQuerySet.as_manager()

    class Meta:
        ordering = ["period", "node_id"]
        constraints = [
            ExclusionConstraint(
                name="%(app_label)s_%(class)s_no_double_booking",
                expressions=[("node", RangeOperators.EQUAL), ("period", RangeOperators.OVERLAPS)],
                condition=Q(active=True),
                violation_error_message="That node is already allocated in this period.",
            ),
            models.CheckConstraint(
                condition=Q(period__isempty=False) & Q(period__lower_inf=False) & Q(period__upper_inf=False),
                name="%(app_label)s_%(class)s_period_bounded",
                violation_error_message="An allocation needs a non-empty, bounded period.",
            ),
            models.CheckConstraint(
                condition=Q(kind=AllocationKind.MAINTENANCE, reservation__isnull=True)
                | Q(kind=AllocationKind.RESERVATION, reservation__isnull=False),
                name="%(app_label)s_%(class)s_kind_matches_owner",
                violation_error_message="Reservation allocations belong to a reservation; maintenance ones do not.",
            ),
            models.CheckConstraint(
                condition=Q(replaced_at__isnull=True) | Q(active=False, kind=AllocationKind.RESERVATION),
                name="%(app_label)s_%(class)s_replaced_is_released",
                violation_error_message="A replaced allocation is a released booking allocation.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node} {self.period}"


class PoolSlotUsage(models.Model):
    """Busy nodes of a pool per slot, compacted: reading availability touches one row per slot.

    Written only by PostgreSQL (migration 0006): the allocation and node triggers append
    PoolSlotUsageDelta rows, compaction folds them in here. busy + the slot's pending deltas =
    the pool's available nodes with an active allocation touching the slot.
    """

    # No database FK: its commit-time check would lock the pool row from inside the booking
    # triggers and compaction (see migration 0006 on lock order); Django still cascades deletes.
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False)
    slot = models.DateTimeField(help_text="Start of the slot on the pool's UTC-epoch grid.")
    busy = models.IntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "slot"], name="%(app_label)s_%(class)s_unique_pool_slot",
                                    violation_error_message="One usage row per pool and slot."),
        ]

    def __str__(self) -> str:
        return f"{self.pool_id}@{self.slot:%Y-%m-%dT%H:%MZ}: {self.busy}"


class PoolSlotUsageDelta(models.Model):
    """A pending change of PoolSlotUsage.busy, appended by the triggers: writers never contend on a counter."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False)
    slot = models.DateTimeField()
    delta = models.IntegerField()

    class Meta:
        indexes = [models.Index(fields=["pool", "slot"], name="reservations_usagedelta_slot")]

    def __str__(self) -> str:
        return f"{self.pool_id}@{self.slot:%Y-%m-%dT%H:%MZ}: {self.delta:+d}"


class IdempotencyKey(models.Model):
    """A client's Idempotency-Key on POST /reservations/: the same key returns the same booking."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    reservation = models.ForeignKey(Reservation, null=True, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "key"], name="%(app_label)s_%(class)s_unique_user_key")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}:{self.key}"
