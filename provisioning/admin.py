"""Staff views of clusters: phases, artefacts (never a secret), retry and teardown actions."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from portal.core.admin import ReadOnlyAdminMixin, ServiceAdminMixin, ShownValuesMixin
from portal.core.exceptions import DomainError
from portal.core.words import count_of

from . import services
from .models import ClusterCredential, ClusterTransition, NodeDrain, PoolCapability, StorageVolume, VirtualCluster


class TransitionInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ClusterTransition
    extra = 0
    can_delete = False
    fields = ["at", "previous", "phase", "actor", "source", "detail"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


class CredentialInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ClusterCredential
    extra = 0
    can_delete = False
    # The ciphertext stays out of the admin too: staff do not get tenant secrets.
    fields = ["kind", "fingerprint", "created_at", "rotated_at", "revoked_at"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(VirtualCluster)
class VirtualClusterAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Read-only, with retry and teardown as actions (service calls). The lifecycle workers write these rows:
    a Save here wrote back the whole row as read, undoing a phase change made during the request."""

    list_display = ["id", "tenant", "reservation", "backend", "orchestrator", "status", "phase_started_at", "attempts"]
    list_filter = ["status", "backend", "orchestrator"]
    search_fields = ["tenant__slug", "reservation__name", "status_reason"]
    # The reservation column is Reservation.__str__, which names its tenant and pool.
    list_select_related = ["tenant", "reservation__tenant", "reservation__pool"]
    inlines = [TransitionInline, CredentialInline]
    actions = ["retry_clusters", "teardown_clusters"]
    readonly_fields = [
        "reservation", "tenant", "status", "status_reason", "phase_started_at", "backend", "connection",
        "backend_state", "dispatched_at", "heartbeat_at", "attempts", "next_attempt_at", "last_error",
        "failed_during", "start_reminded_for", "end_reminded_for", "created_at", "updated_at",
        "orchestrator", "orchestrator_version", "cuda_version", "mig_profile", "default_memory_per_gpu_gib",
        "shared_storage_gib",
    ]

    def get_queryset(self, request):
        return VirtualCluster.objects.for_user(request.user)

    @admin.action(description="Retry failed clusters")
    def retry_clusters(self, request, queryset):
        self._each(request, queryset, lambda c: services.cluster_retry(actor=request.user, cluster=c), "retried")

    @admin.action(description="Tear down now")
    def teardown_clusters(self, request, queryset):
        self._each(request, queryset, lambda c: services.cluster_request_teardown(actor=request.user, cluster=c),
                   "tearing down")

    def _each(self, request, queryset, fn, verb):
        done = 0
        for cluster in queryset:
            try:
                fn(cluster)
                done += 1
            except DomainError as exc:
                self.message_user(request, f"Cluster #{cluster.pk}: {exc.detail}", messages.ERROR)
        if done:
            self.message_user(request, f"{count_of(done, 'cluster')} {verb}.", messages.SUCCESS)


@admin.register(StorageVolume)
class StorageVolumeAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Read-only: a volume is attached and released with its cluster. Deleting the row freed the tenant's
    storage quota (unaudited) while the backend still held the data."""

    list_display = ["name", "tenant", "size_gib", "status", "created_at", "released_at"]
    list_filter = ["status"]
    readonly_fields = ["tenant", "cluster", "name", "size_gib", "status", "mount_path", "created_at", "released_at"]

    def get_queryset(self, request):
        return StorageVolume.objects.for_user(request.user)


@admin.register(NodeDrain)
class NodeDrainAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Read-only: drains a backend could not finish yet (the portal keeps trying; the runbook's
    PortalNodeDrainStuck says what to clear). A row goes once the drain completes or the node is back."""

    list_display = ["node", "since", "attempts", "next_attempt_at", "last_error"]
    readonly_fields = list_display
    list_select_related = ["node"]
    ordering = ["since"]


class PoolCapabilityForm(ShownValuesMixin, forms.ModelForm):
    # A page opened before another admin's change does not post its old values back (ShownValuesMixin).
    watched = services.CAPABILITY_FIELDS

    class Meta:
        model = PoolCapability
        fields = ("pool", *services.CAPABILITY_FIELDS)

    def clean(self):
        data = super().clean()
        for field, why in services.pool_capability_errors(
                {k: data[k] for k in services.CAPABILITY_FIELDS if k in data}).items():
            self.add_error(field, why)
        return data


@admin.register(PoolCapability)
class PoolCapabilityAdmin(ServiceAdminMixin, admin.ModelAdmin):
    """Checked as the clusters use it (a row they cannot read would fail every cluster of the pool), and
    saved through the audited service."""

    form = PoolCapabilityForm
    list_display = ["pool", "cuda_versions", "mig_profiles", "max_memory_per_gpu_gib"]
    list_select_related = ["pool"]

    def get_readonly_fields(self, request, obj=None):
        return ("pool",) if obj is not None else ()

    def save_model(self, request, obj, form, change):
        values = {k: form.cleaned_data[k] for k in services.CAPABILITY_FIELDS if k in form.cleaned_data}
        if change:  # only what this admin changed, if still as the page showed it
            values = {k: values[k] for k in form.changed_data if k in values}
            saved = services.pool_capability_set(actor=request.user, pool=obj.pool, expected=form.shown(values),
                                                 **values)
        else:
            saved = services.pool_capability_set(actor=request.user, pool=obj.pool, **values)
        obj.pk = saved.pk
        obj._state.adding = False

    def delete_model(self, request, obj):
        services.pool_capability_delete(actor=request.user, capability=obj)

