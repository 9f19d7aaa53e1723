"""Pools, nodes, reservations, availability (DESIGN §6). Views parse, call a service, serialise."""

from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Prefetch, Q
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import KnownQuery, no_body, validated
from portal.core.exceptions import InvalidInput, PermissionDenied
from portal.core.fields import AwareDateTimeField
from portal.core.instrument import timed_booking
from portal.core.permissions import StaffWritePermission
from tenants.models import Tenant

from .. import selectors, services
from ..choices import HOLDING_STATUSES, NodeState
from ..models import Allocation, Node, Pool
from ..timeutil import slot_floor
from . import serializers as s
from .fastpath import booking_body


class PoolViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [StaffWritePermission]
    serializer_class = s.PoolSerializer
    lookup_field = "name"

    def get_queryset(self):
        return Pool.objects.annotate(
            total_nodes=Count("nodes", filter=~Q(nodes__state=NodeState.RETIRED))
        ).order_by("name")

    @extend_schema(request=s.PoolInputSerializer, responses={201: s.PoolSerializer})
    def create(self, request):
        pool = services.pool_create(actor=request.user, **validated(s.PoolInputSerializer, request))
        pool.total_nodes = 0
        return Response(s.PoolSerializer(pool).data, status=status.HTTP_201_CREATED)


class NodeViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [StaffWritePermission]
    serializer_class = s.NodeSerializer
    filterset_fields = ["state"]

    def get_queryset(self):
        qs = Node.objects.select_related("pool")
        user = self.request.user
        if user.is_staff:
            return qs
        # Tenant users see only nodes their tenant holds (now or in a future booking).
        held = Allocation.objects.for_user(user).filter(
            active=True, reservation__status__in=HOLDING_STATUSES
        ).values("node_id")
        return qs.filter(pk__in=held)

    @extend_schema(request=s.NodeInputSerializer, responses={201: s.NodeSerializer})
    def create(self, request):
        node = services.node_create(actor=request.user, **validated(s.NodeInputSerializer, request))
        return Response(self.get_serializer(node).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.NodeUpdateSerializer, responses={200: s.NodeSerializer})
    def partial_update(self, request, pk=None):
        node = self.get_object()
        data = validated(s.NodeUpdateSerializer, request, partial=True)
        node = services.node_update(actor=request.user, node=node, state=data.get("state"),
                                    reason=data.get("state_reason"))
        return Response(self.get_serializer(node).data)


# The list's filters (not the detail routes'), documented from the serializer that checks them.
@extend_schema_view(list=extend_schema(parameters=[s.ReservationFilterSerializer]))
class ReservationViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [IsAuthenticated]
    serializer_class = s.ReservationSerializer
    filter_backends = []
    filter_params = ("status", "pool", "start", "end")

    def get_queryset(self):
        active = Prefetch(
            "allocations",
            queryset=Allocation.objects.filter(active=True).select_related("node"),
            to_attr="active_allocations",
        )
        qs = selectors.reservations_for_user(user=self.request.user).prefetch_related(active)
        if self.action == "list":
            params = self.request.query_params
            f = s.ReservationFilterSerializer(data={k: params[k] for k in self.filter_params if k in params})
            f.is_valid(raise_exception=True)
            data = f.validated_data
            if "status" in data:
                qs = qs.filter(status=data["status"])
            if "pool" in data:
                qs = qs.filter(pool=data["pool"])
            qs = qs.meeting(start=data.get("start"), end=data.get("end"))
        return qs

    def dispatch(self, request, *args, **kwargs):
        # A booking is timed and counted around the whole dispatch, so the refusals DRF makes before
        # create() runs (authentication, throttling) and unparsable bodies count under the code sent.
        if self.action_map.get(request.method.lower()) != "create":
            return super().dispatch(request, *args, **kwargs)
        with timed_booking() as booking:
            response = super().dispatch(request, *args, **kwargs)
            booking.answered(response, replayed=getattr(self, "replayed", False))
        return response

    @extend_schema(request=s.ReservationCreateSerializer, responses={201: s.ReservationSerializer},
                   parameters=[OpenApiParameter(
                       "Idempotency-Key", {"type": "string", "minLength": 1, "maxLength": 255}, OpenApiParameter.HEADER,
                       description="Repeat a booking safely: the same key (each user's own) with the same body "
                                   "answers the original reservation instead of booking twice; with a different "
                                   "body, 400.")])
    def create(self, request):
        # A plainly valid body is read without the serializer's field machinery (the same validated data);
        # anything else is judged, and refused, by the serializer as it always was.
        data = booking_body(request.data, request.user)
        if data is None:
            data = validated(s.ReservationCreateSerializer, request)
        cluster = data.get("cluster") or {}
        key = request.headers.get("Idempotency-Key")
        reservation = services.reservation_create(
            actor=request.user,
            tenant=data["tenant"],
            pool=data["pool"],
            node_count=data["node_count"],
            start=data["start"],
            end=data["end"],
            name=data.get("name", ""),
            orchestrator=cluster.get("orchestrator", "slurm"),
            cuda_version=cluster.get("cuda_version", "12.8"),
            idempotency_key=key,
            request_hash=services.request_fingerprint(request.data) if key else "",
        )
        if hasattr(reservation, "node_hostnames"):  # just booked: everything needed is in hand
            return Response(self.get_serializer(reservation).data, status=status.HTTP_201_CREATED)
        self.replayed = True  # an Idempotency-Key's earlier booking, answered again
        return Response(self._out(reservation), status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ReservationUpdateSerializer, responses={200: s.ReservationSerializer})
    def partial_update(self, request, pk=None):
        reservation = self.get_object()
        data = validated(s.ReservationUpdateSerializer, request, partial=True)
        reservation = services.reservation_update(actor=request.user, reservation=reservation, **data)
        return Response(self._out(reservation))

    @extend_schema(request=None, responses={200: s.ReservationSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        reservation = self.get_object()
        no_body(request)
        reservation = services.reservation_cancel(actor=request.user, reservation=reservation)
        return Response(self._out(reservation))

    def _out(self, reservation):
        fresh = self.get_queryset().get(pk=reservation.pk)
        return self.get_serializer(fresh).data


class AvailabilityApi(KnownQuery, APIView):
    permission_classes = [IsAuthenticated]
    query_serializer = s.AvailabilityQuerySerializer

    @extend_schema(parameters=[s.AvailabilityQuerySerializer], responses={200: s.AvailabilitySerializer})
    def get(self, request):
        q = s.AvailabilityQuerySerializer(data=request.query_params.dict())
        q.is_valid(raise_exception=True)
        pool = q.validated_data["pool"]
        slot = timedelta(minutes=pool.slot_minutes)
        start = q.validated_data.get("start") or slot_floor(timezone.now(), pool.slot_minutes)
        step = timedelta(seconds=q.validated_data.get("step") or slot.total_seconds())
        # A week by default, or as many steps as a request may hold (a week of 1-minute slots is 10,080).
        end = q.validated_data.get("end") or start + min(timedelta(days=7),
                                                         step * settings.PORTAL_AVAILABILITY_MAX_SLOTS)
        errors = {}
        if step % slot:
            errors["step"] = f"Must be a multiple of the pool's slot ({int(slot.total_seconds())} s)."
        if end <= start:
            errors["end"] = "Must be after start."
        elif (end - start) / step > settings.PORTAL_AVAILABILITY_MAX_SLOTS:
            errors["step"] = f"At most {settings.PORTAL_AVAILABILITY_MAX_SLOTS} slots a request; widen the step."
        if errors:
            raise InvalidInput(next(f"{k}: {v}" for k, v in errors.items()), fields=errors)
        slots = selectors.availability(pool=pool, start=start, end=end, step=step)
        total = pool.nodes.exclude(state=NodeState.RETIRED).count()
        # The body AvailabilitySerializer documents, built directly: running its fields for every one
        # of up to 2,000 slots cost more than the query behind them (issue #7). Slots tile the window,
        # so each boundary is formatted once, the way AwareDateTimeField writes it.
        fmt = AwareDateTimeField().to_representation
        body, last_end, last_text = [], None, None
        for slot in slots:
            start_text = last_text if slot.start == last_end else fmt(slot.start)
            last_end, last_text = slot.end, fmt(slot.end)
            body.append({"start": start_text, "end": last_text, "free_nodes": slot.free_nodes})
        return Response({"pool": pool.name, "total_nodes": total, "slots": body})


class UsageApi(KnownQuery, APIView):
    """GPU-hours per tenant and pool in a UTC calendar month, committed vs burst, with the burst cost.

    Leads read the tenants they lead, staff every tenant; members and viewers are refused.
    Hours up to now are "used"; what reservations hold for the rest of the month is "ahead".
    Each booking is billed at the pool's on-demand rate and GPUs per node as they were when it was booked
    (an extension keeps them): a pool changed later gives the bookings made after it a line of their own.
    """

    permission_classes = [IsAuthenticated]
    query_serializer = s.UsageQuerySerializer

    @extend_schema(parameters=[s.UsageQuerySerializer], responses={200: s.UsageSerializer})
    def get(self, request):
        from ..usage import parse_month, usage_tenant_ids

        q = s.UsageQuerySerializer(data=request.query_params.dict())
        q.is_valid(raise_exception=True)
        month = parse_month(q.validated_data.get("month"))
        allowed = usage_tenant_ids(request.user)
        if allowed == []:
            raise PermissionDenied("Usage is for the tenant's leads and platform staff.")
        tenant_ids = allowed
        if "tenant" in q.validated_data:
            slug = q.validated_data["tenant"]
            scope = Tenant.objects.filter(slug=slug)
            if allowed is not None:
                scope = scope.filter(pk__in=allowed)
            tenant = scope.first()
            if tenant is None:
                raise InvalidInput(f"tenant: unknown tenant {slug!r}.", fields={"tenant": "Unknown tenant."})
            tenant_ids = [tenant.pk]
        lines = selectors.usage_for_period(start=month.start, end=month.end, tenant_ids=tenant_ids)
        body = {
            "month": str(month), "start": month.start, "end": month.end,
            "results": [{
                "tenant": line.tenant.slug, "pool": line.pool.name, "gpus_per_node": line.gpus_per_node,
                "on_demand_rate": line.rate, "committed_gpu_hours": line.committed_used,
                "burst_gpu_hours": line.burst_used, "burst_cost": line.burst_cost_used,
                "committed_gpu_hours_ahead": line.committed_ahead, "burst_gpu_hours_ahead": line.burst_ahead,
                "burst_cost_ahead": line.burst_cost_ahead,
            } for line in lines],
        }
        return Response(s.UsageSerializer(body).data)
