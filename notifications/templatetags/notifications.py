"""``{% load notifications %}{% delivery_alerts request.user portal.tenant %}``: what a lead must fix.

Renders nothing unless one of the user's channels stopped on a permanent error or messages
failed lately, so it can sit on every dashboard.
"""

from __future__ import annotations

from django import template
from django.urls import reverse

from .. import selectors

register = template.Library()


@register.inclusion_tag("notifications/_alerts.html")
def delivery_alerts(user, tenant=None):
    if not getattr(user, "is_authenticated", False):
        return {"broken": [], "failed": 0}
    return {
        "broken": selectors.broken_channels_for_user(user=user, tenant=tenant),
        "failed": selectors.failed_deliveries_count(user=user, tenant=tenant),
        "settings_url": reverse("notifications:settings"),
        "log_url": reverse("notifications:deliveries"),
    }
