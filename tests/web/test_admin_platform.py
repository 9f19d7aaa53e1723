"""The Django admin as platform admins (superuser and plain staff) use it: ops pages, tenant forms, maintenance."""

import html
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from portal.core.models import AuditLog
from reservations.choices import AllocationKind
from reservations.models import Allocation
from tenants.models import Membership, Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(world) -> Client:
    client = Client()
    client.force_login(world.users["staff"])  # is_staff, not a superuser, no model permissions
    return client


@pytest.fixture
def root(world) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.org", "pw-Long-enough-1"))
    return client


OPS_PAGES = ["admin:provisioning_virtualcluster_changelist", "admin:provisioning_storagevolume_changelist",
             "admin:provisioning_poolcapability_changelist", "admin:health_healthcheck_changelist",
             "admin:health_repair_changelist"]


@pytest.mark.parametrize("page", OPS_PAGES)
def test_platform_admins_who_are_not_superusers_see_clusters_checks_and_repairs(world, staff, root, page):
    # DESIGN §3: platform admins are the is_staff users; portal.core.admin.StaffAdminMixin makes
    # being staff the permission, but these admins do not use it, so plain staff get 403 here
    # (and cannot run the repair steps on-call needs) while they can edit quotas and nodes.
    assert root.get(reverse(page)).status_code == 200
    assert staff.get(reverse(page)).status_code == 200


def _tenant_post(world, tenant, **overrides):
    members = list(tenant.memberships.order_by("id"))
    data = {"slug": tenant.slug, "name": tenant.name, "burst_enabled": "on", "storage_quota_tib": "10",
            "vlan_id": "", "cidr": "", "new_slack_webhook_url": "", "_save": "Save",
            "memberships-TOTAL_FORMS": str(len(members)), "memberships-INITIAL_FORMS": str(len(members)),
            "memberships-MIN_NUM_FORMS": "0", "memberships-MAX_NUM_FORMS": "1000",
            "quotas-TOTAL_FORMS": "0", "quotas-INITIAL_FORMS": "0", "quotas-MIN_NUM_FORMS": "0",
            "quotas-MAX_NUM_FORMS": "1000"}
    for i, m in enumerate(members):
        data.update({f"memberships-{i}-id": str(m.pk), f"memberships-{i}-tenant": str(tenant.pk),
                     f"memberships-{i}-user": str(m.user_id), f"memberships-{i}-role": m.role})
    data.update(overrides)
    return data, members


@pytest.mark.parametrize("who", ["staff", "root"])
def test_a_refused_tenant_form_saves_nothing(world, staff, root, who):
    client = {"staff": staff, "root": root}[who]
    tenant = world.tenants["alpha"]
    data, members = _tenant_post(world, tenant, name="Renamed Alpha")
    lead = next(i for i, m in enumerate(members) if m.role == "lead")
    data[f"memberships-{lead}-role"] = "viewer"  # the only lead: refused by membership_update
    response = client.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data, follow=True)
    assert "last lead" in response.content.decode()
    assert Membership.objects.get(pk=members[lead].pk).role == "lead"
    # was: the tenant's own fields were already committed by save_model before the inline failed
    assert Tenant.objects.get(pk=tenant.pk).name == "Team Alpha"


def test_demoting_the_lead_while_adding_another_in_the_same_form_works(world, root):
    tenant = world.tenants["alpha"]
    data, members = _tenant_post(world, tenant)
    lead = next(i for i, m in enumerate(members) if m.role == "lead")
    member = next(i for i, m in enumerate(members) if m.role == "member")
    data[f"memberships-{lead}-role"] = "member"
    data[f"memberships-{member}-role"] = "lead"  # a later row: the new lead
    response = root.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data, follow=True)
    assert "last lead" not in response.content.decode()
    assert Membership.objects.get(pk=members[member].pk).role == "lead"
    assert Membership.objects.get(pk=members[lead].pk).role == "member"


def test_maintenance_on_several_nodes_is_all_or_nothing(world, staff, book, t0):
    book("alpha-lead", t0, nodes=1)
    booked = Allocation.objects.get(kind=AllocationKind.RESERVATION).node
    free = next(n for n in world.nodes if n.pk != booked.pk)
    response = staff.post(reverse("admin:reservations_node_changelist"), {
        "action": "schedule_maintenance", "_selected_action": [free.pk, booked.pk], "apply": "1",
        "start": t0.strftime("%Y-%m-%d %H:%M:%S"), "end": (t0 + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")},
        follow=True)
    assert "is booked during that window" in response.content.decode()
    # was: the free node got its window, the booked one not: half a rack in maintenance
    assert not Allocation.objects.filter(kind=AllocationKind.MAINTENANCE).exists()



def _maintenance(world, nodes, start, end):
    from reservations.services import maintenance_windows_create

    return maintenance_windows_create(actor=world.users["staff"], nodes=nodes, start=start, end=end, note="mistake")


def _end_maintenance(staff, nodes):
    return staff.post(reverse("admin:reservations_node_changelist"), {
        "action": "end_maintenance", "_selected_action": [n.pk for n in nodes]}, follow=True)


def test_a_coming_maintenance_window_can_be_withdrawn(world, staff, t0):
    """A window entered by mistake no longer blocks its nodes until someone edits the database."""
    nodes = world.nodes[:4]
    _maintenance(world, nodes, t0, t0 + timedelta(hours=4))
    assert world.client("alpha-lead").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 1, "start": t0.isoformat(), "end": (t0 + timedelta(hours=1)).isoformat()},
        format="json").status_code == 409

    response = _end_maintenance(staff, nodes[:2])
    assert "withdrawn" in response.content.decode()
    windows = Allocation.objects.filter(kind=AllocationKind.MAINTENANCE).order_by("node_id")
    assert [w.active for w in windows] == [False, False, True, True]  # kept, inactive, for the record
    assert AuditLog.objects.filter(action="node.maintenance.withdraw").count() == 2
    booked = world.client("alpha-lead").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 2, "start": t0.isoformat(), "end": (t0 + timedelta(hours=1)).isoformat()},
        format="json")
    assert booked.status_code == 201, booked.json()
    assert sorted(booked.json()["nodes"]) == sorted(n.hostname for n in nodes[:2])
    # Nothing left to end on those nodes: said so, nothing changed.
    assert "No current or coming maintenance window" in _end_maintenance(staff, nodes[:2]).content.decode()


def test_a_maintenance_window_in_progress_ends_at_the_next_slot(world, staff):
    from django.utils import timezone

    from reservations.services import maintenance_windows_end
    from reservations.timeutil import slot_ceil, slot_floor

    now = timezone.now()
    start = slot_floor(now, 60) + timedelta(hours=1)
    node = world.nodes[0]
    _maintenance(world, [node], start, start + timedelta(hours=6))
    later = start + timedelta(minutes=90)  # in its second hour
    (window,) = maintenance_windows_end(actor=world.users["staff"], nodes=[node], now=later)
    window.refresh_from_db()
    assert window.active and window.period.lower == start
    assert window.period.upper == slot_ceil(later, 60) == start + timedelta(hours=2)
    entry = AuditLog.objects.get(action="node.maintenance.end")
    assert entry.before["end"].startswith(f"{(start + timedelta(hours=6)):%Y-%m-%dT%H}")
    # Ending it again within its last slot changes nothing.
    assert maintenance_windows_end(actor=world.users["staff"], nodes=[node], now=later + timedelta(minutes=1)) == []


def test_ending_maintenance_never_touches_bookings_or_past_windows(world, staff, book, t0):
    from django.utils import timezone

    from reservations.services import maintenance_windows_end

    reservation = book("alpha-lead", t0 + timedelta(hours=8), nodes=1)
    node = reservation.allocations.get().node
    _maintenance(world, [node], t0, t0 + timedelta(hours=2))
    past = Allocation.objects.create(node=node, period=(timezone.now() - timedelta(days=3),
                                                        timezone.now() - timedelta(days=2)),
                                     kind=AllocationKind.MAINTENANCE, note="last week")
    (window,) = maintenance_windows_end(actor=world.users["staff"], nodes=[node])
    assert window.period.lower == t0 and not window.active
    past.refresh_from_db()
    assert past.active
    assert reservation.allocations.get().active


# --- pool capabilities: checked and audited like every other admin change ---------------------------


def _capability_post(world, **overrides):
    data = {"pool": str(world.pool.pk), "cuda_versions": "12.8", "slurm_versions": "", "kubernetes_versions": "",
            "mig_profiles": '{"1g.10gb": 7}', "max_memory_per_gpu_gib": "80", "_save": "Save"}
    data.update(overrides)
    return data


@pytest.mark.parametrize("field,value", [
    ("mig_profiles", '["1g.10gb"]'),            # a list: every cluster of the pool crashed on .items()
    ("mig_profiles", '{"1g.10gb": "seven"}'),   # int("seven")
    ("mig_profiles", '{"1g.10gb": 0}'),         # no instance per GPU
    ("max_memory_per_gpu_gib", "0"),            # every spec refused: "Between 1 and 0 GiB"
])
def test_a_pool_capability_the_clusters_cannot_use_is_a_form_error(world, staff, field, value):
    from provisioning.models import PoolCapability

    response = staff.post(reverse("admin:provisioning_poolcapability_add"), _capability_post(world, **{field: value}))
    # was: 302 and the row saved; the next booking's cluster creation raised (AttributeError / ValueError)
    assert response.status_code == 200 and "errorlist" in response.content.decode()
    assert not PoolCapability.objects.exists()


def test_pool_capability_changes_are_audited_and_used(world, staff, t0, book):
    from provisioning.models import PoolCapability
    from provisioning.selectors import pool_capabilities
    from provisioning.services import cluster_create_for_reservation

    assert staff.post(reverse("admin:provisioning_poolcapability_add"), _capability_post(world)).status_code == 302
    capability = PoolCapability.objects.get()
    (created,) = AuditLog.objects.filter(action="pool.capability.create")
    assert created.actor == world.users["staff"] and created.after["mig_profiles"] == {"1g.10gb": 7}
    url = reverse("admin:provisioning_poolcapability_change", args=[capability.pk])
    assert staff.post(url, _capability_post(world, max_memory_per_gpu_gib="120")).status_code == 302
    (changed,) = AuditLog.objects.filter(action="pool.capability.update")
    assert (changed.before["max_memory_per_gpu_gib"], changed.after["max_memory_per_gpu_gib"]) == (80, 120)
    world.pool.refresh_from_db()
    assert pool_capabilities(world.pool).mig_profiles == {"1g.10gb": 7}
    reservation = book("alpha-lead", t0)
    assert cluster_create_for_reservation(reservation_id=reservation.pk).default_memory_per_gpu_gib <= 120

    delete = staff.post(reverse("admin:provisioning_poolcapability_delete", args=[capability.pk]), {"post": "yes"})
    assert delete.status_code == 302 and not PoolCapability.objects.exists()
    (deleted,) = AuditLog.objects.filter(action="pool.capability.delete")
    assert deleted.actor == world.users["staff"] and deleted.before["max_memory_per_gpu_gib"] == 120


# --- clusters and volumes: the lifecycle writes them, the admin only reads (and runs its actions) ---------


def _cluster(world, t0):
    from provisioning.services import cluster_create_for_reservation
    from reservations.services import reservation_create

    reservation = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                     node_count=1, start=t0, end=t0 + timedelta(hours=2))
    return cluster_create_for_reservation(reservation_id=reservation.pk)


def test_a_tenants_storage_volume_cannot_be_deleted_or_rewritten_in_the_admin(world, staff, t0):
    from provisioning.models import StorageVolume

    cluster = _cluster(world, t0)
    volume = StorageVolume.objects.create(tenant=world.tenants["alpha"], cluster=cluster, name="alpha-r1",
                                          size_gib=1024, mount_path="/shared")
    listing = staff.get(reverse("admin:provisioning_storagevolume_changelist"))
    assert listing.status_code == 200 and b'value="delete_selected"' not in listing.content
    # was: 302 and the row gone, unaudited: the tenant's storage quota freed while the backend kept the data
    assert staff.post(reverse("admin:provisioning_storagevolume_delete", args=[volume.pk]),
                      {"post": "yes"}).status_code == 403
    assert staff.post(reverse("admin:provisioning_storagevolume_changelist"),
                      {"action": "delete_selected", "_selected_action": [volume.pk], "post": "yes"}).status_code in (
        200, 302)
    assert StorageVolume.objects.filter(pk=volume.pk, status="active").exists()
    page = staff.get(reverse("admin:provisioning_storagevolume_change", args=[volume.pk]))
    assert page.status_code == 200 and b'name="_save"' not in page.content
    assert staff.post(reverse("admin:provisioning_storagevolume_change", args=[volume.pk]),
                      {"_save": "Save"}).status_code == 403


def _cluster_post(staff, cluster) -> dict:
    """What the cluster page's Save button posts (its inlines' management forms and rows)."""
    page = staff.get(reverse("admin:provisioning_virtualcluster_change", args=[cluster.pk]))
    data = {"_save": "Save"}
    for inline in page.context["inline_admin_formsets"]:
        formset = inline.formset
        data.update({formset.management_form.add_prefix(k): v for k, v in formset.management_form.initial.items()})
        data[formset.management_form.add_prefix("MIN_NUM_FORMS")] = 0
        data[formset.management_form.add_prefix("MAX_NUM_FORMS")] = 1000
        for form in formset.forms:
            data[form.add_prefix("id")] = form.instance.pk
            data[form.add_prefix("cluster")] = cluster.pk
    return data


@pytest.mark.django_db(transaction=True)
def test_saving_a_cluster_page_never_writes_back_what_a_worker_changed_meanwhile(world, staff, t0):
    import threading

    from django.contrib.admin import ModelAdmin
    from django.db import connection

    from provisioning.models import VirtualCluster

    cluster = _cluster(world, t0)
    data = _cluster_post(staff, cluster)
    read, go, result = threading.Event(), threading.Event(), {}
    original = ModelAdmin.save_form

    def paused_save_form(self, request, form, change):  # the admin has read the row; its save comes next
        read.set()
        go.wait(10)
        return original(self, request, form, change)

    def post():
        try:
            result["status"] = staff.post(reverse("admin:provisioning_virtualcluster_change", args=[cluster.pk]),
                                          data).status_code
        finally:
            connection.close()

    from unittest import mock

    with mock.patch.object(ModelAdmin, "save_form", paused_save_form):
        thread = threading.Thread(target=post)
        thread.start()
        read.wait(5)
        # A worker moves the cluster on (its own transaction) while the admin request is between read and save.
        VirtualCluster.objects.filter(pk=cluster.pk).update(status="allocating_nodes", attempts=1)
        go.set()
        thread.join(30)
    # was: 302, and the whole row written back as read: the phase change lost
    assert result["status"] == 403
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == ("allocating_nodes", 1)
    # The page is for reading and for its actions, which go through the services.
    page = staff.get(reverse("admin:provisioning_virtualcluster_change", args=[cluster.pk]))
    assert page.status_code == 200 and b'name="_save"' not in page.content
    assert b"teardown_clusters" in staff.get(reverse("admin:provisioning_virtualcluster_changelist")).content


def test_moving_a_quota_to_another_pool_on_the_tenant_page_is_refused_not_ignored(world, staff):
    from reservations.models import Pool
    from tenants.models import Quota
    from tenants.selectors import quota_version

    tenant = world.tenants["alpha"]
    other = Pool.objects.create(name="a100", gpu_model="A100", gpus_per_node=8)
    quota = Quota.objects.get(tenant=tenant, pool=world.pool)
    data, _ = _tenant_post(world, tenant, name="Renamed Alpha", **{
        "quotas-TOTAL_FORMS": "1", "quotas-INITIAL_FORMS": "1", "quotas-0-id": str(quota.pk),
        "quotas-0-tenant": str(tenant.pk), "quotas-0-pool": str(other.pk), "quotas-0-max_nodes": "3",
        "quotas-0-burst_nodes": "1", "quotas-0-max_duration_hours": "",
        "quotas-0-version": quota_version(quota)})  # as the page renders it
    response = staff.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data, follow=True)
    text = response.content.decode()
    # was: "changed successfully" while the quota stayed on its pool (quota_update takes only the numbers)
    assert "was changed successfully" not in text and "delete its row and add a new one" in text
    assert list(Quota.objects.filter(tenant=tenant).values_list("pool__name", flat=True)) == ["h100"]
    assert Tenant.objects.get(pk=tenant.pk).name == "Team Alpha"  # refused before anything was saved


# --- a node under repair: its repair's steps bring it back, not the node admin ------------------------


def _node_post(staff, node, **values) -> dict:
    page = staff.get(reverse("admin:reservations_node_change", args=[node.pk]))
    data = {"state": node.state, "state_reason": node.state_reason, "_save": "Save", **values}
    for inline in page.context["inline_admin_formsets"]:
        management = inline.formset.management_form
        data.update({management.add_prefix(k): v for k, v in management.initial.items()})
        data[management.add_prefix("MIN_NUM_FORMS")] = 0
        data[management.add_prefix("MAX_NUM_FORMS")] = 1000
    return data


def test_a_node_under_repair_is_not_returned_to_service_from_the_node_admin(world, staff):
    from provisioning.health.services import repair_open, repairs_reconcile
    from reservations.models import Node

    node = world.nodes[0]
    repair = repair_open(actor=world.users["staff"], node=node, reason="ECC errors")
    node.refresh_from_db()
    assert node.state == "draining"

    response = staff.post(reverse("admin:reservations_node_changelist"),
                          {"action": "return_to_service", "_selected_action": [node.pk]}, follow=True)
    text = response.content.decode()
    # was: "Returned to service 1 node(s)": the node took bookings until the health upkeep (repairs_reconcile)
    # drained it again a minute later and moved them off
    assert f"repair #{repair.pk}" in text and "Returned to service 1 node" not in text
    assert Node.objects.get(pk=node.pk).state == "draining"

    response = staff.post(reverse("admin:reservations_node_change", args=[node.pk]),
                          _node_post(staff, node, state="available"), follow=True)
    assert f"repair #{repair.pk}" in response.content.decode()
    assert Node.objects.get(pk=node.pk).state == "draining"
    assert repairs_reconcile() == 0  # nothing for the upkeep to undo

    # Other changes to the node stay possible (here: its reason), and a node with no open repair returns.
    free = world.nodes[1]
    staff.post(reverse("admin:reservations_node_changelist"), {"action": "drain", "_selected_action": [free.pk]})
    staff.post(reverse("admin:reservations_node_changelist"),
               {"action": "return_to_service", "_selected_action": [free.pk]})
    assert Node.objects.get(pk=free.pk).state == "available"


@pytest.mark.parametrize("query", ["created_at__year=99999", "created_at__year=0", "period__contains=abc"])
@pytest.mark.parametrize("page", ["admin:reservations_reservation_changelist", "admin:reservations_node_changelist",
                                  "admin:tenants_tenant_changelist", "admin:auth_user_changelist"])
def test_a_list_filter_the_database_cannot_run_is_the_invalid_filter_page_not_a_500(world, root, page, query):
    # Django checks a filter's value when it builds the query; a year out of range, or a range literal
    # PostgreSQL cannot parse, failed only when the list was counted: a 500 instead of Django's "?e=1".
    root.raise_request_exception = False
    response = root.get(reverse(page) + "?" + query)
    if "period" in query and "reservation" not in page:
        assert response.status_code in (200, 302)
        return
    assert response.status_code == 302 and response["Location"].endswith("?e=1"), response.status_code
    assert root.get(response["Location"]).status_code == 200


@pytest.mark.parametrize("who", ["staff", "root"])
def test_adding_a_disabled_account_on_the_tenant_page_is_a_form_error_and_saves_nothing(world, staff, root, who):
    # membership_create refuses a disabled account; the inline took it, so the tenant's own fields were
    # committed (tenant_update) before the refusal, and the page came back empty with a message.
    client = {"staff": staff, "root": root}[who]
    tenant = world.tenants["alpha"]
    disabled = get_user_model().objects.create_user("gone", password="pw-Long-enough-1", is_active=False)
    data, members = _tenant_post(world, tenant, name="Renamed Alpha")
    n = len(members)
    data.update({"memberships-TOTAL_FORMS": str(n + 1), f"memberships-{n}-id": "",
                 f"memberships-{n}-tenant": str(tenant.pk), f"memberships-{n}-user": str(disabled.pk),
                 f"memberships-{n}-role": "member"})
    response = client.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
    assert response.status_code == 200, response.status_code
    assert "active" in response.content.decode()
    assert Tenant.objects.get(pk=tenant.pk).name == "Team Alpha"
    assert not Membership.objects.filter(user=disabled).exists()
    assert not AuditLog.objects.filter(action__in=["tenant.update", "membership.create"]).exists()


def test_adding_a_tenant_with_a_disabled_member_saves_nothing(world, root):
    disabled = get_user_model().objects.create_user("gone", password="pw-Long-enough-1", is_active=False)
    data = {"slug": "gamma", "name": "Team Gamma", "storage_quota_tib": "10", "vlan_id": "", "cidr": "",
            "_save": "Save",
            "memberships-TOTAL_FORMS": "1", "memberships-INITIAL_FORMS": "0", "memberships-MIN_NUM_FORMS": "0",
            "memberships-MAX_NUM_FORMS": "1000", "memberships-0-id": "", "memberships-0-user": str(disabled.pk),
            "memberships-0-role": "lead",
            "quotas-TOTAL_FORMS": "0", "quotas-INITIAL_FORMS": "0", "quotas-MIN_NUM_FORMS": "0",
            "quotas-MAX_NUM_FORMS": "1000"}
    response = root.post(reverse("admin:tenants_tenant_add"), data)
    assert response.status_code == 200, response.status_code
    assert not Tenant.objects.filter(slug="gamma").exists()


def test_a_member_disabled_since_does_not_block_the_tenant_page(world, root):
    member = world.users["alpha-member"]
    member.is_active = False
    member.save()
    data, _ = _tenant_post(world, world.tenants["alpha"], name="Renamed Alpha")
    response = root.post(reverse("admin:tenants_tenant_change", args=[world.tenants["alpha"].pk]), data)
    assert response.status_code == 302
    assert Tenant.objects.get(pk=world.tenants["alpha"].pk).name == "Renamed Alpha"


@pytest.mark.parametrize("url", ["https://10.1.2.3/services/T0/B0/x", "https://127.0.0.1/hook"])
def test_a_slack_url_the_service_refuses_is_a_form_error_and_saves_nothing(world, staff, settings, url):
    # The form took any URL; tenant_slack_webhook_set refused it only after tenant_update had committed
    # the rest of the page (here the new name), which the emptied form then no longer showed.
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    tenant = world.tenants["alpha"]
    data, _ = _tenant_post(world, tenant, name="Renamed Alpha", new_slack_webhook_url=url)
    response = staff.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
    assert response.status_code == 200, response.status_code
    assert "new_slack_webhook_url" in response.context["adminform"].form.errors
    tenant.refresh_from_db()
    assert tenant.name == "Team Alpha" and tenant.slack_webhook_url == ""
    assert not AuditLog.objects.filter(action__in=["tenant.update", "tenant.slack_webhook"]).exists()


@pytest.mark.parametrize("cidr", ["abc", "10.0.0.1/8", "fe80::%eth0/64", "10.0.0.0/33"])
def test_a_network_the_service_refuses_is_a_form_error_on_the_tenant_page(world, staff, cidr):
    # tenant_update / tenant_create refused it only after the form was accepted: a redirect to an emptied form.
    tenant = world.tenants["alpha"]
    data, _ = _tenant_post(world, tenant, name="Renamed Alpha", cidr=cidr)
    response = staff.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
    assert response.status_code == 200, response.status_code
    assert "cidr" in response.context["adminform"].form.errors
    add = staff.post(reverse("admin:tenants_tenant_add"),
                     {"slug": "gamma", "name": "Team Gamma", "storage_quota_tib": "10", "vlan_id": "", "cidr": cidr,
                      "_save": "Save", **{f"{p}-{k}": v for p in ("memberships", "quotas") for k, v in
                                          (("TOTAL_FORMS", "0"), ("INITIAL_FORMS", "0"), ("MIN_NUM_FORMS", "0"),
                                           ("MAX_NUM_FORMS", "1000"))}})
    assert add.status_code == 200, add.status_code
    assert "cidr" in add.context["adminform"].form.errors
    assert Tenant.objects.get(pk=tenant.pk).name == "Team Alpha" and not Tenant.objects.filter(slug="gamma").exists()


@pytest.mark.parametrize("action,page", [("drain", "admin:reservations_node_changelist"),
                                         ("bulk_change", "admin:tenants_quota_changelist"),
                                         ("delete_selected", "admin:auth_user_changelist")])
def test_an_action_on_a_selection_that_names_no_row_is_a_message_not_a_500(world, root, action, page):
    # Django filtered the list by the posted ids as given: "abc" for a numeric key was a ValueError (a 500).
    root.raise_request_exception = False
    audited = AuditLog.objects.count()
    response = root.post(reverse(page), {"action": action, "_selected_action": ["abc"], "post": "yes"}, follow=True)
    assert response.status_code == 200, response.status_code
    assert any("no such" in str(m).lower() for m in response.context["messages"])
    assert AuditLog.objects.count() == audited


@pytest.mark.parametrize("kind", ["slack", "webhook"])
def test_a_new_channel_url_the_service_refuses_keeps_the_form_with_the_reason(world, staff, settings, kind):
    # The channel page's "New URL" went to the service only in save_model: its refusal (a private address)
    # became a message over a redirect to an emptied form, and the name and events typed with it were lost.
    from notifications import services as notify
    from notifications.models import Channel
    from tenants.services import tenant_slack_webhook_set

    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    tenant = world.tenants["alpha"]
    if kind == "slack":
        tenant = tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=tenant,
                                          url="https://hooks.slack.com/services/T0/B0/old")
        channel = notify.slack_channel_ensure(tenant)
    else:
        channel, _ = notify.webhook_create(actor=world.users["alpha-lead"], tenant=tenant,
                                           url="https://ci.example.com/hook", name="ci", events=[])
    before = (Channel.objects.get(pk=channel.pk).url, Channel.objects.get(pk=channel.pk).name)
    audited = AuditLog.objects.count()
    typed = "https://10.1.2.3/services/T0/B0/new"
    response = staff.post(reverse("admin:notifications_channel_change", args=[channel.pk]),
                          {"name": "renamed", "new_url": typed, "events": [], "enabled": "on", "_save": "Save"})
    assert response.status_code == 200, (response.status_code, response.get("Location"))
    form = response.context["adminform"].form
    assert "new_url" in form.errors and "public" in " ".join(form.errors["new_url"]).lower()
    html = response.content.decode()
    assert f'value="{typed}"' in html  # what was typed, beside the reason
    assert kind == "slack" or 'value="renamed"' in html  # (a Slack channel's name is not editable)
    saved = Channel.objects.get(pk=channel.pk)
    assert (saved.url, saved.name) == before and AuditLog.objects.count() == audited


def test_a_slack_channels_name_is_not_offered_for_an_edit_that_is_never_saved(world, staff, settings):
    # The change page offered a Name box for a tenant's Slack channel (and the platform channel), but their save
    # passes only the URL, events and enabled flag to the services: a new name was dropped and the page said
    # "changed successfully". The name is shown, not offered, there; a webhook's stays editable.
    from notifications import services as notify
    from tenants.services import tenant_slack_webhook_set

    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    tenant = tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                      url="https://hooks.slack.com/services/T0/B0/old")
    slack, platform = notify.slack_channel_ensure(tenant), notify.platform_channel_ensure()
    webhook, _ = notify.webhook_create(actor=world.users["alpha-lead"], tenant=tenant,
                                       url="https://ci.example.com/hook", name="ci", events=[])
    for channel in (slack, platform):
        html = staff.get(reverse("admin:notifications_channel_change", args=[channel.pk])).content.decode()
        assert 'name="name"' not in html, channel.label
    html = staff.get(reverse("admin:notifications_channel_change", args=[webhook.pk])).content.decode()
    assert 'name="name"' in html


def test_the_admin_names_api_tokens_as_the_docs_do(root):
    """The admin's index and the token list said "Api tokens" (Django's name from the class ApiToken)."""
    index = root.get(reverse("admin:index")).content.decode()
    assert "API tokens" in index and "Api tokens" not in index
    assert "Select API token to change" in root.get(reverse("admin:tenants_apitoken_changelist")).content.decode()


def test_a_slack_url_typed_in_the_tenant_admin_is_hidden_from_error_reports(world, staff):
    """A Slack incoming-webhook URL is a bearer secret: the tenant admin's "new Slack URL" box was not marked
    sensitive, so a 500 while saving put the full URL in Django's error report (log, admins' mail)."""
    from django.views.debug import SafeExceptionReporterFilter

    tenant = world.tenants["alpha"]
    url = "https://hooks.slack.com/services/T000/B000/tenant-admin-secret"
    data, _ = _tenant_post(world, tenant, new_slack_webhook_url=url)
    response = staff.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
    assert response.status_code in (200, 302)
    shown = SafeExceptionReporterFilter().get_post_parameters(response.wsgi_request)
    assert shown["new_slack_webhook_url"] != url


def _page_post(page, **changes) -> dict:
    """What a change page's Save button posts, as the page was rendered: each field's value, the hidden
    shown values where the form has them, the inlines' management forms; then changes."""
    form = page.context["adminform"].form
    data: dict = {"_save": "Save"}
    for name, field in form.fields.items():
        value = form[name].value()
        data[name] = "" if value is None else str(value)
        if field.show_hidden_initial:
            data[form.add_initial_prefix(name)] = data[name]
    for inline in page.context["inline_admin_formsets"]:
        management = inline.formset.management_form
        data.update({management.add_prefix(k): v for k, v in management.initial.items()})
        data[management.add_prefix("MIN_NUM_FORMS")] = 0
        data[management.add_prefix("MAX_NUM_FORMS")] = 1000
    data.update({k: str(v) for k, v in changes.items()})
    return data


def _second_admin() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user(username="staff2", password="pw-Long-enough-1",
                                                            is_staff=True))
    return client


def test_a_stale_node_page_does_not_return_a_drained_node_to_service(world, staff):
    """Admin A drains a node (the API: its state only); admin B, on the node's page opened before (it showed
    "available"), only writes a reason: that save posted state "available" too and returned the drained node
    to new bookings. Now the state B left alone stays drained; a state change B makes over A's is refused."""
    from reservations.models import Node

    node = world.nodes[0]
    url = reverse("admin:reservations_node_change", args=[node.pk])
    other = _second_admin()
    opened = other.get(url)
    drained = world.client("staff").patch(f"/api/v1/nodes/{node.pk}/", {"state": "draining"}, format="json")
    assert drained.status_code == 200, drained.json()
    assert Node.objects.get(pk=node.pk).state == "draining"

    saved = other.post(url, _page_post(opened, state_reason="fan noise on GPU 3"))
    assert saved.status_code == 302, saved.context["adminform"].form.errors
    assert Node.objects.filter(pk=node.pk).values_list("state", "state_reason").get() == (
        "draining", "fan noise on GPU 3")

    clash = other.post(url, _page_post(opened, state="maintenance"))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    assert Node.objects.get(pk=node.pk).state == "draining"


def test_a_stale_pool_page_does_not_revert_the_rate(world, staff):
    from reservations.models import Pool

    url = reverse("admin:reservations_pool_change", args=[world.pool.pk])
    other = _second_admin()
    first, opened = staff.get(url), other.get(url)
    assert staff.post(url, _page_post(first, on_demand_rate="3.75")).status_code == 302
    saved = other.post(url, _page_post(opened, gpu_model="H100-SXM5"))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    pool = Pool.objects.get(pk=world.pool.pk)
    assert (pool.gpu_model, str(pool.on_demand_rate)) == ("H100-SXM5", "3.7500")
    clash = other.post(url, _page_post(opened, on_demand_rate="1.00"))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    assert str(Pool.objects.get(pk=world.pool.pk).on_demand_rate) == "3.7500"


def test_a_stale_pool_capability_page_does_not_revert_a_newer_edit(world, staff):
    """Admin A sets the pool's memory limit; admin B, on the capability page opened before, adds a CUDA
    version: B's save posted every field and wrote A's old memory limit back. Now only what B changed is
    written, and a field B changed that A changed since is refused (nothing saved)."""
    from provisioning.models import PoolCapability
    from provisioning.services import pool_capability_set

    capability = pool_capability_set(actor=world.users["staff"], pool=world.pool, cuda_versions=["12.8"],
                                     mig_profiles={"1g.10gb": 7}, max_memory_per_gpu_gib=80)
    url = reverse("admin:provisioning_poolcapability_change", args=[capability.pk])
    other = _second_admin()
    first, opened = staff.get(url), other.get(url)
    assert staff.post(url, _page_post(first, max_memory_per_gpu_gib="120")).status_code == 302
    saved = other.post(url, _page_post(opened, cuda_versions="12.8,12.9"))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    row = PoolCapability.objects.get(pk=capability.pk)
    assert (row.cuda_versions, row.max_memory_per_gpu_gib, row.mig_profiles) == (
        ["12.8", "12.9"], 120, {"1g.10gb": 7})

    clash = other.post(url, _page_post(opened, max_memory_per_gpu_gib="40"))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    assert PoolCapability.objects.get(pk=capability.pk).max_memory_per_gpu_gib == 120


def test_node_and_token_actions_count_in_words(world, staff):
    """The admin said "Drained 1 node(s)." and "Revoked 1 token(s)"; counts now agree with their noun."""
    from tenants.models import ApiToken
    from tenants.services import token_issue

    nodes = reverse("admin:reservations_node_changelist")
    one = staff.post(nodes, {"action": "drain", "_selected_action": [world.nodes[0].pk]}, follow=True)
    assert "Drained 1 node." in one.content.decode()
    two = staff.post(nodes, {"action": "return_to_service", "_selected_action": [n.pk for n in world.nodes[:2]]},
                     follow=True).content.decode()
    assert "Returned to service 2 nodes." in two and "(s)" not in two

    token_issue(user=world.users["alpha-lead"])
    token_issue(user=world.users["alpha-lead"])
    tokens = [t.pk for t in ApiToken.objects.filter(user=world.users["alpha-lead"], revoked=False)]
    revoked = staff.post(reverse("admin:tenants_apitoken_changelist"),
                         {"action": "revoke", "_selected_action": tokens}, follow=True).content.decode()
    assert f"Revoked {len(tokens)} tokens; requests presenting them are refused from now on." in revoked


@pytest.mark.parametrize("hostname", ["h100-009,h100-001", "bad host", "-h100-009", "h100-009;reboot"])
def test_a_hostname_the_backends_cannot_name_is_a_form_error_on_the_node_admin(world, staff, hostname):
    """The API refused these (its serializer's pattern), the admin took them: a comma names two nodes in a Slurm
    node list, a space or ';' breaks the scontrol line the node is drained and booked with."""
    from portal.core.exceptions import InvalidInput
    from reservations.models import Node
    from reservations.services import node_create

    response = staff.post(reverse("admin:reservations_node_add"), {
        "hostname": hostname, "pool": world.pool.pk, "state": "available", "_save": "Save",
        "allocations-TOTAL_FORMS": "0", "allocations-INITIAL_FORMS": "0"})
    assert response.status_code == 200  # the form again, with the reason beside the field
    assert "Letters, digits, dots and hyphens only" in response.content.decode()
    assert not Node.objects.filter(hostname=hostname).exists()
    assert not AuditLog.objects.filter(action="node.create").exists()
    with pytest.raises(InvalidInput) as refused:  # the service's own rule, whoever calls it
        node_create(actor=world.users["staff"], hostname=hostname, pool=world.pool)
    assert "hostname" in refused.value.fields
    assert not Node.objects.filter(hostname=hostname).exists()


def test_a_hostname_differing_only_in_case_is_a_form_error_on_the_node_admin(world, staff):
    from reservations.models import Node

    existing = Node.objects.order_by("hostname").first().hostname
    nodes = Node.objects.count()
    response = staff.post(reverse("admin:reservations_node_add"), {
        "hostname": existing.upper(), "pool": world.pool.pk, "state": "available", "_save": "Save",
        "allocations-TOTAL_FORMS": "0", "allocations-INITIAL_FORMS": "0"})
    assert response.status_code == 200  # the form again, with the reason
    assert "A node with that hostname exists" in response.content.decode()
    assert Node.objects.count() == nodes
    assert not AuditLog.objects.filter(action="node.create").exists()


def test_a_valid_hostname_is_still_added_from_the_node_admin(world, staff):
    from reservations.models import Node

    response = staff.post(reverse("admin:reservations_node_add"), {
        "hostname": "h100-009.rack2", "pool": world.pool.pk, "state": "available", "_save": "Save",
        "allocations-TOTAL_FORMS": "0", "allocations-INITIAL_FORMS": "0"})
    assert response.status_code == 302
    assert Node.objects.filter(hostname="h100-009.rack2", pool=world.pool).exists()
    assert AuditLog.objects.filter(action="node.create", actor=world.users["staff"]).count() == 1


def test_draining_a_selection_leaves_nodes_already_out_of_service_as_they_are(world, staff):
    """Drain on a whole rack's selection: a failed node became "draining, drained by platform staff" (its failure
    and the reason for it gone, a retired node back among the drained ones); only the available ones are drained."""
    from reservations.models import Node

    free, failed, retired, drained = world.nodes[:4]
    Node.objects.filter(pk=failed.pk).update(state="failed", state_reason="GPU 3 fell off the bus")
    Node.objects.filter(pk=retired.pk).update(state="retired", state_reason="end of life")
    Node.objects.filter(pk=drained.pk).update(state="draining", state_reason="health check: ECC errors")

    response = staff.post(reverse("admin:reservations_node_changelist"),
                          {"action": "drain", "_selected_action": [n.pk for n in world.nodes[:4]]}, follow=True)
    text = response.content.decode()
    assert [(n.state, n.state_reason) for n in Node.objects.filter(pk__in=[n.pk for n in world.nodes[:4]])
            .order_by("hostname")] == [("draining", "drained by platform staff"),
                                       ("failed", "GPU 3 fell off the bus"),
                                       ("retired", "end of life"),
                                       ("draining", "health check: ECC errors")]
    assert "Drained 1 node." in text
    assert f"{failed.hostname} (failed), {retired.hostname} (retired), {drained.hostname} (draining)" in text
    assert list(AuditLog.objects.filter(action="node.update").values_list("object_id", flat=True)) == [str(free.pk)]


def test_a_repair_step_from_the_admin_says_what_it_did(world, staff):
    """"Accept the selected repairs" answered with the list alone, no word: staff could not tell it had worked."""
    from provisioning.health.models import Repair
    from provisioning.health.services import repair_open

    repair = repair_open(actor=world.users["staff"], node=world.nodes[0], reason="ECC errors")
    response = staff.post(reverse("admin:health_repair_changelist"),
                          {"action": "repair_to_accepted", "_selected_action": [repair.pk]}, follow=True)
    assert Repair.objects.get(pk=repair.pk).state == "accepted"
    assert f"Repair #{repair.pk} ({world.nodes[0].hostname}): accepted." in response.content.decode()
    # A refused step still says why, and nothing about a success.
    response = staff.post(reverse("admin:health_repair_changelist"),
                          {"action": "repair_to_rejoined", "_selected_action": [repair.pk]}, follow=True)
    text = response.content.decode()
    assert f"Repair #{repair.pk}: " in text and f"({world.nodes[0].hostname}): rejoined." not in text
    assert Repair.objects.get(pk=repair.pk).state == "accepted"


def test_an_admin_message_naming_a_node_keeps_its_hostname_as_written(world, staff, book, t0):
    """Django's admin writes every message with capfirst: the refusal read "H100-001 is booked during that
    window", a hostname no node has (hostnames, tenant slugs and usernames are case-sensitive names)."""
    book("alpha-lead", t0, nodes=1)
    booked = Allocation.objects.get(kind=AllocationKind.RESERVATION).node
    response = staff.post(reverse("admin:reservations_node_changelist"), {
        "action": "schedule_maintenance", "_selected_action": [booked.pk], "apply": "1",
        "start": t0.strftime("%Y-%m-%d %H:%M:%S"), "end": (t0 + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")},
        follow=True)
    messages = re.findall(r'<ul class="messagelist">(.*?)</ul>', response.content.decode(), re.S)
    assert messages and f"{booked.hostname} is booked during that window" in messages[0], messages


def test_lowering_a_quota_below_one_booked_node_counts_it_in_the_singular(world, staff, book, t0):
    """The confirmation page read "the tenant holds up to 1 nodes then; the new limit is 0"."""
    book("alpha-lead", t0, nodes=1)
    quota = world.tenants["alpha"].quotas.get(pool=world.pool)
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    version = re.search(r'<input type="hidden" name="version" value="([^"]*)"', staff.get(url).content.decode())
    response = staff.post(url, {"max_nodes": 0, "burst_nodes": 0, "max_duration_hours": "", "_save": "Save",
                                "version": html.unescape(version.group(1))})
    page = response.content.decode()
    assert "Lower a quota below what is booked?" in page
    assert "the tenant holds up to 1 node then; the new limit is 0" in page, page
