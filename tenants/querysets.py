"""The one tenant-isolation mechanism: every tenant-owned queryset derives from this."""

from __future__ import annotations

from django.apps import apps
from django.db import models

__all__ = ["TenantScopedQuerySet"]


class TenantScopedQuerySet(models.QuerySet):
    """A queryset that knows the path from its model to the owning tenant.

    `for_user(user)` is used by every API view, selector and form: staff see all rows,
    anyone else only rows of tenants they are a member of, the anonymous nothing.
    """

    tenant_path = "tenant"

    def for_user(self, user, *, roles=None):
        if not getattr(user, "is_authenticated", False):
            return self.none()
        if user.is_staff and roles is None:
            return self.all()
        memberships = apps.get_model("tenants", "Membership")._base_manager.filter(user=user.pk)
        if roles is not None:
            memberships = memberships.filter(role__in=list(roles))
        # tenant IN (the user's memberships' tenants): the path to the tenant is single-valued, so no
        # row can repeat, and the outer query needs no join to the membership table at all.
        lookup = f"{self.tenant_path}__in" if self.tenant_path else "pk__in"
        return self.filter(**{lookup: memberships.values("tenant_id")})

    def for_tenant(self, tenant):
        return self.filter(**{self.tenant_path: tenant})
