"""Requests PostgreSQL could not even be asked about."""

from __future__ import annotations

from django.http import HttpResponseBadRequest, HttpResponsePermanentRedirect, JsonResponse
from django.middleware.common import CommonMiddleware as DjangoCommonMiddleware
from django.utils.http import escape_leading_slashes

from .api import envelope, is_api

NUL = "\x00"
NUL_MESSAGE = "Must not contain NUL characters."
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _nul_in(request) -> str | None:
    """Where request carries a NUL character (path, a query or form field), else None."""
    if NUL in request.path_info:
        return "path"
    params = [request.GET]
    # Forms of the browser pages; an API body is its parser's and serializers' (reading it here would
    # also take it from DRF, which answers a form-encoded body with 400 content_type).
    if request.method == "POST" and not is_api(request) and request.content_type in _FORM_TYPES:
        params.append(request.POST)
    for query in params:
        for key, values in query.lists():
            if NUL in key or any(NUL in value for value in values):
                return key.replace(NUL, "\\x00") or "query"
    return None


class RejectNulMiddleware:
    """PostgreSQL text cannot hold NUL (0x00), and psycopg refuses to send one: a NUL in a URL
    path segment, a query parameter or a form field would reach some lookup as a database error
    (a 500). Answer such requests here with a 400 naming where the NUL was — the API's envelope
    under /api/, a plain 400 elsewhere. JSON bodies are the serializers' (every string field
    refuses NUL); this covers what reaches views outside them. Cookies with a NUL are dropped."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        # A cookie holding a NUL (the session id, the CSRF token) is dropped, not answered with a 400:
        # the browser would send it with every request and never reach a page to get a fresh one.
        # Without it the request is anonymous, as with an expired session.
        for name in [k for k, v in request.COOKIES.items() if NUL in k or NUL in v]:
            del request.COOKIES[name]
        where = _nul_in(request)
        if where is None:
            return self.get_response(request)
        detail = f"{where}: {NUL_MESSAGE}"
        if is_api(request):
            return JsonResponse(envelope("invalid", detail, {where: NUL_MESSAGE}), status=400)
        return HttpResponseBadRequest(detail, content_type="text/plain")


class CommonMiddleware(DjangoCommonMiddleware):
    """Django's, but the redirect that adds a missing trailing slash keeps the request (308).

    With a 301 a client repeats a POST or PATCH to ``/api/v1/reservations`` as a GET without its
    body (and DEBUG raised an error page instead): the booking it meant to make was silently a
    list. A 308 tells it to send the same request to ``…/reservations/``.
    """

    def response_redirect_class(self, url: str) -> HttpResponsePermanentRedirect:
        return HttpResponsePermanentRedirect(url, preserve_request=True)

    def get_full_path_with_slash(self, request) -> str:
        # Django's refuses in DEBUG for POST/PUT/PATCH/DELETE because its 301 would drop the body.
        return escape_leading_slashes(request.get_full_path(force_append_slash=True))
