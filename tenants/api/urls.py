from django.urls import path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register("memberships", views.MembershipViewSet, basename="membership")
router.register("quotas", views.QuotaViewSet, basename="quota")

urlpatterns = [path("users/", views.UserCreateApi.as_view(), name="user-create"), *router.urls]
