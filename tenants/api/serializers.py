from django.contrib.auth import get_user_model
from rest_framework import serializers

from portal.core.egress import MAX_URL_LENGTH
from portal.core.fields import (
    AwareDateTimeField,
    ScopedSlugRelatedField,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    StrictRegexField,
    StrictSlugRelatedField,
)
from reservations.models import Pool

from ..choices import Role
from ..models import Membership, Quota, Tenant


class TenantOutputSerializer(serializers.ModelSerializer):
    created_at = AwareDateTimeField(read_only=True)

    class Meta:
        model = Tenant
        fields = ["slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr", "created_at"]


class TenantInputSerializer(serializers.Serializer):
    slug = StrictRegexField(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$", max_length=50)
    name = StrictCharField(max_length=120)
    burst_enabled = StrictBooleanField(required=False)  # no default: a PATCH would document one
    storage_quota_tib = StrictIntegerField(required=False, min_value=0, max_value=100000)
    vlan_id = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=4094)
    cidr = StrictCharField(required=False, allow_blank=True, max_length=43)
    slack_webhook_url = serializers.URLField(required=False, allow_blank=True, write_only=True,
                                              max_length=MAX_URL_LENGTH)  # what the egress check stores


class UserInputSerializer(serializers.Serializer):
    username = StrictRegexField(r"^[\w.@+-]+$", max_length=150)
    email = serializers.EmailField(required=False, allow_blank=True)
    password = StrictCharField(write_only=True, max_length=128, trim_whitespace=False)


class UserOutputSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()


def _membership_tenants(user):
    return Tenant.objects.for_user(user)


class MembershipInputSerializer(serializers.Serializer):
    tenant = ScopedSlugRelatedField(slug_field="slug", noun="tenant", scope=_membership_tenants)
    user = StrictSlugRelatedField(slug_field="username", queryset=get_user_model().objects.all())
    role = serializers.ChoiceField(choices=Role.choices)


class MembershipOutputSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)
    created_at = AwareDateTimeField(read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "tenant", "user", "role", "created_at"]


class QuotaOutputSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Quota
        fields = ["id", "tenant", "pool", "max_nodes", "burst_nodes", "max_duration_hours"]


class QuotaCreateSerializer(serializers.Serializer):
    tenant = StrictSlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())
    pool = StrictSlugRelatedField(slug_field="name", queryset=Pool.objects.all())
    max_nodes = StrictIntegerField(min_value=0, max_value=1_000_000)
    burst_nodes = StrictIntegerField(min_value=0, max_value=1_000_000, required=False, default=0)
    max_duration_hours = StrictIntegerField(min_value=1, max_value=24 * 366, required=False, allow_null=True,
                                            default=None)


class QuotaUpdateSerializer(serializers.Serializer):
    max_nodes = StrictIntegerField(min_value=0, max_value=1_000_000, required=False)
    burst_nodes = StrictIntegerField(min_value=0, max_value=1_000_000, required=False)
    max_duration_hours = StrictIntegerField(min_value=1, max_value=24 * 366, required=False, allow_null=True)
