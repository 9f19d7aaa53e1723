"""OpenAPI: how the API's Bearer tokens appear in /api/schema/ (and Swagger UI's Authorize button)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        # Tokens are opaque (issued by `manage.py issue_token`, stored hashed), not JWTs.
        return build_bearer_security_scheme_object(header_name="HTTP_AUTHORIZATION", token_prefix="Bearer",
                                                   bearer_format="opaque")
