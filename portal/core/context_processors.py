"""Template context every page gets, including those Django renders itself (403, 404)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest


def portal(request: HttpRequest) -> dict[str, Any]:
    """The signed-in user's portal context (tenant, role, time zone) where the view resolved it.

    Pages rendered through render_page pass it anyway; this is for the error pages Django renders
    after a view raised (PermissionDenied, Http404), so their header keeps the tenant, the role and
    the user's links instead of falling back to the signed-out menu.
    """
    return {"portal": getattr(request, "portal", None)}
