from django.urls import path

from . import api

urlpatterns: list = [
    path("clusters/<int:pk>/health-checks/", api.ClusterHealthCheckCreateApi.as_view(), name="cluster-health-checks"),
    path("health-checks/", api.HealthCheckListApi.as_view(), name="health-check-list"),
    path("health-checks/<int:pk>/", api.HealthCheckDetailApi.as_view(), name="health-check-detail"),
]
