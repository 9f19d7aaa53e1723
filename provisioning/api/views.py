"""Cluster API (DESIGN §6): own tenant's clusters, staff all; another tenant's id is a 404."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from portal.core.api import KnownQuery, no_body, validated
from portal.core.exceptions import NotFound

from .. import selectors, services
from ..choices import CredentialKind, TransitionSource
from . import serializers as s


# The list's filters (not the detail routes'), documented from the serializer that checks them.
@extend_schema_view(list=extend_schema(parameters=[s.ClusterFilterSerializer]))
class ClusterViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [IsAuthenticated]
    serializer_class = s.ClusterSerializer
    filter_backends: list = []
    filter_params = ("status", "reservation")

    def get_queryset(self):
        qs = selectors.clusters_for_user(user=self.request.user)
        if self.action == "list":
            params = self.request.query_params
            f = s.ClusterFilterSerializer(data={k: params[k] for k in self.filter_params if k in params})
            f.is_valid(raise_exception=True)
            if "status" in f.validated_data:
                qs = qs.filter(status=f.validated_data["status"])
            if "reservation" in f.validated_data:
                qs = qs.filter(reservation_id=f.validated_data["reservation"])
        return qs

    def _out(self, cluster):
        fresh = selectors.clusters_for_user(user=self.request.user).get(pk=cluster.pk)
        return Response(self.get_serializer(fresh).data)

    @extend_schema(request=s.ClusterSpecInputSerializer, responses={200: s.ClusterSerializer})
    def partial_update(self, request, pk=None):
        """Choose the spec à la carte while the cluster is pending (lead, or the member who booked it)."""
        data = validated(s.ClusterSpecInputSerializer, request, partial=True)
        cluster = services.cluster_configure(actor=request.user, cluster=self.get_object(), **data)
        return self._out(cluster)

    @extend_schema(request=None, responses={200: s.ClusterSerializer})
    @action(detail=True, methods=["post"])
    def teardown(self, request, pk=None):
        """Tear the cluster down now; the reservation completes."""
        cluster = self.get_object()
        no_body(request)
        cluster = services.cluster_request_teardown(actor=request.user, cluster=cluster)
        return self._out(cluster)

    @extend_schema(request=None, responses={200: s.ClusterSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """Retry a failed cluster (staff)."""
        cluster = self.get_object()
        no_body(request)
        cluster = services.cluster_retry(actor=request.user, cluster=cluster, source=TransitionSource.API)
        return self._out(cluster)

    @extend_schema(
        parameters=[OpenApiParameter("kind", str, OpenApiParameter.PATH, enum=CredentialKind.values)],
        responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY)},
    )
    @action(detail=True, methods=["get"], url_path=r"credentials/(?P<kind>[a-z_]+)", url_name="credential")
    def credential(self, request, pk=None, kind=None):
        """Download a credential (the tenant's leads and members only)."""
        if kind not in CredentialKind.values:
            raise NotFound("Unknown credential kind.")
        filename, data = services.credential_download(actor=request.user, cluster=self.get_object(), kind=kind,
                                                      record=request.method != "HEAD")
        response = HttpResponse(data, content_type="application/octet-stream")
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        response["Cache-Control"] = "no-store"
        return response
