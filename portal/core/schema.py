"""OpenAPI: scoped slug fields typed as their model's slug; non-negative decimals without a "-"; every field
a response always carries required; the error envelope on every operation."""

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.views import SpectacularAPIView
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer


class ScopedSlugRelatedFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "portal.core.fields.ScopedSlugRelatedField"

    def map_serializer_field(self, auto_schema, direction):
        # The scope of no user is empty but typed: its model names the slug's model field, which
        # drf-spectacular maps as it maps any SlugRelatedField with a queryset.
        model = self.target.scope(None).model
        stand_in = serializers.SlugRelatedField(slug_field=self.target.slug_field,
                                                queryset=model._default_manager.none())
        return auto_schema._map_serializer_field(stand_in, direction)


class NonNegativeDecimalFieldExtension(OpenApiSerializerFieldExtension):
    """A decimal whose minimum is 0 or more: drf-spectacular's string pattern admits a leading "-"
    (it knows only the digits), which the field then refuses; the pattern here does not."""

    target_class = "rest_framework.fields.DecimalField"

    def map_serializer_field(self, auto_schema, direction):
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        minimum = self.target.min_value
        if minimum is not None and minimum >= 0 and schema.get("pattern", "").startswith("^-?"):
            schema["pattern"] = "^" + schema["pattern"][len("^-?"):]
        return schema


def require_response_fields(result, generator, request, public):  # noqa: ARG001 - drf-spectacular's hook signature
    """Mark every property of a response body as required.

    The API's serializers write every field they declare, every time (null where it is nullable), but
    drf-spectacular leaves a field with a model default out of `required` (a node's state, a quota's
    burst_nodes, a list page's next), so a client generated from the schema would have to treat it
    as optional. Request bodies (the *Request components) keep what they declare.
    """
    for name, schema in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") or "properties" not in schema:
            continue
        schema["required"] = sorted(
            field for field, prop in schema["properties"].items() if not prop.get("writeOnly")
        )
    return result


_ERROR_CODES = ("invalid, not_authenticated, permission_denied, not_found, method_not_allowed, not_acceptable, "
                "capacity_unavailable, quota_exceeded, invalid_state, throttled, busy")
_ERRORS = {  # status: (description, when it applies to an operation)
    "400": ("Malformed or out-of-range input (`invalid`); `fields` names each bad field.", lambda m, path: True),
    "401": ("No or bad credentials (`not_authenticated`).", lambda m, path: True),
    "403": ("Signed in, but the role does not allow it (`permission_denied`).", lambda m, path: True),
    "404": ("Unknown or another tenant's object, or a page past the end of a list (`not_found`; never 403).",
            lambda m, path: "{" in path or m == "get"),
    "409": ("`capacity_unavailable` (with `suggestions`), `quota_exceeded` or `invalid_state`.",
            lambda m, path: m in ("post", "put", "patch", "delete")),
    "429": ("Rate limit (`throttled`), with `Retry-After`.", lambda m, path: True),
    "503": ("The write lost to concurrent ones more often than it is retried (`busy`), with `Retry-After`; "
            "nothing was written: send it again.", lambda m, path: m in ("post", "put", "patch", "delete")),
}

# The header a 429 and a 503 always carry (portal.core.api: the throttle's wait, rounded up to a whole second, at
# least 1; Busy.retry_after).
_RETRY_AFTER = {"description": "Seconds to wait before the next request.", "required": True,
                "schema": {"type": "integer", "minimum": 1}}


def add_error_responses(result, generator, request, public):  # noqa: ARG001 - drf-spectacular's hook signature
    """Document DESIGN §6's error envelope on every operation, for the statuses it can answer."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = {
        "type": "object",
        "description": "Every 4xx answer, and a 503 `busy` (DESIGN §6). A rejected write changes nothing.",
        "properties": {
            "code": {"type": "string", "description": f"One of: {_ERROR_CODES}."},
            "detail": {"type": "string"},
            "fields": {"type": "object", "additionalProperties": {"type": "string"},
                       "description": "Each bad field (dotted for nested ones) and what is wrong with it."},
            "suggestions": {"type": "array", "description": "With capacity_unavailable: windows of the same "
                            "length that fit.", "items": {"type": "object", "properties": {
                                "start": {"type": "string", "format": "date-time"},
                                "end": {"type": "string", "format": "date-time"}}}},
        },
        "required": ["code", "detail", "fields"],
    }
    reference = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, item in result.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            for status, (description, applies) in _ERRORS.items():
                if applies(method, path):
                    response = {"description": description, "content": reference}
                    if status in ("429", "503"):
                        response["headers"] = {"Retry-After": _RETRY_AFTER}
                    operation["responses"].setdefault(status, response)
    return result


class SchemaView(SpectacularAPIView):
    """drf-spectacular's schema view, answering its refusals (a ?format it has no renderer for, a 429 to a
    throttled client) as JSON with DESIGN §6's envelope: they were rendered by the schema's own renderer,
    YAML by default, typed as an OpenAPI document."""

    def handle_exception(self, exc):
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return response
