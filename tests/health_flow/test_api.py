"""The health API: who may trigger, who sees what, and every refusal is the envelope with nothing stored."""

from __future__ import annotations

from datetime import timedelta

import pytest

from portal.core.models import AuditLog
from provisioning.health.models import HealthCheck
from provisioning.health.services import health_checks_request

from .conftest import fleet_spec

URL = "/api/v1/clusters/{}/health-checks/"


def make_cluster(reservation):
    from provisioning.models import VirtualCluster

    return VirtualCluster.objects.create(
        reservation=reservation, tenant=reservation.tenant, status="ready", backend="simulated",
        orchestrator="slurm", orchestrator_version="24.11", cuda_version="12.8", default_memory_per_gpu_gib=80,
        shared_storage_gib=100,
    )


@pytest.fixture
def clusters(fleet, now_slot):
    alpha = fleet.book("alpha", ["gpu-001", "gpu-002"], now_slot, now_slot + timedelta(hours=4))
    beta = fleet.book("beta", ["gpu-003"], now_slot, now_slot + timedelta(hours=4))
    return {"alpha": make_cluster(alpha), "beta": make_cluster(beta)}


def envelope(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["code"] == code and set(body) >= {"code", "detail", "fields"}
    return body


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["alpha-lead", "alpha-member"])
def test_leads_and_members_trigger_checks_on_their_cluster(who, fleet, clusters, settings, eager,
                                                           django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec()
    with django_capture_on_commit_callbacks(execute=True):
        response = fleet.client(who).post(URL.format(clusters["alpha"].pk), {"level": "quick"})
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["cluster"] == clusters["alpha"].pk and body["level"] == "quick"
    assert [c["node"] for c in body["checks"]] == ["gpu-001", "gpu-002"]
    assert {c["trigger"] for c in body["checks"]} == {"tenant"}
    assert sorted(body["ids"]) == sorted(HealthCheck.objects.values_list("pk", flat=True))
    assert AuditLog.objects.filter(action="health_check.request").count() == 2
    # Ran (eagerly) on commit; the results are theirs to read.
    listed = fleet.client(who).get("/api/v1/health-checks/", {"cluster": clusters["alpha"].pk}).json()
    assert listed["count"] == 2 and {r["verdict"] for r in listed["results"]} == {"pass"}
    assert listed["results"][0]["requested_by"] == fleet.users[who].username
    assert len(listed["results"][0]["gpus"]) == 8
    # Asking again while nothing is open queues new checks; the same open ones are reused.
    again = fleet.client(who).post(URL.format(clusters["alpha"].pk), {"level": "quick", "nodes": ["gpu-002"]})
    assert again.status_code == 202 and [c["node"] for c in again.json()["checks"]] == ["gpu-002"]
    same = fleet.client(who).post(URL.format(clusters["alpha"].pk), {"level": "quick", "nodes": ["gpu-002"]})
    assert same.json()["ids"] == again.json()["ids"]


@pytest.mark.django_db
@pytest.mark.parametrize(("who", "status", "code"), [
    ("alpha-viewer", 403, "permission_denied"),
    ("beta-lead", 404, "not_found"),
    ("beta-member", 404, "not_found"),
    (None, 401, "not_authenticated"),
])
def test_refusals_store_nothing(who, status, code, fleet, clusters):
    envelope(fleet.client(who).post(URL.format(clusters["alpha"].pk), {"level": "quick"}), status, code)
    assert not HealthCheck.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field"), [
    ({"level": "deep"}, "level"),
    ({"level": 3}, "level"),
    ({"level": "quick", "nodes": ["gpu-003"]}, "nodes"),  # beta's node: reads like an unknown one
    ({"level": "quick", "nodes": "gpu-001"}, "nodes"),
    ({"level": "quick", "nodes": []}, "nodes"),
])
def test_bad_input_is_400_and_stores_nothing(body, field, fleet, clusters):
    response = fleet.client("alpha-lead").post(URL.format(clusters["alpha"].pk), body, format="json")
    assert field in envelope(response, 400, "invalid")["fields"]
    assert not HealthCheck.objects.exists()


@pytest.mark.django_db
def test_non_json_and_unknown_cluster(fleet, clusters):
    client = fleet.client("alpha-lead")
    envelope(client.post(URL.format(clusters["alpha"].pk), "level=quick",
                         content_type="application/x-www-form-urlencoded"), 400, "invalid")
    envelope(client.post(URL.format(999999), {"level": "quick"}), 404, "not_found")
    assert not HealthCheck.objects.exists()


@pytest.mark.django_db
def test_a_cluster_whose_booking_has_not_started_cannot_be_checked(fleet, tomorrow):
    cluster = make_cluster(fleet.book("alpha", ["gpu-004"], tomorrow, tomorrow + timedelta(hours=1), "confirmed"))
    envelope(fleet.client("alpha-lead").post(URL.format(cluster.pk), {"level": "quick"}), 409, "invalid_state")
    assert not HealthCheck.objects.exists()


@pytest.mark.django_db
def test_results_are_isolated_by_tenant(fleet, clusters, settings, eager, django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-003": [{"kind": "persistence_off", "gpu": 0}]})
    with django_capture_on_commit_callbacks(execute=True):
        fleet_checks = health_checks_request(nodes=fleet.nodes, level="quick", trigger="schedule")
        fleet.client("beta-lead").post(URL.format(clusters["beta"].pk), {"level": "quick"})
    assert len(fleet_checks) == 4

    def listed(who, **params):
        response = fleet.client(who).get("/api/v1/health-checks/", params)
        assert response.status_code == 200, response.content
        body = response.json()
        assert set(body) == {"count", "next", "previous", "results"}
        return {(r["node"], r["trigger"]) for r in body["results"]}

    assert listed("alpha-viewer") == {("gpu-001", "schedule"), ("gpu-002", "schedule")}
    assert listed("beta-viewer") == {("gpu-003", "schedule"), ("gpu-003", "tenant")}
    assert len(listed("staff")) == 5
    assert listed("beta-member", verdict="warn") == {("gpu-003", "schedule"), ("gpu-003", "tenant")}
    assert listed("alpha-lead", verdict="warn") == set()
    assert listed("beta-lead", node="gpu-003", trigger="tenant") == {("gpu-003", "tenant")}
    # A hostname is one host ignoring case (node_create refuses a case variant): GPU-003 filters gpu-003.
    assert listed("beta-lead", node="GPU-003", trigger="tenant") == {("gpu-003", "tenant")}
    assert listed("staff", node="Gpu-001") == {("gpu-001", "schedule")}
    # Another tenant's node or cluster in a filter reads exactly like an unknown one.
    for params, field in (({"node": "gpu-003"}, "node"), ({"node": "nope"}, "node"),
                          ({"cluster": clusters["beta"].pk}, "cluster"), ({"cluster": 999999}, "cluster"),
                          ({"verdict": "great"}, "verdict"), ({"cluster": "x"}, "cluster")):
        body = envelope(fleet.client("alpha-lead").get("/api/v1/health-checks/", params), 400, "invalid")
        assert field in body["fields"]
    envelope(fleet.client(None).get("/api/v1/health-checks/"), 401, "not_authenticated")
    # Details: own node's check yes, another tenant's is a 404.
    beta_check = HealthCheck.objects.get(node__hostname="gpu-003", trigger="tenant")
    envelope(fleet.client("alpha-lead").get(f"/api/v1/health-checks/{beta_check.pk}/"), 404, "not_found")
    detail = fleet.client("beta-viewer").get(f"/api/v1/health-checks/{beta_check.pk}/").json()
    assert detail["verdict"] == "warn" and detail["report"]["parts_ran"] == ["nvml", "xid_events", "xid_log"]
    assert detail["problems"][0]["check"] == "persistence_mode"
    # A scheduled check shows the platform, not a staff member's name, to tenants.
    assert fleet.client("alpha-lead").get("/api/v1/health-checks/").json()["results"][0]["requested_by"] is None


@pytest.mark.django_db
def test_list_is_paginated(fleet, settings):
    for _ in range(3):
        checks = health_checks_request(nodes=fleet.nodes, level="quick", trigger="schedule")
        HealthCheck.objects.filter(pk__in=[c.pk for c in checks]).update(status="error", verdict="unknown")
    body = fleet.client("staff").get("/api/v1/health-checks/", {"page_size": 5}).json()
    assert body["count"] == 12 and len(body["results"]) == 5 and body["next"]


@pytest.mark.django_db
def test_a_tenant_sees_a_nodes_fleet_checks_only_from_while_it_holds_the_node(
        fleet, now_slot, tomorrow, settings, eager, django_capture_on_commit_callbacks):
    """A node's fleet checks (scheduled, staff) were shown to every tenant holding the node at any
    time: beta, booked on alpha's node for tomorrow, read today's check with alpha's processes (pids,
    memory) in it, and alpha kept reading the node's checks from beta's window."""
    from provisioning.health.services import node_health_check_request

    fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=4))
    fleet.book("beta", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=4), status="confirmed")
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "stray_process", "gpu": 0, "pid": 31337},
                                                        {"kind": "persistence_off", "gpu": 1}]})
    with django_capture_on_commit_callbacks(execute=True):
        today = node_health_check_request(actor=fleet.users["staff"], node=fleet.node("gpu-001"), level="quick")
    today.refresh_from_db()
    # alpha's job, read while alpha holds the node: counted (its pid is named nowhere, not even to alpha).
    [processes] = [c for c in today.gpu_results[0]["checks"] if c["name"] == "compute_processes"]
    assert processes["value"] == {"count": 1} and "31337" not in str(today.gpu_results)
    later = health_checks_request(nodes=[fleet.node("gpu-001")], level="quick", trigger="schedule")[0]
    HealthCheck.objects.filter(pk=later.pk).update(created_at=tomorrow + timedelta(hours=1))

    def listed(who):
        response = fleet.client(who).get("/api/v1/health-checks/", {"node": "gpu-001"})
        assert response.status_code == 200, response.content
        return {r["id"] for r in response.json()["results"]}

    assert listed("alpha-lead") == {today.pk}
    assert listed("beta-lead") == {later.pk}
    envelope(fleet.client("beta-lead").get(f"/api/v1/health-checks/{today.pk}/"), 404, "not_found")
    assert fleet.client("alpha-lead").get(f"/api/v1/health-checks/{today.pk}/").status_code == 200
    envelope(fleet.client("alpha-lead").get(f"/api/v1/health-checks/{later.pk}/"), 404, "not_found")
    assert listed("staff") == {today.pk, later.pk}


@pytest.mark.django_db
def test_a_check_staff_ran_on_a_teams_cluster_names_the_platform_not_the_staff_member(
        fleet, clusters, settings, eager, django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec()
    with django_capture_on_commit_callbacks(execute=True):
        response = fleet.client("staff").post(URL.format(clusters["alpha"].pk), {"level": "quick",
                                                                                 "nodes": ["gpu-001"]})
    assert response.status_code == 202, response.content
    seen = fleet.client("alpha-lead").get("/api/v1/health-checks/").json()["results"]
    assert [r["requested_by"] for r in seen] == ["platform"]
    detail = fleet.client("alpha-viewer").get(f"/api/v1/health-checks/{seen[0]['id']}/").json()
    assert detail["requested_by"] == "platform"
    # Staff still see who it was.
    staff_view = fleet.client("staff").get("/api/v1/health-checks/").json()["results"]
    assert [r["requested_by"] for r in staff_view] == [fleet.users["staff"].username]


@pytest.mark.django_db
def test_a_booking_moved_off_a_node_before_its_start_never_reads_the_nodes_checks(
        fleet, tomorrow, settings, eager, django_capture_on_commit_callbacks):
    """A future booking moved whole to a spare (node_replace_allocations) keeps its released allocation on
    the failed node, with its whole window: its team never held that node, yet read every fleet check of it
    during that window — after the node's repair, the checks of the team that booked it next (their
    processes: pids, memory)."""
    from provisioning.health.services import repair_advance, repair_open

    staff = fleet.users["staff"]
    end = tomorrow + timedelta(hours=4)
    alpha = fleet.book("alpha", ["gpu-001"], tomorrow, end, status="confirmed")
    repair = repair_open(actor=staff, node=fleet.node("gpu-001"), reason="XID 79")
    moved = alpha.allocations.get(node__hostname="gpu-001")
    assert not moved.active and moved.note.startswith("replaced")  # alpha now holds a spare
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    HealthCheck.objects.filter(pk=repair.retest_check_id).update(status="done", verdict="pass")
    repair_advance(actor=staff, repair=repair, to="rejoined")
    fleet.book("beta", ["gpu-001"], tomorrow, end, status="confirmed")  # the repaired node, booked by beta
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "stray_process", "gpu": 0, "pid": 31337}]})
    with django_capture_on_commit_callbacks(execute=True):
        during_beta = health_checks_request(nodes=[fleet.node("gpu-001")], level="quick", trigger="schedule")[0]
    HealthCheck.objects.filter(pk=during_beta.pk).update(created_at=tomorrow + timedelta(hours=1))

    def listed(who, **params):
        response = fleet.client(who).get("/api/v1/health-checks/", params)
        assert response.status_code == 200, response.content
        return {r["id"] for r in response.json()["results"]}

    assert during_beta.pk in listed("beta-lead", node="gpu-001")
    assert during_beta.pk not in listed("alpha-lead")
    envelope(fleet.client("alpha-lead").get(f"/api/v1/health-checks/{during_beta.pk}/"), 404, "not_found")
    envelope(fleet.client("alpha-lead").get("/api/v1/health-checks/", {"node": "gpu-001"}), 400, "invalid")


@pytest.mark.django_db
def test_a_team_swapped_off_a_running_node_reads_its_checks_up_to_the_swap(
        fleet, now_slot, settings, eager, django_capture_on_commit_callbacks):
    """Why the node was swapped stays readable to the team; what the node ran after the swap does not."""
    from django.utils import timezone

    fleet.book("alpha", ["gpu-002"], now_slot, now_slot + timedelta(hours=4))
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-002": [{"kind": "ecc_uncorrected", "gpu": 2}]})
    with django_capture_on_commit_callbacks(execute=True):
        failing = health_checks_request(nodes=[fleet.node("gpu-002")], level="quick", trigger="schedule")[0]
    failing.refresh_from_db()
    assert failing.verdict == "fail" and fleet.node("gpu-002").state == "draining"
    later = health_checks_request(nodes=[fleet.node("gpu-002")], level="quick", trigger="staff",
                                  actor=fleet.users["staff"])[0]
    HealthCheck.objects.filter(pk=later.pk).update(created_at=timezone.now() + timedelta(minutes=5))
    listed = fleet.client("alpha-lead").get("/api/v1/health-checks/", {"node": "gpu-002"})
    assert listed.status_code == 200, listed.content
    assert {r["id"] for r in listed.json()["results"]} == {failing.pk}


@pytest.mark.django_db
def test_the_check_of_a_node_still_serving_another_team_shows_the_next_team_none_of_its_work(
        fleet, settings, eager, now_slot, django_capture_on_commit_callbacks):
    """The acceptance gate checks a node still serving beta (a quick, read-only check) for alpha's booking, which
    starts when beta's ends, and binds the check to alpha's booking: alpha's team read it in full, with beta's
    compute processes (pids, GPU memory) and the kernel-log lines of beta's XIDs (pid, process name)."""
    import json

    from provisioning.health.services import acceptance_verdict

    end = now_slot + timedelta(hours=2)
    fleet.book("beta", ["gpu-003"], now_slot, end)
    alpha = fleet.book("alpha", ["gpu-003"], end, end + timedelta(hours=3), "provisioning")
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-003": [
        {"kind": "stray_process", "gpu": 0, "pid": 31337, "used_mib": 54321},
        {"kind": "xid", "gpu": 1, "xid": 31},
    ]})
    with django_capture_on_commit_callbacks(execute=True):
        acceptance_verdict([fleet.node("gpu-003").pk], level="medium", reservation_id=alpha.pk)
    check = HealthCheck.objects.get(reservation=alpha)
    assert (check.level, check.status) == ("quick", "done")
    response = fleet.client("alpha-lead").get(f"/api/v1/health-checks/{check.pk}/")
    assert response.status_code == 200
    text = json.dumps(response.json())
    assert '"compute_processes"' in text and '"xid"' in text
    assert "31337" not in text and "54321" not in text and "python3" not in text


@pytest.mark.django_db
def test_the_gate_check_of_an_idle_node_shows_the_team_booked_next_a_count_of_stray_processes_not_their_ids(
        fleet, settings, eager, now_slot, monkeypatch, django_capture_on_commit_callbacks):
    """The acceptance gate checks an idle node for alpha's booking and binds the check to it. A process left on
    the node (another team's, say the one booked before) fails the check, and its readings keep the process's
    pid and GPU memory, which alpha's team read in the check's ``gpus`` while the failure's consequences (the
    swap off the node) were still to run. A tenant reads a count of the processes; staff read the pids."""
    import json

    from provisioning.health import services
    from provisioning.health.services import acceptance_verdict

    start, end = now_slot + timedelta(hours=1), now_slot + timedelta(hours=3)
    alpha = fleet.book("alpha", ["gpu-003"], start, end, "provisioning")
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-003": [
        {"kind": "stray_process", "gpu": 0, "pid": 31337, "used_mib": 54321},
    ]})
    # The report is stored; its handling (drain, the swap to a spare) waits for a worker (health_maintain).
    monkeypatch.setattr(services, "health_check_handle", lambda check_id: None)
    with django_capture_on_commit_callbacks(execute=True):
        acceptance_verdict([fleet.node("gpu-003").pk], level="quick", reservation_id=alpha.pk)
    check = HealthCheck.objects.get(reservation=alpha)
    assert (check.status, check.verdict, check.handled_at) == ("done", "fail", None)
    assert "31337" in json.dumps(check.gpu_results)  # stored: staff's view of the stray process

    def processes(body):
        return [c for c in body["gpus"][0]["checks"] if c["name"] == "compute_processes"][0]

    tenant = fleet.client("alpha-lead")
    detail = tenant.get(f"/api/v1/health-checks/{check.pk}/")
    listed = tenant.get("/api/v1/health-checks/", {"node": "gpu-003"})
    assert detail.status_code == 200 and listed.status_code == 200, (detail.content, listed.content)
    [row] = listed.json()["results"]
    for body in (detail.json(), row):
        text = json.dumps(body)
        assert "31337" not in text and "54321" not in text, text
        assert processes(body)["value"] == {"count": 1} and processes(body)["status"] == "fail"
    staff = fleet.client("staff").get(f"/api/v1/health-checks/{check.pk}/").json()
    assert processes(staff)["value"] == [{"pid": 31337, "used_mib": 54321}]


# A check stored from an agent of before the reports counted processes: the pids are in the readings and the
# messages, an XID line names its process, node-level XIDs too.
OLD_GPU_RESULTS = [{
    "index": 0, "uuid": "GPU-0", "serial": "S0", "name": "H100", "pci_bus_id": "0000:18:00.0",
    "verdict": "fail", "action": "drain_and_reset", "passed": [],
    "checks": [
        {"name": "compute_processes", "status": "fail", "value": [{"pid": 4242, "used_mib": 31337},
                                                                 {"pid": 5353, "used_mib": None}],
         "threshold": [], "message": "2 stray compute processes on an idle GPU: pids [4242, 5353]",
         "action": "drain_and_reset"},
        {"name": "xid", "status": "fail", "threshold": "see XID policy", "action": "drain_and_reset",
         "value": [{"xid": 13, "sources": ["kernel_log"], "count": 1, "meaning": "Graphics Engine Exception",
                    "severity": "fail",
                    "detail": "pid=6464, name=secret_train.py, Graphics SM Warp Exception"}],
         "message": "XID 13 x1 (Graphics Engine Exception): pid=6464, name=secret_train.py, Graphics SM"},
    ],
}]
OLD_REPORT = {
    "node_checks": [{"name": "xid_log", "status": "fail", "threshold": "see XID policy", "action": "investigate",
                     "value": [{"xid": 79, "count": 1, "pci": ["0000:2a:00"], "meaning": "GPU has fallen off the bus",
                                "detail": "pid=7575, name=other_job.py, GPU has fallen off the bus."}],
                     "message": "XIDs from GPUs NVML cannot see: XID 79 x1"}],
    "problems": [{"gpu": 0, "check": "compute_processes", "status": "fail", "action": "drain_and_reset",
                  "message": "2 stray compute processes on an idle GPU: pids [4242, 5353]"}],
    "parts_unknown": [],
}
OLD_SECRETS = ("4242", "5353", "31337", "6464", "secret_train", "7575", "other_job")


def old_check(node, reservation):
    return HealthCheck.objects.create(
        node=node, reservation=reservation, level="quick", trigger="acceptance", status="done", verdict="fail",
        recommended_action="drain_and_reset", gpu_results=OLD_GPU_RESULTS, report=OLD_REPORT,
        summary="gpu0 compute_processes: 2 stray compute processes on an idle GPU: pids [4242, 5353]",
    )


@pytest.mark.django_db
def test_a_check_stored_from_an_older_agent_shows_a_tenant_no_process_in_the_api(fleet, now_slot):
    """Rows stored before the agent counted processes keep the pids: the API leaves them out for tenants."""
    import json

    alpha = fleet.book("alpha", ["gpu-003"], now_slot, now_slot + timedelta(hours=3))
    check = old_check(fleet.node("gpu-003"), alpha)
    tenant = fleet.client("alpha-member")
    detail = tenant.get(f"/api/v1/health-checks/{check.pk}/").json()
    [row] = tenant.get("/api/v1/health-checks/", {"cluster": make_cluster(alpha).pk}).json()["results"]
    for body in (detail, row):
        text = json.dumps(body)
        assert not [s for s in OLD_SECRETS if s in text], text
        checks = {c["name"]: c for c in body["gpus"][0]["checks"]}
        assert checks["compute_processes"]["value"] == {"count": 2}
        assert "2 stray compute processes" in checks["compute_processes"]["message"]
        assert "Graphics SM Warp Exception" in checks["xid"]["value"][0]["detail"]
    assert "fallen off the bus" in detail["report"]["node_checks"][0]["value"][0]["detail"]
    staff = json.dumps(fleet.client("staff").get(f"/api/v1/health-checks/{check.pk}/").json())
    assert all(s in staff for s in OLD_SECRETS)
    HealthCheck.objects.filter(pk=check.pk).update(gpu_results=OLD_GPU_RESULTS)
    check.refresh_from_db()
    assert check.gpu_results == OLD_GPU_RESULTS  # redacted on the way out, never in the database


def test_a_check_as_a_tenant_reads_it_cannot_be_saved_over_the_stored_report(fleet, now_slot):
    """The redacted copy a tenant reads is no row to write: saving it by mistake would lose the report."""
    from provisioning.health.selectors import check_as_seen_by

    alpha = fleet.book("alpha", ["gpu-003"], now_slot, now_slot + timedelta(hours=3))
    check = old_check(fleet.node("gpu-003"), alpha)
    seen = check_as_seen_by(fleet.users["alpha-member"], check)
    with pytest.raises(RuntimeError, match="never save"):
        seen.save()
    check.refresh_from_db()
    assert check.gpu_results == OLD_GPU_RESULTS
    assert check_as_seen_by(fleet.users["staff"], check) is check  # staff read (and may save) the row itself


@pytest.mark.django_db
def test_a_tools_error_reaches_a_tenant_without_the_credentials_it_carried(fleet, now_slot):
    """A check's error and messages are a tool's output or an exception's text: a BMC URL with its password, a token.
    Tenants read them without (portal.core.redact.without_secrets); staff read them whole."""
    import json

    alpha = fleet.book("alpha", ["gpu-003"], now_slot, now_slot + timedelta(hours=3))
    secret_url = "https://ops:hunter2@bmc-17.internal/redfish/v1"
    check = HealthCheck.objects.create(
        node=fleet.node("gpu-003"), reservation=alpha, level="quick", trigger="acceptance", status="done",
        verdict="fail", recommended_action="investigate", error=f"ConnectionError ({secret_url})",
        summary="gpu0 ecc: fetch failed token=ab12cd34ef56",
        report={"problems": [{"gpu": 0, "check": "ecc", "status": "fail", "message": f"GET {secret_url} 401"}]},
        gpu_results=[{"index": 0, "checks": [{"name": "ecc", "status": "unknown", "value": None,
                                              "message": f"GET {secret_url} failed: password=s3cr3tpw"}]}],
    )
    tenant = fleet.client("alpha-member")
    body = json.dumps(tenant.get(f"/api/v1/health-checks/{check.pk}/").json())
    for secret in ("hunter2", "ab12cd34ef56", "s3cr3tpw"):
        assert secret not in body, body
    assert "bmc-17.internal/redfish/v1" in body and "[redacted]" in body
    staff = json.dumps(fleet.client("staff").get(f"/api/v1/health-checks/{check.pk}/").json())
    assert "hunter2" in staff and "s3cr3tpw" in staff
