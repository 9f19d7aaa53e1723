"""The one tenant-isolation mechanism: every tenant-owned queryset derives from this."""

from __future__ import annotations

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
        lookup = {f"{self.tenant_path}__memberships__user": user}
        if roles is not None:
            lookup[f"{self.tenant_path}__memberships__role__in"] = list(roles)
        # Filtering across the membership join can duplicate rows; the id subquery avoids DISTINCT.
        return self.filter(pk__in=self.model._base_manager.filter(**lookup).values("pk"))

    def for_tenant(self, tenant):
        return self.filter(**{self.tenant_path: tenant})
