"""What the browser pages answer where a view itself answers nothing a person can read."""

from __future__ import annotations

from urllib.parse import urlsplit

from django.db import DatabaseError
from django.http import HttpResponseNotAllowed, JsonResponse
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme

from portal.core.api import envelope, is_api
from portal.core.exceptions import Busy, is_transient
from tenants.views import resolve_portal

__all__ = ["BusyPageMiddleware", "MethodNotAllowedPageMiddleware"]


class MethodNotAllowedPageMiddleware:
    """Answer a browser's GET of an action's address (cancel, remove a member, run a check, delete a
    webhook: views under ``require_POST``, Django's logout) with a 405 page in the portal's layout.

    Django's ``HttpResponseNotAllowed`` has an empty body, so a reload after pressing such a button,
    a bookmark or an opened link showed a blank page. The page says the action needs its button and
    links back; the status and the Allow header stay as the view set them. Other methods (a PUT to a
    page) and the API (whose 405 is DRF's envelope) are left as they are.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            isinstance(response, HttpResponseNotAllowed)
            and request.method in ("GET", "HEAD")
            and not is_api(request)
        ):
            return self._page(request, response)
        return response

    def _page(self, request, refused: HttpResponseNotAllowed):
        if request.user.is_authenticated and getattr(request, "portal", None) is None:
            # The method check sits outside portal_view, so the header's tenant and role are resolved here.
            request.portal = resolve_portal(request)
        response = render(request, "405.html", {"path": request.path, "back": _back(request)}, status=405)
        response["Allow"] = refused["Allow"]
        return response


def _back(request) -> str | None:
    """The page the user came from, when it is one of this site's other than the refused address."""
    referer = request.headers.get("referer")
    if not referer or not url_has_allowed_host_and_scheme(referer, allowed_hosts={request.get_host()},
                                                          require_https=request.is_secure()):
        return None
    parts = urlsplit(referer)
    if not parts.path or parts.path == request.path:
        return None
    return parts.path + (f"?{parts.query}" if parts.query else "")


class BusyPageMiddleware:
    """Answer a write that lost to concurrent ones (PostgreSQL rolled it back: a deadlock, a serialization
    failure) and that its service does not retry, or that raised Busy once its retries ran out, with 503 and
    Retry-After — a page saying nothing was changed and to try again, the envelope (code ``busy``) under
    /api/ — rather than a 500: the request was fine, and sent again it should succeed. The API's own views get
    the same from its exception handler."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, Busy):  # a service that retried, as many times as it does, and lost each time
            busy = exception
        elif isinstance(exception, DatabaseError) and is_transient(exception):
            busy = Busy()
        else:
            return None
        if is_api(request):
            response = JsonResponse(envelope(busy.code, busy.detail), status=busy.status)
        else:
            if request.user.is_authenticated and getattr(request, "portal", None) is None:
                request.portal = resolve_portal(request)
            response = render(request, "503.html", {"detail": busy.detail, "back": _back(request)},
                              status=busy.status)
        response["Retry-After"] = str(busy.retry_after)
        return response
