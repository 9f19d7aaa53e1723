from django.urls import path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("pools", views.PoolViewSet, basename="pool")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("reservations", views.ReservationViewSet, basename="reservation")

urlpatterns = [
    path("availability/", views.AvailabilityApi.as_view(), name="availability"),
    path("usage/", views.UsageApi.as_view(), name="usage-api"),
    *router.urls,
]
