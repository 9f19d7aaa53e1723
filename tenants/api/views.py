"""Tenants, users, memberships, quotas (DESIGN §6). Views parse, call a service, serialise."""

from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import KnownQuery
from portal.core.api import validated as _valid
from portal.core.permissions import StaffOnlyPermission, StaffWritePermission

from .. import services
from ..choices import Role
from ..models import Membership, Quota, Tenant
from . import serializers as s


class TenantViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [StaffWritePermission]
    serializer_class = s.TenantOutputSerializer
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return Tenant.objects.for_user(self.request.user)

    @extend_schema(request=s.TenantInputSerializer, responses={201: s.TenantOutputSerializer})
    def create(self, request):
        data = _valid(s.TenantInputSerializer, request)
        tenant = services.tenant_create(actor=request.user, **data)
        return Response(s.TenantOutputSerializer(tenant).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.TenantInputSerializer, responses={200: s.TenantOutputSerializer})
    def partial_update(self, request, slug=None):
        tenant = self.get_object()
        data = _valid(s.TenantInputSerializer, request, partial=True)
        tenant = services.tenant_update(actor=request.user, tenant=tenant, **data)
        return Response(s.TenantOutputSerializer(tenant).data)


class UserCreateApi(KnownQuery, APIView):
    permission_classes = [StaffOnlyPermission]

    @extend_schema(request=s.UserInputSerializer, responses={201: s.UserOutputSerializer})
    def post(self, request):
        data = _valid(s.UserInputSerializer, request)
        user = services.user_create(actor=request.user, **data)
        return Response({"id": user.pk, "username": user.username}, status=status.HTTP_201_CREATED)


class MembershipViewSet(KnownQuery, mixins.ListModelMixin, viewsets.GenericViewSet):
    permission_classes = [IsAuthenticated]
    serializer_class = s.MembershipOutputSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the model, not a request
            return Membership.objects.none()
        qs = Membership.objects.select_related("tenant", "user")
        if self.request.user.is_staff:
            return qs
        # Leads see their tenants' memberships; members and viewers only their own.
        led = Membership.objects.filter(user=self.request.user, role=Role.LEAD).values("tenant_id")
        return qs.filter(Q(tenant_id__in=led) | Q(user=self.request.user))

    @extend_schema(request=s.MembershipInputSerializer, responses={201: s.MembershipOutputSerializer})
    def create(self, request):
        data = _valid(s.MembershipInputSerializer, request)
        # Staff or a lead of the tenant: the service decides, under the team lock.
        membership = services.membership_create(actor=request.user, tenant=data["tenant"], user=data["user"],
                                                role=data["role"])
        return Response(s.MembershipOutputSerializer(membership).data, status=status.HTTP_201_CREATED)


class QuotaViewSet(KnownQuery, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [StaffWritePermission]
    serializer_class = s.QuotaOutputSerializer

    def get_queryset(self):
        return Quota.objects.for_user(self.request.user).select_related("tenant", "pool")

    @extend_schema(request=s.QuotaCreateSerializer, responses={201: s.QuotaOutputSerializer})
    def create(self, request):
        data = _valid(s.QuotaCreateSerializer, request)
        quota = services.quota_create(actor=request.user, **data)
        return Response(s.QuotaOutputSerializer(quota).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.QuotaUpdateSerializer, responses={200: s.QuotaOutputSerializer})
    def partial_update(self, request, pk=None):
        quota = self.get_object()
        data = _valid(s.QuotaUpdateSerializer, request, partial=True)
        quota = services.quota_update(actor=request.user, quota=quota, **data)
        return Response(s.QuotaOutputSerializer(quota).data)
