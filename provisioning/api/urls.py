from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("clusters", views.ClusterViewSet, basename="cluster")

urlpatterns = router.urls
