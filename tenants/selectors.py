"""Reads about tenants, memberships and quotas."""

from __future__ import annotations

import hashlib
import hmac

from django.db.models import Q
from django.utils import timezone

from .models import ApiToken, Membership, Quota, Tenant

__all__ = ["role_of", "tenants_for_user", "quota_for", "quota_version", "ical_feed_token", "ical_feed_tenant",
           "api_tokens_of", "api_tokens_live", "team_of"]


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


def quota_version(quota: Quota) -> str:
    """The quota's version as an edit form carries it: its last save's time (every save through the services
    sets updated_at), so a form opened before another save can be told apart from a current one."""
    return quota.updated_at.isoformat() if quota.updated_at else ""


# A calendar feed address is personal: "<membership id>-<MAC>", the MAC keyed with the tenant's feed
# secret (Tenant.ical_token, never shown itself). It works as long as that membership exists and its
# user is active, so someone who leaves the tenant loses the feed and the others keep theirs; a lead
# issuing a new secret changes every member's address at once.
_FEED_MAC_HEX = 32  # 128 bits


def ical_feed_token(*, tenant: Tenant, membership_id: int) -> str | None:
    """Return a member's feed token for the tenant, or None while the tenant has no feed secret."""
    if not tenant.ical_token:
        return None
    mac = hmac.new(tenant.ical_token.encode(), f"ical-member:{membership_id}".encode(), hashlib.sha256)
    return f"{membership_id}-{mac.hexdigest()[:_FEED_MAC_HEX]}"


def ical_feed_tenant(*, slug: str, token: str) -> Tenant | None:
    """Return the tenant whose feed the token opens: a current, active member's, for that slug; else None."""
    member_id, _, mac = token.partition("-")
    if not (member_id.isascii() and member_id.isdigit()) or len(mac) != _FEED_MAC_HEX or len(member_id) > 18:
        return None
    membership = (Membership.objects.select_related("tenant")
                  .filter(pk=int(member_id), tenant__slug=slug, user__is_active=True).first())
    if membership is None:
        return None
    expected = ical_feed_token(tenant=membership.tenant, membership_id=membership.pk)
    if expected is None or not hmac.compare_digest(expected.encode(), token.encode()):
        return None
    return membership.tenant


def api_tokens_of(*, user, limit: int = 100):
    """The user's own API tokens, newest first (revoked and expired ones too, for the record)."""
    return ApiToken.objects.filter(user=user).order_by("-created_at", "-pk")[:limit]


def api_tokens_live(*, user):
    """The user's tokens that still authenticate: not revoked, not expired."""
    return ApiToken.objects.filter(user=user, revoked=False).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))


def team_of(*, tenant: Tenant):
    """The tenant's memberships with their users: leads first, then by username."""
    from django.db.models import Case, IntegerField, Value, When

    from .choices import Role

    rank = Case(When(role=Role.LEAD, then=Value(0)), When(role=Role.MEMBER, then=Value(1)), default=Value(2),
                output_field=IntegerField())
    return (Membership.objects.filter(tenant=tenant).select_related("user")
            .annotate(rank=rank).order_by("rank", "user__username"))
