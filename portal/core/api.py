"""API primitives every app uses: the error envelope, pagination, throttles."""

from __future__ import annotations

import functools
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

__all__ = ["exception_handler", "envelope", "validated", "no_body", "known_query", "KnownQuery", "json_400", "json_404",
           "json_500"]


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
    """Refuse a query parameter the request does not take (names, and ?format=): a typo (?statu=cancelled), a
    filter the list does not have (?pool= on the node list) or a wish the route has no notion of
    (?dry_run=1 on a change, ?force=true on a cancel) is malformed input, a 400 naming it, not ignored while
    the request is answered, or carried out, as though it had been understood."""
    from rest_framework.settings import api_settings

    allowed = set(names) | {api_settings.URL_FORMAT_OVERRIDE}
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        takes = ", ".join(sorted(set(names))) or "none"
        why = f"Unknown query parameter; this request takes {takes}."
        raise drf.ValidationError({name: why for name in unknown})


@functools.cache
def _field_names(serializer_class) -> frozenset[str]:
    # Once per class: a serializer's fields are built (deep-copied) on each instance.
    return frozenset(serializer_class().fields)


class KnownQuery:
    """Mixed into every API view (before DRF's classes): the query parameters a request may carry are the ones
    its route documents, and any other is refused (known_query) before the handler runs, so a refused write
    changes nothing and a refused read reads nothing.

    A route takes
    - on a list (a viewset's "list" action, a ListAPIView's GET): the view's filter_params (or its
      django-filter filterset_fields) and the paginator's page and page size;
    - on any route: the fields of the view's query_serializer, where it has one (availability, usage);
    - and ?format= everywhere (DRF's format override; portal.core.drf.ContentNegotiation judges its value).
    Nothing else: a detail read, a change or an action takes no query parameter.
    """

    filter_params: tuple[str, ...] = ()
    query_serializer: Any = None

    def query_params_taken(self) -> set[str]:
        names = set(_field_names(self.query_serializer)) if self.query_serializer is not None else set()
        if self.is_list_request():
            names |= set(self.filter_params or getattr(self, "filterset_fields", None) or ())
            paginator = getattr(self, "paginator", None)
            if paginator is not None:
                names |= {paginator.page_query_param, paginator.page_size_query_param} - {None}
        return names

    def is_list_request(self) -> bool:
        from rest_framework.mixins import ListModelMixin

        if hasattr(self, "action_map"):  # a viewset: its router-mapped action names the route
            return getattr(self, "action", None) == "list"
        return isinstance(self, ListModelMixin) and self.request.method in ("GET", "HEAD")

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # authentication, permissions, throttles first: 401/403/429
        method = request.method.lower()
        if method not in self.http_method_names or not hasattr(self, method):
            return  # DRF answers 405 next: the method is judged before what it carries
        known_query(request, self.query_params_taken())
