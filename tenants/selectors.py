"""Reads about tenants, memberships and quotas."""

from __future__ import annotations

from .models import Membership, Quota, Tenant

__all__ = ["role_of", "tenants_for_user", "quota_for"]


def role_of(*, user, tenant: Tenant) -> str | None:
    """Return the user's role in tenant, or None when they are not a member."""
    if not getattr(user, "is_authenticated", False):
        return None
    if getattr(tenant, "role_of_user_id", None) == user.pk:  # read with Tenant.objects.with_role_of(user)
        return tenant.role_of_user
    return Membership.objects.filter(user=user, tenant=tenant).values_list("role", flat=True).first()


def tenants_for_user(*, user):
    return Tenant.objects.for_user(user)


def quota_for(*, tenant: Tenant, pool) -> Quota | None:
    return Quota.objects.filter(tenant=tenant, pool=pool).first()
