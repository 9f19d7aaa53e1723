from django.urls import path

from . import views

urlpatterns = [
    path("clusters/", views.cluster_list, name="cluster-list-page"),
    path("clusters/<int:pk>/", views.cluster_detail, name="cluster-page"),
    path("clusters/<int:pk>/teardown/", views.cluster_teardown, name="cluster-page-teardown"),
    path("clusters/<int:pk>/retry/", views.cluster_retry, name="cluster-page-retry"),
    path("clusters/<int:pk>/credentials/<slug:kind>/", views.cluster_credential, name="cluster-page-credential"),
]
