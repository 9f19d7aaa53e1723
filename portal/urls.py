from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerSplitView

handler404 = "portal.core.api.json_404"
handler500 = "portal.core.api.json_500"

api_v1 = [
    path("", include("tenants.api.urls")),
    path("", include("reservations.api.urls")),
    path("", include("provisioning.api.urls")),
    path("", include("provisioning.health.api_urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("portal.ops.urls")),
    path("", include("portal.core.urls")),
    path("", include("tenants.urls")),
    path("", include("reservations.urls")),
    path("", include("provisioning.urls")),
    path("", include("provisioning.health.urls")),
    path("notifications/", include("notifications.urls")),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
]
