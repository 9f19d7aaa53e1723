"""Where notifications go (channels) and what happened to each one (deliveries and attempts).

A delivery is one message for one (event, channel): its ``key`` is unique, so however often an
event is announced, fanned out or retried, the database holds one row and the workers send
it until it is delivered or given up — never twice in parallel (the claim is a conditional
UPDATE with a lease) and never lost (the row exists before any task is queued; the sweeper
requeues what a lost worker left behind).
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q

from portal.core.crypto import EncryptedTextField, mask
from tenants.querysets import TenantScopedQuerySet

from .choices import AttemptVerdict, ChannelKind, DeliveryStatus

__all__ = ["Channel", "Delivery", "DeliveryAttempt", "QuotaAlertState", "url_fingerprint"]


def url_fingerprint(url: str) -> str:
    """Return a short hash of a webhook URL: which URL broke, without storing it again."""
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:16] if url else ""


class ChannelQuerySet(TenantScopedQuerySet):
    def platform(self):
        return self.filter(tenant__isnull=True)


class Channel(models.Model):
    """A destination: a tenant's Slack webhook, a tenant's signed webhook, or the platform Slack channel.

    Where the URL lives: a tenant's Slack URL is ``Tenant.slack_webhook_url`` (one secret, one
    place); the platform channel's comes from ``PORTAL_PLATFORM_SLACK_WEBHOOK``; a signed
    webhook's is ``url`` here. Secrets are encrypted at rest and only ever shown masked.
    """

    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="notification_channels",
        help_text="Empty for the platform channel.",
    )
    kind = models.CharField(max_length=16, choices=ChannelKind.choices)
    name = models.CharField(max_length=100, blank=True, default="")
    url = EncryptedTextField(blank=True, default="", help_text="Signed webhooks only; encrypted at rest.")
    secret = EncryptedTextField(blank=True, default="", help_text="whsec_… signing secret; encrypted at rest.")
    # Key rotation: until this expires, requests carry a signature with the old secret too.
    previous_secret = EncryptedTextField(blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    events = ArrayField(models.CharField(max_length=40), default=list, blank=True)
    enabled = models.BooleanField(default=True)
    # Set when the endpoint answered a permanent error: no more sends until the URL changes,
    # a test message gets through, or someone clears it. The fingerprint says which URL broke,
    # so a new Slack URL saved from anywhere (API, admin) un-breaks the channel by itself.
    broken_at = models.DateTimeField(null=True, blank=True)
    broken_error = models.CharField(max_length=100, blank=True, default="")
    broken_status = models.PositiveSmallIntegerField(null=True, blank=True)
    broken_url_fp = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ChannelQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "kind", "name", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"], condition=Q(kind=ChannelKind.SLACK),
                name="%(app_label)s_%(class)s_one_slack_per_tenant",
                violation_error_message="A tenant has one Slack channel.",
            ),
            models.UniqueConstraint(
                fields=["kind"], condition=Q(tenant__isnull=True),
                name="%(app_label)s_%(class)s_one_platform_channel",
                violation_error_message="There is one platform channel.",
            ),
            models.CheckConstraint(
                condition=Q(tenant__isnull=False) | Q(kind=ChannelKind.SLACK),
                name="%(app_label)s_%(class)s_platform_is_slack",
                violation_error_message="The platform channel is a Slack channel.",
            ),
        ]

    def __str__(self) -> str:
        return self.label

    @property
    def is_platform(self) -> bool:
        return self.tenant_id is None

    @property
    def label(self) -> str:
        if self.is_platform:
            return "Platform Slack channel"
        if self.kind == ChannelKind.SLACK:
            return f"Slack ({self.tenant})"
        return f"Webhook {self.name or self.pk} ({self.tenant})"

    def target_url(self) -> str:
        """Return the URL to POST to ('' when none is configured)."""
        if self.is_platform:
            return getattr(settings, "PORTAL_PLATFORM_SLACK_WEBHOOK", "") or ""
        if self.kind == ChannelKind.SLACK:
            return self.tenant.slack_webhook_url or ""
        return self.url or ""

    def masked_url(self) -> str:
        return mask(self.target_url(), keep=6)

    @property
    def is_broken(self) -> bool:
        """Broken, and still pointing at the URL that broke."""
        return self.broken_at is not None and self.broken_url_fp == url_fingerprint(self.target_url())


class DeliveryQuerySet(TenantScopedQuerySet):
    pass


class Delivery(models.Model):
    """One message for one (event, channel), sent at least once and recorded exactly once."""

    key = models.CharField(max_length=255, unique=True)
    channel = models.ForeignKey(Channel, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries")
    # Kept when the channel is deleted, so the log still says where it went.
    channel_label = models.CharField(max_length=200, blank=True, default="")
    kind = models.CharField(max_length=16, choices=ChannelKind.choices)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="notification_deliveries",
        help_text="Whose log it is in; empty for the platform channel.",
    )
    event = models.CharField(max_length=40, db_index=True)
    source_event = models.CharField(max_length=64, blank=True, default="")
    # webhook-id: the same on every retry, so a receiver can drop a duplicate.
    message_id = models.CharField(max_length=64)
    payload = models.JSONField(default=dict, blank=True)
    # Exactly the bytes that are POSTed (and signed), fixed when the delivery is created.
    body = models.TextField()
    summary = models.CharField(max_length=300, blank=True, default="")
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # Attempts before the last manual requeue: the retry budget counts from here.
    requeued_after = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    claim = models.UUIDField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=200, blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = DeliveryQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "deliveries"
        indexes = [
            models.Index(fields=["status", "next_attempt_at"]),
            models.Index(fields=["tenant", "-created_at"]),
        ]
        constraints = [
            models.CheckConstraint(
                condition=~Q(status=DeliveryStatus.DELIVERED) | Q(delivered_at__isnull=False),
                name="%(app_label)s_%(class)s_delivered_has_time",
                violation_error_message="A delivered message records when.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} → {self.channel_label} ({self.status})"


class DeliveryAttempt(models.Model):
    """One POST (or one attempt cut short by a lost worker)."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    verdict = models.CharField(max_length=16, choices=AttemptVerdict.choices, default=AttemptVerdict.SENDING)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=200, blank=True, default="")
    retry_after = models.FloatField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["delivery_id", "number"]
        constraints = [
            models.UniqueConstraint(
                fields=["delivery", "number"], name="%(app_label)s_%(class)s_unique_number",
                violation_error_message="Attempt numbers are unique per delivery.",
            )
        ]

    def __str__(self) -> str:
        return f"#{self.number} {self.verdict}"


class QuotaAlertState(models.Model):
    """Whether a tenant's bookings in a pool are above the alert threshold; counts the crossings.

    One alert per upward crossing: the n-th crossing is the delivery key, so re-checking
    after every booking change never repeats an alert, and falling below re-arms it.
    """

    quota = models.OneToOneField("tenants.Quota", on_delete=models.CASCADE, related_name="alert_state")
    above = models.BooleanField(default=False)
    crossings = models.PositiveIntegerField(default=0)
    last_peak = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.quota}: {'above' if self.above else 'below'} ({self.crossings})"
