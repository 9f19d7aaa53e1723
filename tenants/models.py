from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import OuterRef, Q, Subquery, Value
from simple_history.models import HistoricalRecords

from portal.core.crypto import EncryptedTextField

from .choices import Role
from .querysets import TenantScopedQuerySet

slug_validator = RegexValidator(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$", "Lower-case letters, digits and dashes.")


class TenantQuerySet(TenantScopedQuerySet):
    tenant_path = ""

    def with_role_of(self, user):
        """Annotate each tenant with user's role in it (None when not a member), in the same query.

        `tenants.selectors.role_of` answers from the annotation instead of asking again.
        """
        # order_by(): (user, tenant) is unique, and Membership's default ordering would join two tables.
        role = Membership.objects.filter(tenant=OuterRef("pk"), user=user.pk).order_by().values("role")[:1]
        return self.annotate(role_of_user_id=Value(user.pk, output_field=models.BigIntegerField()),
                             role_of_user=Subquery(role))


class Tenant(models.Model):
    slug = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=120)
    burst_enabled = models.BooleanField(default=False)
    slack_webhook_url = EncryptedTextField(blank=True, default="", help_text="Encrypted at rest.")
    storage_quota_tib = models.PositiveIntegerField(default=10)
    vlan_id = models.PositiveIntegerField(null=True, blank=True, unique=True)
    # Network segments never overlap between tenants: a GiST exclusion on cidr::inet (migration 0002).
    cidr = models.CharField(max_length=43, blank=True, default="")
    ical_token = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=Q(vlan_id__isnull=True) | Q(vlan_id__gte=1, vlan_id__lte=4094),
                name="%(app_label)s_%(class)s_vlan_range",
                violation_error_message="VLAN ids are 1–4094.",
            ),
        ]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant"],
                name="%(app_label)s_%(class)s_unique_user_tenant",
                violation_error_message="That user is already a member of this tenant.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class Quota(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quotas")
    pool = models.ForeignKey("reservations.Pool", on_delete=models.CASCADE, related_name="quotas")
    max_nodes = models.PositiveIntegerField(validators=[MinValueValidator(0)])
    burst_nodes = models.PositiveIntegerField(default=0)
    max_duration_hours = models.PositiveIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedQuerySet.as_manager()
    history = HistoricalRecords()

    class Meta:
        ordering = ["tenant__slug", "pool__name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "pool"],
                name="%(app_label)s_%(class)s_unique_tenant_pool",
                violation_error_message="This tenant already has a quota for that pool.",
            ),
            models.CheckConstraint(
                condition=Q(max_nodes__gte=0) & Q(burst_nodes__gte=0)
                & (Q(max_duration_hours__isnull=True) | Q(max_duration_hours__gte=1)),
                name="%(app_label)s_%(class)s_non_negative",
                violation_error_message="Quota numbers cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.pool}: {self.max_nodes}+{self.burst_nodes}"


class ApiToken(models.Model):
    """A Bearer token; only its SHA-256 is stored, the plaintext is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, default="")
    prefix = models.CharField(max_length=12, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @staticmethod
    def hash_key(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()
