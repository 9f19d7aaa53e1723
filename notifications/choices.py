"""Choices of the notifications app: channel kinds, delivery states, and which events go where."""

from __future__ import annotations

from django.db import models

from .slack import Event

__all__ = [
    "ChannelKind",
    "DeliveryStatus",
    "AttemptVerdict",
    "EVENT_LABELS",
    "SUBSCRIBABLE_EVENTS",
    "TENANT_DEFAULT_EVENTS",
    "PLATFORM_DEFAULT_EVENTS",
    "TERMINAL_STATUSES",
    "OPEN_STATUSES",
]


class ChannelKind(models.TextChoices):
    SLACK = "slack", "Slack incoming webhook"
    WEBHOOK = "webhook", "Signed webhook"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SENDING = "sending", "Sending"
    RETRYING = "retrying", "Waiting to retry"
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"
    SKIPPED = "skipped", "Skipped"


# Nothing more will happen to a delivery in these states (an admin may still requeue it).
TERMINAL_STATUSES = (DeliveryStatus.DELIVERED, DeliveryStatus.FAILED, DeliveryStatus.SKIPPED)
# A worker will (still) send these.
OPEN_STATUSES = (DeliveryStatus.PENDING, DeliveryStatus.SENDING, DeliveryStatus.RETRYING)


class AttemptVerdict(models.TextChoices):
    SENDING = "sending", "In flight"
    DELIVERED = "delivered", "Delivered"
    RETRY = "retry", "Retry"
    PERMANENT = "permanent", "Permanent error"
    INTERRUPTED = "interrupted", "Interrupted (worker lost)"


EVENT_LABELS: dict[str, str] = {
    Event.RESERVATION_CONFIRMED: "Reservation confirmed",
    Event.RESERVATION_CHANGED: "Reservation changed",
    Event.RESERVATION_CANCELLED: "Reservation cancelled",
    Event.RESERVATION_STARTING_1H: "Reservation starts in 1 hour",
    Event.RESERVATION_ENDING_24H: "Reservation ends in 24 hours",
    Event.RESERVATION_ENDING_1H: "Reservation ends in 1 hour",
    Event.CLUSTER_READY: "Cluster ready",
    Event.CLUSTER_FAILED: "Cluster failed",
    Event.CLUSTER_DEGRADED: "Cluster degraded",
    Event.CLUSTER_CREDENTIALS_RENEWED: "New kubeconfig issued",
    Event.NODE_FAILED: "Node failed",
    Event.NODE_REPLACED: "Node replaced",
    Event.HEALTH_CHECK_FAILED: "Health check failed",
    Event.QUOTA_THRESHOLD: "Quota use at or above the threshold",
}

# What a channel can subscribe to (the test message always goes through).
SUBSCRIBABLE_EVENTS: tuple[str, ...] = tuple(EVENT_LABELS)
TENANT_DEFAULT_EVENTS: tuple[str, ...] = SUBSCRIBABLE_EVENTS
# The platform channel is for the fleet: what on-call must act on, across tenants.
PLATFORM_DEFAULT_EVENTS: tuple[str, ...] = (
    Event.CLUSTER_FAILED,
    Event.CLUSTER_DEGRADED,
    Event.NODE_FAILED,
    Event.NODE_REPLACED,
    Event.HEALTH_CHECK_FAILED,
)
