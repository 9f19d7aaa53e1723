from django.urls import path

from . import views

urlpatterns: list = [
    path("health/", views.fleet_health, name="health-fleet"),
    path("health/sweep/", views.sweep_now, name="health-sweep"),
    path("health/nodes/<str:hostname>/", views.node_health, name="health-node"),
    path("health/nodes/<str:hostname>/check/", views.node_check, name="health-node-check"),
    path("health/nodes/<str:hostname>/repair/", views.node_repair_open, name="health-node-repair"),
    path("health/repairs/<int:pk>/", views.repair_detail, name="health-repair"),
    path("health/repairs/<int:pk>/step/", views.repair_step, name="health-repair-step"),
    path("health/checks/<int:pk>/", views.check_detail, name="health-check"),
    path("health/clusters/<int:pk>/", views.cluster_health, name="health-cluster"),
    path("health/clusters/<int:pk>/results/", views.cluster_health_results, name="health-cluster-results"),
    path("health/clusters/<int:pk>/run/", views.cluster_health_run, name="health-cluster-run"),
]
