"""DRF plug-ins named in settings (kept apart from views so importing them never cycles)."""

import io

from django.conf import settings
from rest_framework import exceptions, negotiation, pagination, parsers

from .throttle import RedisRateThrottle

__all__ = ["ContentNegotiation", "JSONParser", "Pagination", "UserThrottle", "AnonThrottle"]

MAX_JSON_DEPTH = 32  # the deepest body the API takes is three levels (a reservation's cluster spec)


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, refusing bodies nested deeper than MAX_JSON_DEPTH as malformed (a 400).

    Python's JSON decoder and encoder recurse: a body of a few kilobytes of brackets raised
    RecursionError (a 500) while parsing, and one nested just short of that got through and raised
    it later, where the body is serialised again (the Idempotency-Key's fingerprint).
    """

    def parse(self, stream, media_type=None, parser_context=None):
        # Django's DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB) applies only where DRF hands a parser request.body (and
        # is answered by portal.core.api.exception_handler); this bound holds whatever stream DRF passes:
        # without it a signed-in client could make a worker parse (and hold) gigabytes.
        limit = settings.PORTAL_API_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise exceptions.ParseError(f"JSON parse error - the body is larger than {limit} bytes")
        try:
            data = super().parse(io.BytesIO(raw), media_type, parser_context)
        except RecursionError as exc:
            raise exceptions.ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels") from exc
        pending = [(data, 1)]
        while pending:  # iteratively: the check must not recurse either
            value, depth = pending.pop()
            children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
            for child in children:
                if isinstance(child, dict | list):
                    if depth >= MAX_JSON_DEPTH:
                        raise exceptions.ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
                    pending.append((child, depth + 1))
        return data


class ContentNegotiation(negotiation.DefaultContentNegotiation):
    """DRF's negotiation, answering a ?format= (or format suffix) no renderer has with 400 invalid naming
    the field: DRF raised Http404, and DESIGN §6 keeps 404 for unknown objects (the caller's own
    reservation read as not found)."""

    def filter_renderers(self, renderers, format):
        matching = [renderer for renderer in renderers if renderer.format == format]
        if not matching:
            known = ", ".join(sorted({renderer.format for renderer in renderers}))
            raise exceptions.ValidationError({self.settings.URL_FORMAT_OVERRIDE or "format": f"One of: {known}."})
        return matching


def _whole_number(text: str) -> int:
    """text as a whole number if it is ASCII digits only, else 0: int() also reads "1_0", " 1", "+1" and other
    scripts' digits, none of them a page number in the API's terms."""
    return int(text) if text.isascii() and text.isdigit() else 0


class Pagination(pagination.PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset, request, view=None):
        # DRF answers a page number that is no number, or below 1, with 404, and ignores a page_size that
        # is no number (the default page) or cuts one over the maximum down to it; DESIGN §6 keeps 404 for
        # unknown objects (and, as the schema says, a page past the end) and answers malformed or
        # out-of-range input with 400 invalid naming the field.
        # A parameter the list does not take was refused before the view ran (portal.core.api.KnownQuery).
        page = request.query_params.get(self.page_query_param)
        if page is not None and page not in self.last_page_strings and _whole_number(page) < 1:
            raise exceptions.ValidationError({self.page_query_param: "A whole number, 1 or more."})
        size = request.query_params.get(self.page_size_query_param)
        if size is not None and not 1 <= _whole_number(size) <= self.max_page_size:
            raise exceptions.ValidationError(
                {self.page_size_query_param: f"A whole number from 1 to {self.max_page_size}."})
        return super().paginate_queryset(queryset, request, view)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1}
            elif parameter["name"] == self.page_size_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1, "maximum": self.max_page_size}
        return parameters


class UserThrottle(RedisRateThrottle):
    """PORTAL_THROTTLE_USER per signed-in user (token or session), across every web process."""

    scope = "user"
    setting_name = "PORTAL_THROTTLE_USER"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        return str(user.pk) if user is not None and user.is_authenticated else None


class AnonThrottle(RedisRateThrottle):
    """PORTAL_THROTTLE_ANON per client address for requests without credentials."""

    scope = "anon"
    setting_name = "PORTAL_THROTTLE_ANON"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return None
        return self.get_ident(request)
