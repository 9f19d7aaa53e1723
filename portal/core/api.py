"""API primitives every app uses: the error envelope, pagination, throttles."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError
from django.http import Http404, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response
from rest_framework.views import set_rollback

from .exceptions import Busy, DomainError, is_transient

__all__ = ["exception_handler", "envelope", "validated", "no_body", "known_query", "json_400", "json_404", "json_500"]


def envelope(code: str, detail: str, fields: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "detail": detail, "fields": fields or {}}
    body.update(extra)
    return body


def _flatten(errors: Any, prefix: str = "") -> dict[str, str]:
    """Flatten DRF's nested error structure into {"a.b": "message"}."""
    out: dict[str, str] = {}
    if isinstance(errors, dict):
        for key, value in errors.items():
            name = "non_field_errors" if key == "non_field_errors" and not prefix else f"{prefix}{key}"
            out.update(_flatten(value, f"{name}."))
    elif isinstance(errors, list):
        if all(not isinstance(e, dict | list) for e in errors):
            out[prefix.rstrip(".") or "non_field_errors"] = " ".join(str(e) for e in errors)
        else:
            for i, value in enumerate(errors):
                out.update(_flatten(value, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".") or "non_field_errors"] = str(errors)
    return out


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Map every error to the one envelope of DESIGN §6."""
    headers: dict[str, str] = {}
    if isinstance(exc, DatabaseError) and is_transient(exc):
        # A write that lost to concurrent ones where its service does not retry: nothing was written.
        exc = Busy()
    if isinstance(exc, DomainError):
        status, body = exc.status, envelope(exc.code, exc.detail, exc.fields, **exc.extra)
        if getattr(exc, "retry_after", None):
            headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, drf.ValidationError):
        fields = _flatten(exc.detail)
        first = next(iter(fields.items()), ("", "Invalid input."))
        status, body = 400, envelope("invalid", f"{first[0]}: {first[1]}" if first[0] else first[1], fields)
    elif isinstance(exc, RequestDataTooBig):
        # DRF hands a JSON parser request.body, which Django refuses past DATA_UPLOAD_MAX_MEMORY_SIZE before
        # the parser's own bound (PORTAL_API_MAX_BODY_BYTES) is reached: the same answer as the parser's.
        limit = min(settings.PORTAL_API_MAX_BODY_BYTES, settings.DATA_UPLOAD_MAX_MEMORY_SIZE or float("inf"))
        why = f"JSON parse error - the body is larger than {limit} bytes"
        status, body = 400, envelope("invalid", f"Malformed request body: {why}", {"body": why})
    elif isinstance(exc, drf.ParseError):
        status, body = 400, envelope("invalid", f"Malformed request body: {exc.detail}", {"body": str(exc.detail)})
    elif isinstance(exc, drf.UnsupportedMediaType):
        status, body = 400, envelope(
            "invalid", "Send the body as application/json.", {"content_type": str(exc.detail)}
        )
    elif isinstance(exc, drf.NotAuthenticated | drf.AuthenticationFailed):
        status, body = 401, envelope("not_authenticated", str(exc.detail))
        headers["WWW-Authenticate"] = 'Bearer realm="api"'
    elif isinstance(exc, drf.PermissionDenied | DjangoPermissionDenied):
        detail = getattr(exc, "detail", None) or "You do not have permission to perform this action."
        status, body = 403, envelope("permission_denied", str(detail))
    elif isinstance(exc, drf.NotFound | Http404):
        status, body = 404, envelope("not_found", "Not found.")
    elif isinstance(exc, drf.Throttled):
        wait = int(exc.wait or 1)
        status, body = 429, envelope("throttled", f"Too many requests; retry in {wait} s.")
        headers["Retry-After"] = str(wait)
    elif isinstance(exc, drf.MethodNotAllowed):
        status, body = 405, envelope("method_not_allowed", str(exc.detail))
    elif isinstance(exc, drf.NotAcceptable):
        status, body = 406, envelope("not_acceptable", str(exc.detail))
    elif isinstance(exc, drf.APIException):
        status, body = exc.status_code, envelope(exc.default_code, str(exc.detail))
    else:
        return None
    set_rollback()
    return Response(body, status=status, headers=headers)


def is_api(request) -> bool:
    """Whether request is one of the API's, answered with the envelope rather than a page."""
    return request.path_info.startswith("/api/")


def json_400(request, exception=None):
    """Answer what Django itself refuses as SuspiciousOperation (too many query parameters, a Host it
    does not serve) with the envelope under /api/, Django's page elsewhere. The client's own text (a
    Host header) is not echoed back."""
    if is_api(request):
        from django.core.exceptions import DisallowedHost, TooManyFieldsSent, TooManyFilesSent

        if isinstance(exception, DisallowedHost):
            fields = {"host": "Not a host this server answers to."}
        elif isinstance(exception, TooManyFieldsSent | TooManyFilesSent):
            fields = {"query": "Too many parameters."}
        else:
            fields = {"request": "Refused as malformed."}
        name, why = next(iter(fields.items()))
        return JsonResponse(envelope("invalid", f"{name}: {why}", fields), status=400)
    from django.views.defaults import bad_request

    return bad_request(request, exception)


def json_404(request, exception=None):  # noqa: ARG001
    """Answer unknown URLs with the envelope under /api/, Django's page elsewhere."""
    if is_api(request):
        return JsonResponse(envelope("not_found", "Not found."), status=404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def json_500(request):
    if is_api(request):
        return JsonResponse(envelope("server_error", "Internal error; it has been logged."), status=500)
    from django.views.defaults import server_error

    return server_error(request)


def validated(serializer_class, request, **kwargs) -> Any:
    """Validate request.data (which must be a JSON object) and return the validated data."""
    if not isinstance(request.data, dict):
        raise DomainError("The body must be a JSON object.", fields={"body": "Expected a JSON object."})
    serializer = serializer_class(data=request.data, context={"request": request}, **kwargs)
    serializer.is_valid(raise_exception=True)
    # A write takes only what it names: a body naming a field the endpoint does not know (a typo, "max_node",
    # or one it never takes, "is_staff" on a new user) is refused by name, not answered 200/201 with that
    # field dropped and the caller believing it applied.
    unknown = sorted(set(request.data) - set(serializer.fields))
    if unknown:
        known = ", ".join(name for name, f in serializer.fields.items() if not f.read_only)
        why = f"Unknown field; this {'change' if kwargs.get('partial') else 'request'} takes {known}."
        raise DomainError(f"{unknown[0]}: {why}", fields={name: why for name in unknown})
    return serializer.validated_data


def no_body(request) -> None:
    """Refuse a body on an action that takes none (cancel, teardown, retry): none, or an empty JSON object, is
    all it takes. One that does not parse, comes in another media type, or names a field is a 400 as on every
    other write, not ignored while the action goes ahead (the caller's "reason" dropped without a word)."""
    data = request.data  # parsed here, whatever was sent: malformed JSON, another media type ⇒ 400
    if not isinstance(data, dict):
        raise DomainError("The body must be a JSON object (or left out).", fields={"body": "Expected a JSON object."})
    if data:
        why = "Unknown field; this action takes no body."
        names = sorted(data)
        raise DomainError(f"{names[0]}: {why}", fields={name: why for name in names})


def known_query(request, names) -> None:
    """Refuse a query parameter the read does not take (names, and ?format=): a typo (?statu=cancelled) or a
    filter it does not have (?pool= on the node list) is malformed input, a 400 naming it, not ignored while
    the whole list is answered as though it were filtered."""
    from rest_framework.settings import api_settings

    allowed = set(names) | {api_settings.URL_FORMAT_OVERRIDE}
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        takes = ", ".join(sorted(set(names))) or "none but page and page_size"
        why = f"Unknown query parameter; this read takes {takes}."
        raise drf.ValidationError({name: why for name in unknown})
