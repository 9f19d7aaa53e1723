from csp.decorators import csp_update
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularRedocView, SpectacularSwaggerSplitView

from portal.core import views as core_views
from portal.core.schema import SchemaView
from tenants.views import portal_view

handler400 = "portal.core.api.json_400"
handler404 = "portal.core.api.json_404"
handler500 = "portal.core.api.json_500"

api_v1 = [
    path("", include("tenants.api.urls")),
    path("", include("reservations.api.urls")),
    path("", include("provisioning.api.urls")),
    path("", include("provisioning.health.api_urls")),
]

urlpatterns = [
    # The API first: Django tries patterns in order, and every "" include below would otherwise be
    # searched, pattern by pattern, before an API path matched (a measurable share of a request).
    path("api/v1/", include(api_v1)),
    path("admin/", admin.site.urls),
    path("", include("portal.ops.urls")),
    # The audit page is core's (it imports no app above it), dressed as a portal page here.
    path("audit/", portal_view(core_views.audit_log), name="audit-log"),
    path("", include("tenants.urls")),
    path("", include("reservations.urls")),
    path("", include("provisioning.urls")),
    path("", include("provisioning.health.urls")),
    path("notifications/", include("notifications.urls")),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    # Redoc runs its search in a Web Worker started from a blob: address; without worker-src the production
    # policy's script-src 'self' refuses it and the search box finds nothing. This page only.
    path("api/redoc/", csp_update({"worker-src": ["blob:"]})(SpectacularRedocView.as_view(url_name="schema")),
         name="api-redoc"),
]
