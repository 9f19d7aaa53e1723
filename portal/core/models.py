from django.conf import settings
from django.db import models


class AuditLog(models.Model):
    """One state change made through a service: who, what, before → after."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=64, db_index=True)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    # Kept as a plain id so the core app does not depend on tenants (imports only go down).
    tenant_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.action} {self.object_type}#{self.object_id}"


class OutboxEvent(models.Model):
    """A domain event waiting for its background subscribers: the transactional outbox.

    ``events.emit`` writes the row in the emitter's transaction, so the event exists exactly
    when the change it announces does, due at once; after the commit the relay
    (``core.outbox_relay``, woken by the commit or run by beat) sends one Celery message carrying
    the id and leases the row. The worker runs the subscribers and deletes the row. A row whose
    wake-up never left (the process died after the commit, Redis or the broker was down) or whose
    message was lost is sent by the relay's next run once ``available_at`` has passed.
    """

    event = models.CharField(max_length=64)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    # When the relay may (re)publish it: pushed forward by every publish and every claim.
    available_at = models.DateTimeField(db_index=True)
    attempts = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.event} #{self.pk}"
