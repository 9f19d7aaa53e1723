from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.core.actors import actor_name
from portal.core.fields import (
    AwareDateTimeField,
    ScopedSlugRelatedField,
    StrictCharField,
    StrictIntegerField,
    StrictRegexField,
    StrictSlugRelatedField,
)
from portal.core.timefmt import format_utc
from tenants.models import Tenant

from ..choices import CUDA_VERSIONS, DEFAULT_CUDA_VERSION, NodeState, Orchestrator, ReservationStatus
from ..models import Node, Pool, Reservation
from ..selectors import node_state_reason_as_seen_by, pools_for_booking
from ..services import HOSTNAME_PATTERN


class PoolSerializer(serializers.ModelSerializer):
    total_nodes = serializers.IntegerField(read_only=True, required=False)

    class Meta:
        model = Pool
        fields = ["name", "gpu_model", "gpus_per_node", "slot_minutes", "on_demand_rate", "total_nodes"]


class PoolInputSerializer(serializers.Serializer):
    name = StrictRegexField(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$", max_length=50)
    gpu_model = StrictCharField(max_length=100)
    gpus_per_node = StrictIntegerField(min_value=1, max_value=64)
    slot_minutes = StrictIntegerField(min_value=1, max_value=1440, required=False, default=60, help_text=(
        "Length of the pool's booking slot in minutes; must divide 1440 (the slots tile a day), e.g. 15, 30 "
        "or 60."))
    on_demand_rate = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0, required=False,
                                              default=0)


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Node
        fields = ["id", "hostname", "pool", "state", "state_reason", "gpus"]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        # A reason stored before health reasons stopped naming processes: shown to a tenant without them (staff
        # read it as stored). Without a request, as a tenant.
        request = self.context.get("request")
        data["state_reason"] = node_state_reason_as_seen_by(getattr(request, "user", None), instance)
        return data


class NodeInputSerializer(serializers.Serializer):
    hostname = StrictRegexField(HOSTNAME_PATTERN, max_length=253)
    pool = StrictSlugRelatedField(slug_field="name", queryset=Pool.objects.all())
    state = serializers.ChoiceField(choices=NodeState.choices, required=False, default=NodeState.AVAILABLE)


class NodeUpdateSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=NodeState.choices, required=False)
    state_reason = StrictCharField(max_length=255, required=False, allow_blank=True)


class ClusterSpecSerializer(serializers.Serializer):
    orchestrator = serializers.ChoiceField(choices=Orchestrator.choices, required=False, default=Orchestrator.SLURM)
    cuda_version = serializers.ChoiceField(choices=CUDA_VERSIONS, required=False, default=DEFAULT_CUDA_VERSION)

    def to_internal_value(self, data):
        # A key the spec does not take ({"orchestrater": "kubernetes"}) is refused by name, as one at the top
        # of the body is, not dropped while the default (Slurm) is booked. The rest of the spec is chosen on
        # the cluster (PATCH /clusters/{id}/) while it is pending.
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                why = ("Unknown field; a booking's cluster takes orchestrator and cuda_version (the rest of the "
                       "spec is chosen on the cluster, PATCH /api/v1/clusters/{id}/, while it is pending).")
                raise serializers.ValidationError({name: why for name in unknown})
        return super().to_internal_value(data)


def _bookable_tenants(user):
    # The caller's role comes along, so the booking service need not ask for it again.
    if user is None or not user.is_authenticated:
        return Tenant.objects.none()
    return Tenant.objects.for_user(user).with_role_of(user)


def _bookable_pools(user):
    # Every pool is bookable by every tenant (quotas decide how much); the scope takes the user
    # all the same, as ScopedSlugRelatedField's scopes do.
    return pools_for_booking()


class ReservationCreateSerializer(serializers.Serializer):
    tenant = ScopedSlugRelatedField(slug_field="slug", noun="tenant", scope=_bookable_tenants, required=False)
    pool = ScopedSlugRelatedField(slug_field="name", noun="pool", scope=_bookable_pools, per_user=False)
    node_count = StrictIntegerField(min_value=1, max_value=100_000)
    start = AwareDateTimeField()
    end = AwareDateTimeField()
    name = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    cluster = ClusterSpecSerializer(required=False)

    def validate(self, attrs):
        if "tenant" not in attrs:
            user = self.context["request"].user
            candidates = [] if user.is_staff else list(_bookable_tenants(user)[:2])
            if len(candidates) != 1:
                raise serializers.ValidationError({"tenant": "Name the tenant to book for (its slug)."})
            attrs["tenant"] = candidates[0]
        return attrs


class ReservationUpdateSerializer(serializers.Serializer):
    start = AwareDateTimeField(required=False)
    end = AwareDateTimeField(required=False)
    name = StrictCharField(max_length=200, required=False, allow_blank=True)

    # What a booking fixes once made: a PATCH naming one of these is refused, not half applied
    # (PATCH {"end": …, "node_count": 8} would otherwise extend and silently keep the count).
    FIXED = {
        "node_count": "Cannot be changed; book the extra nodes as another reservation.",
        "pool": "Cannot be changed; book in the other pool and cancel this one.",
        "tenant": "Cannot be changed.",
        "status": "Cannot be set; POST to the reservation's cancel/ to cancel it.",
        "cluster": "Cannot be changed once booked.",
    }

    def validate(self, attrs):
        refused = {name: why for name, why in self.FIXED.items() if name in self.initial_data}
        # A field this PATCH does not know (a typo: "node_cont", "nmae") is refused by name too, as the
        # cluster spec PATCH refuses one, rather than dropped while the rest applies and 200 answered.
        refused.update({name: "Unknown field; only end, start and name can be changed."
                        for name in sorted(set(self.initial_data) - set(self.fields) - set(self.FIXED))})
        if refused:
            raise serializers.ValidationError(refused)
        if not attrs:
            raise serializers.ValidationError({"end": "Give end, start or name to change."})
        return attrs


class ReservationClusterSerializer(serializers.Serializer):
    """A reservation's cluster spec as answered (the schema's shape for ReservationSerializer.cluster). The
    CUDA version is the one booked, a string: the versions offered for new bookings may change since."""

    orchestrator = serializers.ChoiceField(choices=Orchestrator.choices)
    cuda_version = serializers.CharField()


class ActorField(serializers.SlugRelatedField):
    """A user by username, as the requesting user may see it (portal.core.actors): a platform staff
    account reads "platform" to a tenant; null once the account is deleted (the foreign key is SET_NULL)."""

    def __init__(self, **kwargs):
        super().__init__(slug_field="username", read_only=True, allow_null=True, **kwargs)

    def to_representation(self, obj):
        request = self.context.get("request")
        return actor_name(obj, viewer=getattr(request, "user", None))


class ReservationSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    start = AwareDateTimeField(source="period.lower", read_only=True)
    end = AwareDateTimeField(source="period.upper", read_only=True)
    nodes = serializers.SerializerMethodField()
    cluster = serializers.SerializerMethodField()
    created_by = ActorField(help_text='Who booked it: a username; "platform" to a tenant when platform staff '
                                      "booked it for them; null once that account is deleted.")
    created_at = AwareDateTimeField(read_only=True)

    class Meta:
        model = Reservation
        fields = ["id", "tenant", "pool", "node_count", "start", "end", "status", "status_reason", "billing",
                  "nodes", "missing_nodes", "name", "cluster", "created_by", "created_at"]

    def to_representation(self, instance):
        # The body the fields above declare (and the schema documents), built directly: every booking
        # answers one, and building and running fifteen DRF fields for it cost more than half a
        # millisecond of the request (issue #2). tests/test_reservation_output.py holds this to the
        # fields' own rendering (ModelSerializer.to_representation) for every shape a reservation takes.
        created_by = instance.created_by
        period = instance.period
        return {
            "id": instance.pk,
            "tenant": instance.tenant.slug,
            "pool": instance.pool.name,
            "node_count": int(instance.node_count),
            "start": None if period.lower is None else format_utc(period.lower),
            "end": None if period.upper is None else format_utc(period.upper),
            "status": str(instance.status),
            "status_reason": str(instance.status_reason),
            "billing": str(instance.billing),
            "nodes": self.get_nodes(instance),
            "missing_nodes": int(instance.missing_nodes),
            "name": str(instance.name),
            "cluster": self.get_cluster(instance),
            "created_by": actor_name(created_by, viewer=self._viewer()),
            "created_at": None if instance.created_at is None else format_utc(instance.created_at),
        }

    def _viewer(self):
        return getattr(self.context.get("request"), "user", None)

    def get_nodes(self, obj) -> list[str]:
        # Fresh bookings carry their hostnames; lists use the prefetched active allocations.
        if hasattr(obj, "node_hostnames"):
            return obj.node_hostnames
        return sorted(a.node.hostname for a in obj.active_allocations)

    @extend_schema_field(ReservationClusterSerializer)
    def get_cluster(self, obj) -> dict:
        return {"orchestrator": obj.orchestrator, "cuda_version": obj.cuda_version}


class ReservationFilterSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=ReservationStatus.choices, required=False)
    # An unknown name is a 400 naming it (as the availability read answers), not an empty list that a script
    # takes for a pool with no reservations.
    pool = StrictSlugRelatedField(slug_field="name", queryset=Pool.objects.all(), required=False,
                                  help_text="The pool's name.")
    start = AwareDateTimeField(required=False)
    end = AwareDateTimeField(required=False)


class AvailabilityQuerySerializer(serializers.Serializer):
    pool = StrictSlugRelatedField(slug_field="name", queryset=Pool.objects.all(), help_text="The pool's name.")
    start = AwareDateTimeField(required=False, help_text="With a UTC offset. Default: the pool's slot running now.")
    end = AwareDateTimeField(required=False, help_text=(
        "With a UTC offset; after start. Default: a week after start, or as many steps as one request may hold "
        "if that is less."))
    step = serializers.IntegerField(required=False, min_value=60, max_value=366 * 24 * 3600, help_text=(
        "Length of each slot of the answer, in seconds: a multiple of the pool's slot (slot_minutes × 60). "
        f"Default: the pool's slot. At most {settings.PORTAL_AVAILABILITY_MAX_SLOTS:,} slots a request "
        "((end − start) / step); widen the step for a longer window."))


class SlotSerializer(serializers.Serializer):
    start = AwareDateTimeField()
    end = AwareDateTimeField()
    free_nodes = serializers.IntegerField()


class AvailabilitySerializer(serializers.Serializer):
    pool = serializers.CharField()
    total_nodes = serializers.IntegerField()
    slots = SlotSerializer(many=True)


class UsageQuerySerializer(serializers.Serializer):
    month = serializers.RegexField(r"^\d{4}-\d{2}$", required=False,
                                   help_text="A UTC calendar month, YYYY-MM; the current one when left out.")
    tenant = serializers.SlugField(required=False, help_text="Only this tenant (one you lead; staff: any).")


class UsageLineSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    pool = serializers.CharField()
    gpus_per_node = serializers.IntegerField()
    on_demand_rate = serializers.DecimalField(max_digits=10, decimal_places=4, coerce_to_string=True)
    committed_gpu_hours = serializers.DecimalField(max_digits=14, decimal_places=2, coerce_to_string=True)
    burst_gpu_hours = serializers.DecimalField(max_digits=14, decimal_places=2, coerce_to_string=True)
    burst_cost = serializers.DecimalField(max_digits=16, decimal_places=2, coerce_to_string=True)
    committed_gpu_hours_ahead = serializers.DecimalField(max_digits=14, decimal_places=2, coerce_to_string=True)
    burst_gpu_hours_ahead = serializers.DecimalField(max_digits=14, decimal_places=2, coerce_to_string=True)
    burst_cost_ahead = serializers.DecimalField(max_digits=16, decimal_places=2, coerce_to_string=True)


class UsageSerializer(serializers.Serializer):
    month = serializers.CharField()
    start = AwareDateTimeField()
    end = AwareDateTimeField()
    results = UsageLineSerializer(many=True)
