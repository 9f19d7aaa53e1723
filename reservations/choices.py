from django.db import models


class NodeState(models.TextChoices):
    AVAILABLE = "available", "Available"
    DRAINING = "draining", "Draining"
    MAINTENANCE = "maintenance", "Maintenance"
    FAILED = "failed", "Failed"
    RETIRED = "retired", "Retired"


class ReservationStatus(models.TextChoices):
    CONFIRMED = "confirmed", "Confirmed"
    PROVISIONING = "provisioning", "Provisioning"
    ACTIVE = "active", "Active"
    ENDING = "ending", "Ending"
    COMPLETED = "completed", "Completed"
    CANCELLED = "cancelled", "Cancelled"
    FAILED = "failed", "Failed"


# Reservations in these states hold their nodes and count against the quota.
HOLDING_STATUSES = (
    ReservationStatus.CONFIRMED,
    ReservationStatus.PROVISIONING,
    ReservationStatus.ACTIVE,
    ReservationStatus.ENDING,
)
# Reservations in these states can no longer be changed.
FINAL_STATUSES = (ReservationStatus.COMPLETED, ReservationStatus.CANCELLED, ReservationStatus.FAILED)


class Billing(models.TextChoices):
    COMMITTED = "committed", "Committed"
    BURST = "burst", "Burst (on-demand rate)"


class AllocationKind(models.TextChoices):
    RESERVATION = "reservation", "Reservation"
    MAINTENANCE = "maintenance", "Maintenance window"


class Orchestrator(models.TextChoices):
    SLURM = "slurm", "Slurm"
    KUBERNETES = "kubernetes", "Kubernetes"


CUDA_VERSIONS = ("12.2", "12.4", "12.6", "12.8", "13.0")
DEFAULT_CUDA_VERSION = "12.8"
