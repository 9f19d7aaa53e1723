"""Health-check API (DESIGN §6): tenants check their cluster's nodes and read their nodes' results.

- ``POST /api/v1/clusters/{id}/health-checks/`` (lead, member; staff) ``{"level": "quick",
  "nodes": ["h100-sxm-007"]?}`` → 202 ``{"cluster", "level", "checks": [...], "ids": [...]}``.
- ``GET /api/v1/health-checks/`` filters ``node`` (hostname), ``cluster`` (id), ``verdict``,
  ``level``, ``trigger``, ``status``; ``GET /api/v1/health-checks/{id}/`` adds the full report.

Another tenant's cluster is a 404; an unknown or foreign node or cluster in a filter is a 400
naming the field, exactly like an unknown one.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import KnownQuery, validated
from portal.core.exceptions import NotFound
from portal.core.fields import AwareDateTimeField, StrictCharField
from reservations.models import Node

from . import selectors, services
from .choices import CheckLevel, CheckStatus, CheckTrigger, RecommendedAction, Verdict

__all__ = ["ClusterHealthCheckCreateApi", "HealthCheckListApi", "HealthCheckDetailApi"]


class HealthCheckSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    node = serializers.CharField(source="node.hostname")
    pool = serializers.CharField(source="node.pool.name")
    reservation = serializers.IntegerField(source="reservation_id", allow_null=True)
    # Enums of the model's choices, as the list's filters document them (level: the values the request takes).
    level = serializers.ChoiceField(choices=CheckLevel.values)
    trigger = serializers.ChoiceField(choices=CheckTrigger.choices)
    status = serializers.ChoiceField(choices=CheckStatus.choices)
    verdict = serializers.ChoiceField(choices=Verdict.choices, allow_blank=True)  # blank until done
    recommended_action = serializers.ChoiceField(choices=RecommendedAction.choices, allow_blank=True)
    summary = serializers.CharField(allow_blank=True)
    requested_by = serializers.SerializerMethodField()
    created_at = AwareDateTimeField()
    started_at = AwareDateTimeField(allow_null=True)
    finished_at = AwareDateTimeField(allow_null=True)
    problems = serializers.ListField(child=serializers.DictField())
    gpus = serializers.ListField(source="gpu_results", child=serializers.DictField())

    def to_representation(self, instance):
        # Another team's processes never reach a tenant, whatever a stored report names (staff read them).
        return super().to_representation(selectors.check_as_seen_by(self.context["request"].user, instance))

    def get_requested_by(self, obj) -> str | None:
        """The requester's name: for staff, or when a teammate asked (bound to the team's booking).

        A check the platform team asked for, on the fleet or on a team's cluster, reads "platform"
        to tenants: staff usernames are not theirs to see.
        """
        user = self.context["request"].user
        if obj.requested_by is None:
            return None
        if user.is_staff or (obj.reservation_id is not None and not obj.requested_by.is_staff):
            return obj.requested_by.get_username()
        return "platform"


class HealthCheckDetailSerializer(HealthCheckSerializer):
    report = serializers.SerializerMethodField()

    def get_report(self, obj) -> dict[str, Any]:
        return {k: v for k, v in obj.report.items() if k != "problems"}


class RequestInputSerializer(serializers.Serializer):
    level = serializers.ChoiceField(choices=CheckLevel.values, required=False, default=CheckLevel.QUICK)
    nodes = serializers.ListField(
        child=StrictCharField(max_length=253), required=False, allow_empty=False, min_length=1, max_length=1000
    )


class RequestOutputSerializer(serializers.Serializer):
    cluster = serializers.IntegerField()
    level = serializers.CharField()
    ids = serializers.ListField(child=serializers.IntegerField())
    checks = HealthCheckSerializer(many=True)


class FilterSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=253, required=False)
    cluster = serializers.IntegerField(required=False, min_value=1)
    verdict = serializers.ChoiceField(choices=Verdict.values, required=False)
    level = serializers.ChoiceField(choices=CheckLevel.values, required=False)
    trigger = serializers.ChoiceField(choices=CheckTrigger.values, required=False)
    status = serializers.ChoiceField(choices=CheckStatus.values, required=False)


def _clusters_for(user):
    from provisioning.models import VirtualCluster  # the cluster app may load after this one

    return VirtualCluster.objects.for_user(user)


class ClusterHealthCheckCreateApi(KnownQuery, APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(request=RequestInputSerializer, responses={202: RequestOutputSerializer})
    def post(self, request, pk: int):
        """Check the nodes the cluster holds now (the tenant's leads and members)."""
        cluster = _clusters_for(request.user).filter(pk=pk).first()
        if cluster is None:
            raise NotFound("Not found.")
        data = validated(RequestInputSerializer, request)
        checks = services.cluster_health_checks_request(
            actor=request.user, cluster=cluster, level=data["level"], nodes=data.get("nodes")
        )
        checks = list(selectors.checks_for_user(request.user).filter(pk__in=[c.pk for c in checks]).order_by(
            "node__hostname"))
        body = {"cluster": cluster.pk, "level": data["level"], "ids": [c.pk for c in checks], "checks": checks}
        return Response(RequestOutputSerializer(body, context={"request": request}).data,
                        status=status.HTTP_202_ACCEPTED)


@extend_schema(parameters=[FilterSerializer])
class HealthCheckListApi(KnownQuery, generics.ListAPIView):
    permission_classes = [IsAuthenticated]
    serializer_class = HealthCheckSerializer
    filter_backends: list = []
    filter_params = ("node", "cluster", "verdict", "level", "trigger", "status")  # FilterSerializer's

    def get_queryset(self):
        user = self.request.user
        qs = selectors.checks_for_user(user)
        params = self.request.query_params
        f = FilterSerializer(data={k: params[k] for k in FilterSerializer().fields if k in params})
        f.is_valid(raise_exception=True)
        data = f.validated_data
        if "node" in data:
            nodes = Node.objects.filter(hostname__iexact=data["node"])  # one host in DNS terms, as node_create
            visible = selectors.visible_node_ids(user)
            if visible is not None:
                nodes = nodes.filter(pk__in=visible)
            node = nodes.first()
            if node is None:
                raise serializers.ValidationError({"node": f"Unknown node {data['node']}."})
            qs = qs.filter(node=node)
        if "cluster" in data:
            cluster = _clusters_for(user).select_related("reservation").filter(pk=data["cluster"]).first()
            if cluster is None:
                raise serializers.ValidationError({"cluster": f"Unknown cluster {data['cluster']}."})
            qs = qs.filter(selectors.cluster_checks_q(cluster.reservation))
        for key in ("verdict", "level", "trigger", "status"):
            if key in data:
                qs = qs.filter(**{key: data[key]})
        return qs.order_by("-created_at", "-pk")


class HealthCheckDetailApi(KnownQuery, generics.RetrieveAPIView):
    permission_classes = [IsAuthenticated]
    serializer_class = HealthCheckDetailSerializer

    def get_queryset(self):
        return selectors.checks_for_user(self.request.user)
