"""Cluster API shapes. Secrets never appear here: credentials are listed by kind and fingerprint only."""

from __future__ import annotations

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.core.fields import AwareDateTimeField, StrictCharField, StrictIntegerField
from reservations.choices import ReservationStatus

from ..choices import ClusterStatus
from ..models import ClusterCredential, ClusterTransition, VirtualCluster
from ..selectors import cluster_node_hostnames, credential_tenant_ids


class PhaseSerializer(serializers.ModelSerializer):
    # Plain strings in the schema: the phase names are documented once, as the cluster status (ClusterStatusEnum).
    phase = serializers.CharField()
    at = AwareDateTimeField()

    class Meta:
        model = ClusterTransition
        fields = ["phase", "at", "detail"]


class CredentialSerializer(serializers.ModelSerializer):
    created_at = AwareDateTimeField()
    download_url = serializers.SerializerMethodField()

    class Meta:
        model = ClusterCredential
        fields = ["kind", "fingerprint", "public_part", "created_at", "download_url"]

    def get_download_url(self, obj: ClusterCredential) -> str | None:
        """The download's address, for those the download takes (the tenant's leads and members); null for
        the others (a viewer, platform staff), who would only be refused there (403)."""
        if not self.context.get("can_download", False):
            return None
        return reverse("cluster-credential", kwargs={"pk": obj.cluster_id, "kind": obj.kind})


class SpecSerializer(serializers.Serializer):
    orchestrator = serializers.CharField()
    orchestrator_version = serializers.CharField()
    cuda_version = serializers.CharField()
    mig_profile = serializers.CharField(allow_blank=True)
    default_memory_per_gpu_gib = serializers.IntegerField()
    shared_storage_gib = serializers.IntegerField()


class StorageSerializer(serializers.Serializer):
    name = serializers.CharField()
    size_gib = serializers.IntegerField()
    status = serializers.CharField()
    mount_path = serializers.CharField()


# StorageSerializer's body, or null, written out: OpenAPI 3.0 applies nullable only beside a type, so the
# allOf-wrapped reference drf-spectacular makes of a nullable serializer refuses null in strict validators.
STORAGE_SCHEMA = {
    "type": "object", "nullable": True,
    "description": "The cluster's shared storage volume; null before it is attached.",
    "properties": {"name": {"type": "string"}, "size_gib": {"type": "integer"}, "status": {"type": "string"},
                   "mount_path": {"type": "string"}},
    "required": ["name", "size_gib", "status", "mount_path"],
}


class NetworkSerializer(serializers.Serializer):
    vlan_id = serializers.IntegerField(allow_null=True)
    cidr = serializers.CharField(allow_blank=True)


class ClusterSerializer(serializers.ModelSerializer):
    reservation = serializers.IntegerField(source="reservation_id")
    tenant = serializers.CharField(source="tenant.slug")
    pool = serializers.CharField(source="reservation.pool.name")
    name = serializers.CharField(source="reservation.name")
    start = AwareDateTimeField(source="reservation.start")
    end = AwareDateTimeField(source="reservation.end")
    reservation_status = serializers.ChoiceField(choices=ReservationStatus.choices, source="reservation.status")
    nodes = serializers.SerializerMethodField()
    spec = serializers.SerializerMethodField()
    phases = PhaseSerializer(source="transitions", many=True)
    network = serializers.SerializerMethodField()
    storage = serializers.SerializerMethodField()
    credentials = serializers.SerializerMethodField()
    phase_started_at = AwareDateTimeField()
    created_at = AwareDateTimeField()
    updated_at = AwareDateTimeField()

    class Meta:
        model = VirtualCluster
        fields = [
            "id", "reservation", "tenant", "pool", "name", "start", "end", "reservation_status", "status",
            "status_reason", "phase_started_at", "backend", "nodes", "spec", "phases", "connection", "network",
            "storage", "credentials", "created_at", "updated_at",
        ]

    def get_nodes(self, obj: VirtualCluster) -> list[str]:
        return cluster_node_hostnames(obj)

    @extend_schema_field(SpecSerializer)
    def get_spec(self, obj: VirtualCluster) -> dict:
        return SpecSerializer(obj).data

    @extend_schema_field(NetworkSerializer)
    def get_network(self, obj: VirtualCluster) -> dict:
        return NetworkSerializer(obj.tenant).data

    @extend_schema_field(STORAGE_SCHEMA)
    def get_storage(self, obj: VirtualCluster) -> dict | None:
        volume = getattr(obj, "volume", None)
        return StorageSerializer(volume).data if volume is not None else None

    @extend_schema_field(CredentialSerializer(many=True))
    def get_credentials(self, obj: VirtualCluster) -> list[dict]:
        current = getattr(obj, "current_credentials", None)
        if current is None:
            current = list(obj.credentials.current())
        return CredentialSerializer(current, many=True,
                                    context={"can_download": obj.tenant_id in self._credential_tenants()}).data

    def _credential_tenants(self) -> frozenset[int]:
        # Whose credentials the requesting user may download: read once per response, not once per cluster.
        if "credential_tenants" not in self.context:
            request = self.context.get("request")
            user = getattr(request, "user", None)
            self.context["credential_tenants"] = credential_tenant_ids(user=user) if user else frozenset()
        return self.context["credential_tenants"]


class ClusterSpecInputSerializer(serializers.Serializer):
    orchestrator_version = StrictCharField(max_length=16, required=False)
    cuda_version = StrictCharField(max_length=16, required=False)
    mig_profile = StrictCharField(max_length=16, required=False, allow_blank=True)
    default_memory_per_gpu_gib = StrictIntegerField(required=False, min_value=1)
    shared_storage_gib = StrictIntegerField(required=False, min_value=0)

    def validate(self, attrs: dict) -> dict:
        # What is not a spec field (the orchestrator, the pool, a typo) cannot be changed here: say so
        # (services.cluster_configure's rule) rather than drop it and answer 200 with nothing changed.
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({key: "Cannot be changed." for key in unknown})
        return attrs


class ClusterFilterSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=ClusterStatus.choices, required=False)
    reservation = serializers.IntegerField(required=False, min_value=1)  # a query string: digits in a string
