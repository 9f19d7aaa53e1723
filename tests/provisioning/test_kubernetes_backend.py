"""The Kubernetes backend through the real `kubernetes` client against the loopback API server.

No API server runs here (see provisioning/backends/k8s_apply.py for what was and was not
tried): the loopback server records what the client sends and answers like the API server.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import yaml
from django.utils import timezone

from provisioning import crypto, services
from provisioning.backends import k8s_manifests as m
from provisioning.models import ClusterCredential, VirtualCluster
from reservations.models import Allocation
from tests.k8s.conftest import api_server, make_node, make_pdb, make_pod, make_spec  # noqa: F401 - the loopback fixture

from .conftest import book, loopback_k8s, tenant_tears_down_during

pytestmark = pytest.mark.django_db


@pytest.fixture
def k8s(api_server, world, tmp_path, settings):  # noqa: F811 - the imported fixture
    return loopback_k8s(api_server, world, tmp_path, settings, backend="slurm,kubernetes")


def test_a_kubernetes_cluster_is_applied_with_a_kubeconfig_and_torn_down(world, t0, k8s):
    reservation = book(world, "alpha-lead", t0, hours=4, nodes=2, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(hours=3))  # creates the pending cluster
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert cluster.backend == "kubernetes"  # chosen per orchestrator from "slurm,kubernetes"
    services.cluster_configure(actor=world.users["alpha-lead"], cluster=cluster, mig_profile="1g.10gb",
                               default_memory_per_gpu_gib=96)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    cluster.refresh_from_db()

    namespace = f"tenant-alpha-r{reservation.pk}"
    assert cluster.connection["namespace"] == namespace and cluster.connection["api_server"] == k8s.url
    applied = [r for r in k8s.of("PATCH") if r.headers["content-type"] == "application/apply-patch+yaml"]
    kinds = [yaml.safe_load(r.body)["kind"] for r in applied]
    assert kinds[:1] == ["Namespace"] and kinds[-1] == "PersistentVolumeClaim" and "NetworkPolicy" in kinds
    quota = next(yaml.safe_load(r.body) for r in applied if yaml.safe_load(r.body)["kind"] == "ResourceQuota")
    assert quota["spec"]["hard"]["requests.nvidia.com/mig-1g.10gb"] == str(2 * 8 * 7)
    assert all(r.headers["authorization"] == "Bearer portal-admin-token" for r in k8s.requests)
    for host in Allocation.objects.filter(reservation=reservation).values_list("node__hostname", flat=True):
        node = k8s.nodes[host]
        assert node["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)
        assert {"key": "dedicated", "value": "alpha", "effect": "NoSchedule"} in node["spec"]["taints"]
        assert node["metadata"]["labels"][m.MIG_CONFIG_LABEL] == "all-1g.10gb"

    credential = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    kubeconfig = yaml.safe_load(crypto.decrypt(credential.ciphertext))
    assert kubeconfig["users"][0]["user"]["token"] == f"token-for-{namespace}-tenant-admin"
    assert kubeconfig["contexts"][0]["context"]["namespace"] == namespace
    assert "token-for" not in credential.ciphertext
    response = world.client("alpha-member").get(f"/api/v1/clusters/{cluster.pk}/credentials/kubeconfig/")
    assert response.status_code == 200 and yaml.safe_load(response.content)["current-context"]

    services.lifecycle_tick(now=t0 + timedelta(hours=4))
    k8s.terminating_reads = 1  # the namespace takes a moment to go: teardown polls
    with pytest.raises(services.RetryLater):
        services.cluster_teardown(cluster_id=cluster.pk)
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert namespace not in k8s.namespaces
    assert all(m.RESERVATION_LABEL not in n["metadata"]["labels"] for n in k8s.nodes.values())


def test_a_node_held_by_someone_else_is_retried_then_fails(world, t0, k8s, settings):
    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"
    reservation = book(world, "beta-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    host = Allocation.objects.get(reservation=reservation).node.hostname
    k8s.nodes[host] = make_node(host, taints=[{"key": "dedicated", "value": "someone", "effect": "NoSchedule"}])
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    cluster.refresh_from_db()
    assert "allocating_nodes: claim nodes" in cluster.status_reason and "taint" in cluster.status_reason


def test_a_refusal_no_retry_changes_fails_at_once_and_an_outage_is_retried(world, t0, k8s, settings):
    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "5"
    reservation = book(world, "beta-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    host = Allocation.objects.get(reservation=reservation).node.hostname
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)

    k8s.inject[("GET", f"/api/v1/nodes/{host}")] = [503]  # the API server overloaded: try again later
    with pytest.raises(services.RetryLater):
        services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "allocating_nodes" and cluster.attempts == 1

    # The booked node is not in the Kubernetes cluster: no retry makes it appear, so the tenant is told now
    # instead of after every attempt's backoff.
    del k8s.nodes[host]
    VirtualCluster.objects.filter(pk=cluster.pk).update(next_attempt_at=None)
    assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    cluster.refresh_from_db()
    assert cluster.attempts == 2 and f"claim node {host} failed: 404" in cluster.status_reason


def test_back_to_back_bookings_wait_for_the_node_instead_of_failing(world, t0, k8s, settings):
    # B starts where A ends, on the same nodes. B provisions its lead time ahead, while A still holds them:
    # that is the normal hand-over, not a failure, and must not spend B's attempts.
    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "2"
    first = book(world, "alpha-lead", t0 - timedelta(hours=2), hours=2, nodes=3, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(hours=2, minutes=10))
    assert services.cluster_provision(cluster_id=VirtualCluster.objects.get(reservation=first).pk) == "ready"
    second = book(world, "beta-lead", t0, hours=2, nodes=3, orchestrator="kubernetes")
    shared = set(Allocation.objects.filter(reservation=first).values_list("node__hostname", flat=True)) & set(
        Allocation.objects.filter(reservation=second).values_list("node__hostname", flat=True))
    assert shared
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=second)
    for _ in range(3):
        with pytest.raises(services.RetryLater):
            services.cluster_provision(cluster_id=cluster.pk)
        cluster.refresh_from_db()
        assert (cluster.status, cluster.attempts) == ("allocating_nodes", 0)
        assert cluster.next_attempt_at is not None
        VirtualCluster.objects.filter(pk=cluster.pk).update(next_attempt_at=None)
    assert all(k8s.nodes[h]["metadata"]["labels"][m.RESERVATION_LABEL] == str(first.pk) for h in shared)

    services.lifecycle_tick(now=t0)  # A's window is over: its teardown gives the nodes back
    first_cluster = VirtualCluster.objects.get(reservation=first)
    assert services.cluster_teardown(cluster_id=first_cluster.pk) == "deleted"
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    assert all(k8s.nodes[h]["metadata"]["labels"][m.RESERVATION_LABEL] == str(second.pk) for h in shared)


def test_without_a_kubeconfig_the_backend_renders_only(world, t0, settings):
    settings.PORTAL_PROVISIONING_BACKEND = "kubernetes"
    settings.PORTAL_K8S_KUBECONFIG = ""
    reservation = book(world, "alpha-lead", t0, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    cluster.refresh_from_db()
    assert "render-only" in cluster.transitions.get(phase="configuring_network").detail
    assert not ClusterCredential.objects.filter(cluster=cluster, kind="kubeconfig").exists()


# --- reconcile ---------------------------------------------------------------------------------


def ready_k8s_cluster(world, t0, who: str = "alpha-lead", nodes: int = 2):
    reservation = book(world, who, t0, hours=4, nodes=nodes, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    return reservation, cluster


def held_hosts(reservation) -> list[str]:
    return sorted(Allocation.objects.filter(reservation=reservation, active=True)
                  .values_list("node__hostname", flat=True))


def claim_by_hand(server, host: str, *, reservation_id: int, tenant: str,
                  window_end: str = "2099-01-01T00:00:00Z", extra_taints=()) -> None:
    """Put a claim on a node as node_claim_patch does (what a teardown or swap that died left behind)."""
    node = server.nodes[host]
    node["metadata"]["labels"].update({m.TENANT_LABEL: tenant, m.RESERVATION_LABEL: str(reservation_id),
                                       m.CUDA_VERSION_LABEL: "12.8"})
    node["metadata"]["annotations"][m.WINDOW_END_ANNOTATION] = window_end
    node["spec"]["taints"] = [*node["spec"]["taints"], *extra_taints,
                              {"key": "dedicated", "value": tenant, "effect": "NoSchedule"}]


def is_claimed(server, host: str) -> bool:
    node = server.nodes[host]
    return (m.RESERVATION_LABEL in node["metadata"]["labels"] or m.WINDOW_END_ANNOTATION in
            node["metadata"]["annotations"] or any(t["key"] == "dedicated" for t in node["spec"]["taints"]))


def test_reconcile_lifts_node_claims_of_reservations_that_are_not_live(world, t0, k8s, capsys):
    """A claim left behind (a teardown that died after deleting the namespace) kept the node tainted
    dedicated=<tenant> until its window-end annotation: `reconcile --fix` only deleted orphan namespaces."""
    from django.core.management import call_command

    reservation, _cluster = ready_k8s_cluster(world, t0)
    live = held_hosts(reservation)
    spare = sorted({n.hostname for n in world.nodes} - set(live))
    # A dead reservation's claim whose namespace is gone; a foreign taint beside it must stay.
    operator_taint = {"key": "maintenance", "value": "bios", "effect": "NoSchedule"}
    claim_by_hand(k8s, spare[0], reservation_id=99999, tenant="beta", extra_taints=[operator_taint])
    # A node an operator dedicated by hand (no portal labels): not ours.
    foreign = {"key": "dedicated", "value": "ops-team", "effect": "NoSchedule"}
    k8s.nodes[spare[1]]["spec"]["taints"].append(foreign)

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    out = capsys.readouterr().out
    assert f"kubernetes: orphan {spare[0]}: claimed for reservation 99999 (tenant beta)" in out, out
    assert "1 drift, 0 repaired" in out
    assert is_claimed(k8s, spare[0])  # report only

    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    released = k8s.nodes[spare[0]]
    assert not is_claimed(k8s, spare[0])
    assert operator_taint in released["spec"]["taints"]
    assert not any(k.startswith("gpuportal.io/") for k in released["metadata"]["labels"])
    assert foreign in k8s.nodes[spare[1]]["spec"]["taints"]  # a dedicated taint the portal did not set
    for host in live:  # the live reservation's claims are untouched
        assert k8s.nodes[host]["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)
        assert {"key": "dedicated", "value": "alpha", "effect": "NoSchedule"} in k8s.nodes[host]["spec"]["taints"]
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out


def test_reconcile_lifts_an_orphan_claim_only_once_its_namespace_is_gone(world, t0, k8s, capsys):
    from django.core.management import call_command

    host = world.nodes[-1].hostname
    claim_by_hand(k8s, host, reservation_id=99998, tenant="beta")
    namespace = "tenant-beta-r99998"
    k8s.namespaces[namespace] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.RESERVATION_LABEL: "99998"}}}
    k8s.terminating_reads = 1  # still terminating on the first read after the delete

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert f"orphan {namespace}: namespace has no live booking (repaired)" in out
    assert f"released once namespace {namespace} is gone (found)" in out
    assert is_claimed(k8s, host)  # a tenant pod may still be on it

    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert namespace not in k8s.namespaces and not is_claimed(k8s, host)


def test_reconcile_again_while_an_orphan_namespace_terminates_is_not_an_error(world, k8s, capsys):
    """The registry answers 409 to a second DELETE while the namespace's finalizers run: that aborted
    the whole reconcile ("backend unreachable")."""
    from django.core.management import call_command

    namespace = "tenant-beta-r99997"
    k8s.namespaces[namespace] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.RESERVATION_LABEL: "99997"}}}
    k8s.terminating_reads = 5
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "0 drifts" in capsys.readouterr().out  # going already: nothing to do
    assert [r.path for r in k8s.of("DELETE")] == [f"/api/v1/namespaces/{namespace}"]


def fail_node(world, host: str) -> dict:
    from reservations.choices import NodeState
    from reservations.models import Node
    from reservations.services import node_update

    node = Node.objects.get(hostname=host)
    node_update(actor=world.users["staff"], node=node, state=NodeState.FAILED, reason="XID 79")
    return services.node_sync(node_id=node.pk)


def test_a_node_lost_with_no_spare_loses_the_tenants_claim(world, t0, k8s):
    """The node set shrank (update_window re-applied the rest) but the lost node kept the reservation's label
    and the tenant's taint: the namespace's node selector still sent the tenant's pods to the failed node."""
    from reservations.choices import NodeState
    from reservations.models import Node

    reservation, cluster = ready_k8s_cluster(world, t0)
    kept, lost = held_hosts(reservation)
    Node.objects.exclude(hostname__in=(kept, lost)).update(state=NodeState.MAINTENANCE)  # no spare
    assert fail_node(world, lost) == {"degraded": 1}
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=lost, spare=None) == "degraded"

    assert not is_claimed(k8s, lost)
    assert k8s.nodes[kept]["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)


def half_failed_swap(world, t0, k8s):
    """A ready cluster whose node failed and whose swap failed half-way (releasing the failed node got a 500):
    the cluster is degraded, the claim still on the failed node and none on the spare.
    Returns (reservation, cluster, failed host, spare host)."""
    reservation, cluster = ready_k8s_cluster(world, t0)
    before = held_hosts(reservation)
    bad = before[0]
    assert fail_node(world, bad) == {"replaced": 1}
    [spare] = set(held_hosts(reservation)) - set(before)
    k8s.inject[("PATCH", f"/api/v1/nodes/{bad}")] = [500]
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=bad, spare=spare) == "degraded"
    return reservation, cluster, bad, spare


def test_reconcile_puts_the_claims_on_the_node_set_a_failed_swap_left_behind(world, t0, k8s, capsys):
    """A swap that failed half-way (releasing the failed node got a 500) degraded the cluster and left the
    claim on the failed node and none on the spare; reconcile checked only that the namespace existed."""
    from django.core.management import call_command

    reservation, cluster, bad, spare = half_failed_swap(world, t0, k8s)
    assert is_claimed(k8s, bad) and not is_claimed(k8s, spare)

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    out = capsys.readouterr().out
    assert f"kubernetes: mismatch {bad}: claimed for reservation {reservation.pk}, which no longer holds it" in out
    assert f"kubernetes: missing {spare}: not claimed for reservation {reservation.pk}" in out
    assert "2 drifts, 0 repaired" in out

    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "2 drifts, 2 repaired" in capsys.readouterr().out
    assert not is_claimed(k8s, bad)
    for host in held_hosts(reservation):
        assert k8s.nodes[host]["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)
        assert {"key": "dedicated", "value": "alpha", "effect": "NoSchedule"} in k8s.nodes[host]["spec"]["taints"]
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out


def test_an_unreachable_api_server_is_a_backend_error_not_a_crash(world, t0, k8s, settings, tmp_path, capsys):
    """Connection refused came out of the kubernetes client as urllib3's MaxRetryError, which the backend
    did not turn into a BackendError: the provisioning task died with a traceback instead of counting a
    failed attempt and retrying, and `reconcile` crashed instead of saying the backend is unreachable."""
    import socket

    from django.core.management import call_command

    reservation = book(world, "alpha-lead", t0, hours=4, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kubeconfig = tmp_path / "unreachable-kubeconfig"
    kubeconfig.write_text(m.kubeconfig_yaml(make_spec(api_server_url=f"http://127.0.0.1:{port}"), "t"))
    settings.PORTAL_K8S_KUBECONFIG = str(kubeconfig)

    with pytest.raises(services.RetryLater, match="unreachable"):
        services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.attempts == 1 and "unreachable" in cluster.last_error

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert "kubernetes: unreachable kubernetes: backend unreachable: " in out and "1 drift, 0 repaired" in out


def test_reconcile_fix_reports_a_refused_claim_and_still_makes_the_other_repairs(world, t0, k8s, capsys):
    """The spare now carries a dedicated taint the portal did not set: claiming it is refused. That raised
    out of reconcile ('backend unreachable'), hiding the stale claim it had just lifted."""
    from django.core.management import call_command

    reservation, cluster, bad, spare = half_failed_swap(world, t0, k8s)
    foreign = {"key": "dedicated", "value": "ops-team", "effect": "NoSchedule"}
    k8s.nodes[spare]["spec"]["taints"].append(foreign)

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert f"mismatch {bad}: claimed for reservation {reservation.pk}, which no longer holds it (repaired)" in out
    assert f"missing {spare}: not claimed for reservation {reservation.pk}; repair failed: claim node: " in out
    assert "2 drifts, 1 repaired" in out, out
    assert not is_claimed(k8s, bad) and foreign in k8s.nodes[spare]["spec"]["taints"]


def test_reconcile_renews_a_claim_whose_window_end_is_stale(world, t0, k8s, capsys):
    """An extension whose sync was lost left the nodes annotated with the old window end, after which any
    other reservation's claim takes the nodes over (node_claim_patch treats the claim as lapsed). Reconcile
    compared nothing but the namespace, so this was no drift."""
    from django.core.management import call_command

    from reservations.services import reservation_update

    reservation, cluster = ready_k8s_cluster(world, t0)
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=8))
    new_end = (t0 + timedelta(hours=8)).strftime("%Y-%m-%dT%H:%M:%SZ")
    hosts = held_hosts(reservation)
    assert all(k8s.nodes[h]["metadata"]["annotations"][m.WINDOW_END_ANNOTATION] != new_end for h in hosts)

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    out = capsys.readouterr().out
    for host in hosts:
        assert f"kubernetes: mismatch {host}: claim for reservation {reservation.pk} ends " in out, out
    # The namespace's own window-end annotation is as stale.
    assert (f"kubernetes: mismatch Namespace/tenant-alpha-r{reservation.pk}: differs from what the portal applies "
            f"at .metadata.annotations.{m.WINDOW_END_ANNOTATION}") in out, out
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert f"{len(hosts) + 1} drifts, {len(hosts) + 1} repaired" in capsys.readouterr().out
    assert all(k8s.nodes[h]["metadata"]["annotations"][m.WINDOW_END_ANNOTATION] == new_end for h in hosts)
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out


def test_reconcile_leaves_a_reservation_booked_after_its_snapshot_alone(world, t0, k8s, settings):
    """What looks orphaned in the cluster is asked about again (live): a reservation provisioned between the
    database read and the cluster read has a namespace and claims there but is not in `wanted`."""
    from provisioning.backends.kubernetes import KubernetesBackend

    host = world.nodes[-1].hostname
    claim_by_hand(k8s, host, reservation_id=4242, tenant="beta")
    namespace = "tenant-beta-r4242"
    k8s.namespaces[namespace] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.RESERVATION_LABEL: "4242"}}}
    backend = KubernetesBackend()
    try:
        asked: list[int] = []
        drifts = backend.reconcile([], fix=True, live=lambda rid: asked.append(rid) or rid == 4242)
    finally:
        backend.close()
    assert 4242 in asked and drifts == []
    assert namespace in k8s.namespaces and is_claimed(k8s, host)
    assert not k8s.of("DELETE")


def test_an_extended_bookings_kubeconfig_lasts_to_the_new_end(world, t0, k8s):
    """The tenant's token was issued to expire with the booked window: after an extension the stored
    kubeconfig stopped working at the old end. The window change issues one for the new end."""
    from reservations.services import reservation_update

    reservation, cluster = ready_k8s_cluster(world, t0)
    first = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    tokens_before = len([r for r in k8s.of("POST") if r.path.endswith("/token")])
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation,
                       end=reservation.period.upper + timedelta(hours=6))
    assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    requests = [r for r in k8s.of("POST") if r.path.endswith("/token")]
    assert len(requests) == tokens_before + 1
    asked = json.loads(requests[-1].body)["spec"]["expirationSeconds"]
    assert asked >= (reservation.period.upper + timedelta(hours=6) - timezone.now()).total_seconds() - 120
    current = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    assert current.pk != first.pk
    first.refresh_from_db()
    assert first.revoked_at is not None and first.ciphertext == ""
    assert yaml.safe_load(crypto.decrypt(current.ciphertext))["users"][0]["user"]["token"]


def test_reconcile_rebuilding_a_lost_namespace_gives_the_tenant_a_working_kubeconfig(world, t0, k8s):
    """The rebuilt namespace has a new ServiceAccount, so the stored kubeconfig's token was dead while
    reconcile said "repaired". The repair issues a new one and the cluster page serves it."""
    reservation, cluster = ready_k8s_cluster(world, t0)
    old = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    namespace = f"tenant-alpha-r{reservation.pk}"
    del k8s.namespaces[namespace]  # lost (deleted by hand, a cluster restored from an old backup)
    tokens_before = len([r for r in k8s.of("POST") if r.path.endswith("/token")])

    drifts = services.reconcile(fix=True, backend_name="kubernetes")
    assert [(d["kind"], d["name"], d["repaired"]) for d in drifts] == [("missing", namespace, True)]
    assert namespace in k8s.namespaces
    assert len([r for r in k8s.of("POST") if r.path.endswith("/token")]) == tokens_before + 1
    current = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    assert current.pk != old.pk
    old.refresh_from_db()
    assert old.revoked_at is not None
    assert "token" not in str(drifts)  # the secret never reaches the report


def test_reconcile_rebuilding_a_lost_namespace_keeps_the_new_tokens_expiry(world, t0, k8s, monkeypatch):
    """The rebuild issues a new token, but only its kubeconfig was kept: backend_state still held the old
    token's issue and expiry times (and a renewal already asked for), so the tick renewed the new token on the
    old one's schedule: early, or never when the old token was not capped and the new one is. The repair keeps
    the new token's times with its kubeconfig, as a sync does."""
    k8s.token_max_seconds = 3600
    reservation, cluster = ready_k8s_cluster(world, t0)
    now = timezone.now()
    stale = {"token_issued_at": (now - timedelta(minutes=58)).isoformat(),
             "token_expires_at": (now + timedelta(minutes=2)).isoformat(),
             "token_renewal_asked_at": (now - timedelta(minutes=5)).isoformat()}
    VirtualCluster.objects.filter(pk=cluster.pk).update(backend_state={**cluster.backend_state, **stale})
    del k8s.namespaces[f"tenant-alpha-r{reservation.pk}"]

    drifts = services.reconcile(fix=True, backend_name="kubernetes")
    assert [(d["kind"], d["repaired"]) for d in drifts] == [("missing", True)]
    cluster.refresh_from_db()
    issued = timezone.datetime.fromisoformat(cluster.backend_state["token_issued_at"])
    expires = timezone.datetime.fromisoformat(cluster.backend_state["token_expires_at"])
    assert abs(issued - timezone.now()) < timedelta(minutes=1)
    assert timedelta(minutes=55) < expires - timezone.now() <= timedelta(hours=1)
    assert cluster.backend_state["token_renewal_asked_at"] is None

    sent: list = []
    monkeypatch.setattr(services, "_send", lambda name, *args, countdown=None: sent.append((name, args)))
    services.lifecycle_tick(now=timezone.now() + timedelta(minutes=10))
    assert ("sync_reservation", (reservation.pk,)) not in sent  # the new token is not due yet
    services.lifecycle_tick(now=expires - timedelta(minutes=10))
    assert sent.count(("sync_reservation", (reservation.pk,))) == 1  # and is renewed on its own schedule


def test_a_node_out_of_service_is_cordoned_and_uncordoned_when_back(world, t0, k8s):
    """The Kubernetes backend had no drain: a failed node stayed schedulable for the tenant's pods."""
    from reservations.choices import NodeState
    from reservations.models import Node
    from reservations.services import node_update

    host = world.nodes[0].hostname
    fail_node(world, host)
    node = k8s.nodes[host]
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][m.CORDON_ANNOTATION].startswith("failed: XID 79")
    node_update(actor=world.users["staff"], node=Node.objects.get(hostname=host), state=NodeState.AVAILABLE,
                reason="")
    services.node_sync(node_id=Node.objects.get(hostname=host).pk)
    node = k8s.nodes[host]
    assert not node["spec"].get("unschedulable") and m.CORDON_ANNOTATION not in node["metadata"].get("annotations", {})


def test_an_operators_cordon_is_left_alone_and_reported(world, k8s, capsys):
    from django.core.management import call_command

    from reservations.choices import NodeState
    from reservations.models import Node

    host = world.nodes[1].hostname
    k8s.nodes[host]["spec"]["unschedulable"] = True  # an operator's kubectl cordon
    services.node_sync(node_id=Node.objects.get(hostname=host).pk)  # available in the portal: resume
    assert k8s.nodes[host]["spec"]["unschedulable"] is True
    # A node failed in the portal whose cordon never reached the cluster (the sync was lost).
    lost = world.nodes[2].hostname
    Node.objects.filter(hostname=lost).update(state=NodeState.MAINTENANCE)
    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert f"node {host}: portal says available, cordoned by someone else" in out
    assert f"node {lost}: portal says maintenance, the node is schedulable (repaired)" in out
    assert k8s.nodes[lost]["spec"]["unschedulable"] is True
    assert k8s.nodes[host]["spec"]["unschedulable"] is True  # still the operator's


def test_a_teardown_in_progress_is_no_drift(world, t0, k8s, capsys):
    """While a torn-down cluster's namespace terminates its nodes keep the claim (teardown lifts it once the
    namespace is gone): reconcile reported that as unrepaired drift (exit 1) every run meanwhile."""
    from django.core.management import call_command

    host = world.nodes[-1].hostname
    claim_by_hand(k8s, host, reservation_id=99996, tenant="beta")
    namespace = "tenant-beta-r99996"
    k8s.namespaces[namespace] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "deletionTimestamp": "2026-12-02T01:00:00Z",
        "labels": {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.RESERVATION_LABEL: "99996"}}}
    call_command("reconcile", "--backend", "kubernetes", "--fix")  # exit 0: no SystemExit
    assert "0 drifts" in capsys.readouterr().out
    assert is_claimed(k8s, host) and not k8s.of("DELETE")
    del k8s.namespaces[namespace]  # gone: a claim left now is a real orphan
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert not is_claimed(k8s, host)


def put_pods(server, *pods) -> None:
    for pod in pods:
        server.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod


def terminating(server, namespace: str, name: str) -> bool:
    return bool(server.pods[(namespace, name)]["metadata"].get("deletionTimestamp"))


def test_a_failed_node_is_drained_of_the_tenants_pods(world, t0, k8s):
    """A drain only cordoned the node: the tenant's pods kept running on the failing GPU. The tenant's pods
    on that node are evicted through the Eviction API; its DaemonSet pods, its pods on other nodes and
    everything outside the portal's tenant namespaces stay. A second sync evicts nothing twice."""
    reservation, _cluster = ready_k8s_cluster(world, t0)
    bad, good = held_hosts(reservation)
    namespace = f"tenant-alpha-r{reservation.pk}"
    put_pods(k8s, make_pod("train-0", namespace, bad), make_pod("train-1", namespace, bad),
             make_pod("exporter", namespace, bad, owner_kind="DaemonSet"),
             make_pod("train-2", namespace, good), make_pod("nvidia-driver", "gpu-operator", bad))

    assert fail_node(world, bad) == {"replaced": 1}
    assert k8s.nodes[bad]["spec"]["unschedulable"] is True
    evictions = sorted(r.path for r in k8s.of("POST") if r.path.endswith("/eviction"))
    assert evictions == [f"/api/v1/namespaces/{namespace}/pods/train-{i}/eviction" for i in (0, 1)]
    assert terminating(k8s, namespace, "train-0") and terminating(k8s, namespace, "train-1")
    assert not terminating(k8s, namespace, "exporter") and not terminating(k8s, namespace, "train-2")
    assert not terminating(k8s, "gpu-operator", "nvidia-driver")

    from reservations.models import Node
    assert services.node_sync(node_id=Node.objects.get(hostname=bad).pk) == {}  # delivered twice
    assert len([r for r in k8s.of("POST") if r.path.endswith("/eviction")]) == 2


def test_a_pod_its_disruption_budget_keeps_is_retried_and_reported_until_evicted(world, t0, k8s, capsys):
    """A 429 from pods/eviction means "not now": the drain says so (the task tries again), reconcile reports
    the pod still on the failed node (also once the claim was lifted) and evicts it once the budget allows."""
    from django.core.management import call_command

    from reservations.models import Node

    reservation, _cluster = ready_k8s_cluster(world, t0)
    before = held_hosts(reservation)
    bad = before[0]
    namespace = f"tenant-alpha-r{reservation.pk}"
    put_pods(k8s, make_pod("serve-0", namespace, bad, labels={"app": "serve"}), make_pod("train-0", namespace, bad))
    k8s.pdbs[(namespace, "serve")] = make_pdb("serve", namespace, {"app": "serve"}, disruptions_allowed=0)

    with pytest.raises(services.RetryLater,
                       match=f"1 tenant pod not evicted: {namespace}/serve-0: its PodDisruptionBudget allows no"):
        fail_node(world, bad)
    assert terminating(k8s, namespace, "train-0") and not terminating(k8s, namespace, "serve-0")
    [spare] = set(held_hosts(reservation)) - set(before)  # the booking moved to a spare all the same
    services.cluster_nodes_changed(reservation_id=reservation.pk, failed=bad, spare=spare)
    assert not is_claimed(k8s, bad)  # the claim is gone; the pod is not

    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert (f"kubernetes: node {bad}: portal says failed, cordoned; 1 tenant pod still on it: "
            f"{namespace}/serve-0; repair failed:") in out, out
    assert "1 drift, 0 repaired" in out

    k8s.pdbs[(namespace, "serve")]["status"]["disruptionsAllowed"] = 1  # its replacement is ready elsewhere
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert terminating(k8s, namespace, "serve-0")
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out
    assert services.node_sync(node_id=Node.objects.get(hostname=bad).pk) == {}  # the task's retry: done


def test_a_cluster_left_with_no_nodes_keeps_an_empty_namespace_and_reconcile_converges(world, t0, k8s, capsys):
    """Every node of a Kubernetes booking failed with no spare free. The backend could not even build the
    spec ("node_hostnames is empty"): cluster_nodes_changed did nothing, so the lost node kept the tenant's
    label and taint (the namespace's pods still landed there), and reconcile reported an `unknown` drift on
    every run (exit 1, an alert nobody could clear). A cluster with no node keeps its namespace (the
    tenant's data and kubeconfig) with a quota of zero GPUs and zero pods, and claims no node."""
    from django.core.management import call_command

    reservation, cluster = ready_k8s_cluster(world, t0, nodes=1)
    [lost] = held_hosts(reservation)
    book(world, "beta-lead", t0, hours=4, nodes=len(world.nodes) - 1)  # no spare free
    assert fail_node(world, lost) == {"degraded": 1}
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=lost, spare=None) == "degraded"

    namespace = f"tenant-alpha-r{reservation.pk}"
    assert not is_claimed(k8s, lost)
    assert namespace in k8s.namespaces
    quota = [yaml.safe_load(r.body) for r in k8s.of("PATCH", f"/api/v1/namespaces/{namespace}/resourcequotas/")]
    assert quota[-1]["spec"]["hard"]["requests.nvidia.com/gpu"] == "0" and quota[-1]["spec"]["hard"]["pods"] == "0"
    assert ClusterCredential.objects.current().filter(cluster=cluster, kind="kubeconfig").exists()

    call_command("reconcile", "--backend", "kubernetes")  # exit 0: no SystemExit
    assert "0 drifts" in capsys.readouterr().out

    # A claim left behind on the lost node (the sync was lost) is a drift --fix repairs, then none.
    claim_by_hand(k8s, lost, reservation_id=reservation.pk, tenant="alpha")
    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    assert f"mismatch {lost}: claimed for reservation {reservation.pk}, which no longer holds it" in \
        capsys.readouterr().out
    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert not is_claimed(k8s, lost)
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out

    # The window ends: the empty cluster is torn down like any other.
    services.lifecycle_tick(now=t0 + timedelta(hours=4))
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert namespace not in k8s.namespaces


def test_node_swaps_applied_out_of_order_leave_the_claims_on_the_booked_nodes(world, t0, k8s):
    """Node A failed (the booking moved to spare S), then S failed (moved to T). The two swap tasks can run in
    either order (each retries while the cluster is busy). swap_node released `old` and claimed `new` as told:
    run second, A -> S claimed S again, a failed node the booking no longer holds, for the tenant until its
    window ended (another booking given S back could not claim it). The swap converges on the booking's node
    set instead."""
    reservation, _cluster = ready_k8s_cluster(world, t0, nodes=1)
    [a] = held_hosts(reservation)
    assert fail_node(world, a) == {"replaced": 1}
    [s] = held_hosts(reservation)
    assert fail_node(world, s) == {"replaced": 1}
    [t] = held_hosts(reservation)

    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=s, spare=t) == "replaced"
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=a, spare=s) == "replaced"
    assert not is_claimed(k8s, a) and not is_claimed(k8s, s)
    assert k8s.nodes[t]["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)


def test_teardown_lifts_every_claim_of_the_reservation_also_on_a_node_it_no_longer_holds(world, t0, k8s):
    """A swap that failed half-way (releasing the failed node got a 500) left the reservation's claim on a node
    it no longer holds. Teardown released only the nodes the booking holds now: that node kept the tenant's
    label and dedicated taint after the cluster was deleted, and a booking given it could not claim it until
    the old window ended (or someone ran reconcile --fix)."""
    reservation, cluster, bad, spare = half_failed_swap(world, t0, k8s)
    assert is_claimed(k8s, bad)

    services.lifecycle_tick(now=t0 + timedelta(hours=4))
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert not [host for host in k8s.nodes if is_claimed(k8s, host)]


@pytest.mark.django_db(transaction=True)
def test_reconcile_fix_never_rebuilds_a_namespace_or_claims_a_teardown_removed_meanwhile(world, t0, k8s):
    """reconcile --fix read a ready cluster whose namespace was lost; the tenant's teardown then ran to the end
    (claims lifted, deleted); the repair rebuilt the namespace and claimed the nodes again for a cluster that
    no longer exists, the nodes tainted dedicated to it until its window's end (the next tenant's claims
    refused). Now each repair of a cluster runs under its lock, only while it is still wanted."""
    from provisioning.backends.kubernetes import KubernetesBackend

    reservation, cluster = ready_k8s_cluster(world, t0)
    namespace = f"tenant-alpha-r{reservation.pk}"
    del k8s.namespaces[namespace]  # lost: reconcile would rebuild it
    with tenant_tears_down_during(KubernetesBackend, "reconcile", actor=world.users["alpha-lead"],
                                  cluster=cluster) as seen:
        services.reconcile(fix=True, backend_name="kubernetes")
    assert seen["teardown"] == "deleted"
    assert namespace not in k8s.namespaces
    assert not any(is_claimed(k8s, node.hostname) for node in world.nodes)


def test_a_claim_conflict_never_shows_the_tenant_another_tenants_booking(world, t0, k8s, settings):
    """A node still claimed by another tenant's booking (its teardown has not lifted the claim yet) failed the
    cluster with "node h100-001 is held by reservation <theirs> until <their window's end>": the cluster's
    status_reason (API), its page and the cluster.failed event (Slack) showed this tenant another tenant's
    booking and window. The tenant is told the node is held by another booking; the details go to the log."""
    from rest_framework.test import APIClient

    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"
    theirs = book(world, "beta-lead", t0 + timedelta(days=2), hours=5, nodes=1, orchestrator="kubernetes")
    their_end = "2099-03-04T05:06:07Z"
    reservation = book(world, "alpha-lead", t0, hours=4, nodes=1, orchestrator="kubernetes")
    [host] = held_hosts(reservation)
    claim_by_hand(k8s, host, reservation_id=theirs.pk, tenant="beta", window_end=their_end)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    cluster.refresh_from_db()
    assert f"node {host} is held by another booking" in cluster.status_reason

    client = APIClient()
    client.force_authenticate(world.users["alpha-lead"])
    shown = [json.dumps(client.get(f"/api/v1/clusters/{cluster.pk}/").json()),
             client.get(f"/clusters/{cluster.pk}/").content.decode()]
    client.force_login(world.users["alpha-lead"])
    shown.append(client.get(f"/clusters/{cluster.pk}/").content.decode())
    for text in shown + [cluster.status_reason, cluster.last_error]:
        assert their_end not in text and f"reservation {theirs.pk}" not in text and "2099" not in text


@pytest.mark.django_db(transaction=True)
def test_reconcile_fix_never_uncordons_a_node_that_failed_after_it_read_the_states(world, t0, k8s, monkeypatch):
    """reconcile --fix read the portal's node states first; a node that failed after that read was cordoned by
    its sync, and reconcile then uncordoned it by the old state ("available, cordoned for us"): the failed node
    took the tenants' pods until the next run. A node repair now runs under the node's sync lock, and only
    while the node is still in or out of service as reconcile read it."""
    import threading

    from django.db import connection

    from provisioning.backends.kubernetes import KubernetesBackend
    from reservations.choices import NodeState
    from reservations.models import Node
    from reservations.services import node_update

    host = world.nodes[0].hostname
    fail_node(world, host)  # cordoned for the portal
    node_update(actor=world.users["staff"], node=Node.objects.get(hostname=host), state=NodeState.AVAILABLE,
                reason="")  # back in service; its sync (the uncordon) has not run yet
    real = KubernetesBackend.reconcile_nodes
    seen = {}

    def fails_again_in_other_worker():
        try:
            seen["sync"] = fail_node(world, host)
        finally:
            connection.close()

    def reconcile_nodes_while_it_fails_again(self, states, **kwargs):
        if not seen:
            worker = threading.Thread(target=fails_again_in_other_worker)
            worker.start()
            worker.join(30)
        return real(self, states, **kwargs)

    monkeypatch.setattr(KubernetesBackend, "reconcile_nodes", reconcile_nodes_while_it_fails_again)
    drifts = services.reconcile(fix=True, backend_name="kubernetes")
    assert Node.objects.get(hostname=host).state == NodeState.FAILED
    assert k8s.nodes[host]["spec"].get("unschedulable") is True, drifts
    [drift] = [d for d in drifts if d["name"] == host]
    assert not drift["repaired"] and "left alone" in drift["detail"]


_CHECKS_RUNNING = {"on": True}


def gate_checks_running_then_pass(*, cluster):
    if _CHECKS_RUNNING["on"]:
        raise services.RetryLater(0.05, "health checks still running")
    return services.GateResult(True, "checks passed")


def test_a_window_change_while_the_cluster_is_built_reaches_its_claims(world, t0, k8s, settings):
    """Kubernetes holds no booking, so a window change that reached a cluster being built ("nothing to sync")
    was done with: the nodes claimed in allocating_nodes kept the old window end (past it, another booking's
    claim takes a node over) and nothing applied the new one once the cluster was ready. The sync now waits
    for the build (the outbox runs it again after its backoff), then applies the window to the ready cluster."""
    from portal.core import events
    from portal.core.models import OutboxEvent
    from reservations.services import reservation_update

    settings.PORTAL_ACCEPTANCE_GATE = f"{__name__}.gate_checks_running_then_pass"
    _CHECKS_RUNNING["on"] = True
    reservation = book(world, "alpha-lead", t0, hours=4, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with pytest.raises(services.RetryLater):  # claimed, applied; the acceptance checks run (the lock is free)
        services.cluster_provision(cluster_id=cluster.pk)
    settings.PORTAL_EVENTS_INLINE = False  # as in production: the sync runs from the outbox
    new_end = reservation.end + timedelta(hours=2)
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=new_end)
    row = OutboxEvent.objects.get(event="reservation.changed", payload__reservation_id=reservation.pk)
    events.outbox_dispatch(row.pk)
    _CHECKS_RUNNING["on"] = False
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    if OutboxEvent.objects.filter(pk=row.pk).exists():
        assert events.outbox_dispatch(row.pk) == "done"  # the outbox's next try, after its backoff
    [host] = held_hosts(reservation)
    ends = k8s.nodes[host]["metadata"]["annotations"][m.WINDOW_END_ANNOTATION]
    assert ends == new_end.strftime("%Y-%m-%dT%H:%M:%SZ"), ends


def test_a_node_held_after_a_failed_teardown_never_shows_the_next_tenant_the_failed_tenants_error(
        world, t0, k8s, settings):
    """A teardown that failed for good holds its nodes in maintenance with the reason "teardown of cluster #N
    failed: <the backend's error>", and that error names the tenant's namespace (tenant-alpha-r1). The next
    tenant booked on the node sees it (GET /api/v1/nodes/, its own nodes) until its booking is moved off: it
    read another tenant's name and booking. The reason now names only the cluster to retry; the error stays on
    that cluster (staff see it there)."""
    from reservations.choices import NodeState
    from reservations.models import Node

    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"
    reservation, cluster = ready_k8s_cluster(world, t0, nodes=1)
    [host] = held_hosts(reservation)
    Node.objects.exclude(hostname=host).update(state=NodeState.MAINTENANCE)  # beta can only get alpha's node
    theirs = book(world, "beta-lead", reservation.end, hours=2, nodes=1, orchestrator="kubernetes")
    assert held_hosts(theirs) == [host]
    services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=cluster)
    k8s.inject[("DELETE", f"/api/v1/namespaces/tenant-alpha-r{reservation.pk}")] = [500]
    assert services.cluster_teardown(cluster_id=cluster.pk) == "failed"
    cluster.refresh_from_db()
    assert f"tenant-alpha-r{reservation.pk}" in cluster.last_error  # the cluster keeps the error for staff
    node = Node.objects.get(hostname=host)
    assert node.state == NodeState.MAINTENANCE
    assert node.state_reason.startswith(f"teardown of cluster #{cluster.pk} failed")

    seen = world.client("beta-lead").get("/api/v1/nodes/").json()  # before its booking is moved off the node
    assert [n["hostname"] for n in seen["results"]] == [host]
    assert "alpha" not in json.dumps(seen), seen


def test_a_ca_file_named_relative_to_the_kubeconfig_reaches_the_tenants_kubeconfig(tmp_path, settings, monkeypatch):
    # kubectl and the kubernetes client read a relative certificate-authority path from the kubeconfig's own
    # folder; the portal's workers run from another one.
    from provisioning.backends.kubernetes import KubernetesBackend
    from tests.k8s.conftest import FAKE_CA_PEM

    folder = tmp_path / "kube"
    folder.mkdir()
    (folder / "ca.crt").write_text(FAKE_CA_PEM)
    config = yaml.safe_load(m.kubeconfig_yaml(make_spec(api_server_url="https://k8s.example:6443"), "portal-token"))
    del config["clusters"][0]["cluster"]["certificate-authority-data"]
    config["clusters"][0]["cluster"]["certificate-authority"] = "ca.crt"
    (folder / "config").write_text(yaml.safe_dump(config))
    settings.PORTAL_K8S_KUBECONFIG = str(folder / "config")
    elsewhere = tmp_path / "workdir"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    backend = KubernetesBackend()
    try:
        assert backend.api_ca_data == FAKE_CA_PEM
    finally:
        backend.close()


def test_reconcile_reports_and_restores_guard_rails_edited_by_hand(world, t0, k8s):
    # An operator deleted the tenant's default-deny policy and raised its GPU quota by hand: the tenant's
    # pods were open to every other namespace and could use GPUs it did not book. Reconcile said nothing.
    reservation, _cluster = ready_k8s_cluster(world, t0)
    namespace = f"tenant-alpha-r{reservation.pk}"
    deny = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/default-deny"
    quota = f"/api/v1/namespaces/{namespace}/resourcequotas/gpu-quota"
    pvc = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/shared"
    assert deny in k8s.objects and quota in k8s.objects
    # What the API server sends back is canonical (1024Gi is 1Ti) and defaulted: neither is drift.
    k8s.objects[quota]["spec"]["hard"]["requests.storage"] = "1Ti"
    k8s.objects[pvc]["spec"]["resources"]["requests"]["storage"] = "1Ti"
    k8s.objects[pvc]["spec"]["volumeName"] = "pvc-0123"
    assert [d for d in services.reconcile(backend_name="kubernetes") if d["kind"] != "node"] == []

    del k8s.objects[deny]
    k8s.objects[quota]["spec"]["hard"]["requests.nvidia.com/gpu"] = "64"
    drifts = {(d["kind"], d["name"]): d for d in services.reconcile(backend_name="kubernetes")}
    assert ("missing", f"NetworkPolicy/{namespace}/default-deny") in drifts
    assert ("mismatch", f"ResourceQuota/{namespace}/gpu-quota") in drifts
    assert not any(d["repaired"] for d in drifts.values())
    assert deny not in k8s.objects  # a report only, without --fix

    fixed = services.reconcile(fix=True, backend_name="kubernetes")
    assert {(d["kind"], d["name"]) for d in fixed if d["repaired"]} == {
        ("missing", f"NetworkPolicy/{namespace}/default-deny"), ("mismatch", f"ResourceQuota/{namespace}/gpu-quota")}
    assert k8s.objects[deny]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    assert k8s.objects[quota]["spec"]["hard"]["requests.nvidia.com/gpu"] == str(2 * 8)
    assert [d for d in services.reconcile(backend_name="kubernetes") if d["kind"] != "node"] == []


def test_a_node_registered_in_capitals_is_the_kubelets_lowercase_node(world, t0, k8s, capsys):
    # The portal takes hostnames as the inventory spells them ("H100-001"); the kubelet registers its Node
    # lowercased ("h100-001"), as every Kubernetes node name is. Every booking on such a node failed for good
    # ("not a DNS-1123 subdomain"), and its drain found no node to cordon.
    from django.core.management import call_command

    from reservations.models import Node

    for node in world.nodes:
        Node.objects.filter(pk=node.pk).update(hostname=node.hostname.upper())
        node.refresh_from_db()
    reservation, cluster = ready_k8s_cluster(world, t0, nodes=1)
    host = Allocation.objects.get(reservation=reservation).node.hostname
    assert host.isupper() and host.lower() in k8s.nodes and host not in k8s.nodes
    assert k8s.nodes[host.lower()]["metadata"]["labels"][m.RESERVATION_LABEL] == str(reservation.pk)
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out

    fail_node(world, host)
    assert k8s.nodes[host.lower()]["spec"]["unschedulable"] is True
    k8s.nodes[host.lower()]["spec"]["unschedulable"] = False  # uncordoned by hand: reconcile sees it
    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    assert f"kubernetes: node {host}: portal says failed, the node is schedulable" in capsys.readouterr().out


def test_a_cluster_without_shared_storage_gets_no_volume_claim(world, t0, k8s):
    # No storage asked for: no PVC (not a 1Gi one), and a quota that lets the tenant claim none either.
    reservation = book(world, "alpha-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(hours=1))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_configure(actor=world.users["alpha-lead"], cluster=cluster, shared_storage_gib=0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    cluster.refresh_from_db()

    applied = [yaml.safe_load(r.body) for r in k8s.of("PATCH")
               if r.headers["content-type"] == "application/apply-patch+yaml"]
    assert "PersistentVolumeClaim" not in [obj["kind"] for obj in applied]
    quota = next(obj for obj in applied if obj["kind"] == "ResourceQuota")
    assert quota["spec"]["hard"]["requests.storage"] == "0Gi"
    assert "shared_pvc" not in cluster.connection
    # Nor is a claim that was never made missing to reconcile.
    assert [d for d in services.reconcile(fix=False) if "PersistentVolumeClaim" in d["name"]] == []


def test_reconcile_leaves_namespaces_and_claims_of_a_tenant_the_portal_does_not_know_alone(world, k8s, capsys):
    # `tenants` narrows "ours" (backends/base.py): a namespace and a node claim labelled for a tenant the
    # portal has no record of (another portal instance on the same cluster, an operator's copy) are not the
    # portal's to report or delete, however they are labelled.
    from django.core.management import call_command

    host = world.nodes[-1].hostname
    claim_by_hand(k8s, host, reservation_id=99997, tenant="ops-team")
    namespace = "tenant-ops-team-r99997"
    k8s.namespaces[namespace] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.TENANT_LABEL: "ops-team",
                                      m.RESERVATION_LABEL: "99997"}}}

    call_command("reconcile", "--backend", "kubernetes", "--fix")
    assert "0 drifts" in capsys.readouterr().out
    assert namespace in k8s.namespaces and "status" not in k8s.namespaces[namespace]
    assert is_claimed(k8s, host)


def test_a_cluster_whose_api_server_does_not_pin_pods_to_the_booked_nodes_is_not_handed_over(world, t0, k8s,
                                                                                            settings):
    # Without the PodNodeSelector and PodTolerationRestriction admission plugins the namespace's annotations do
    # nothing: the tenant's pods land on any untainted node, GPUs nobody booked included. Verify shows it with a
    # dry-run pod create and fails the cluster rather than hand it over.
    settings.PORTAL_PROVISIONING_MAX_ATTEMPTS = "1"
    k8s.admission_plugins = {"PodTolerationRestriction"}
    reservation = book(world, "alpha-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    cluster.refresh_from_db()
    assert "PodNodeSelector" in cluster.status_reason, cluster.status_reason
    dry_runs = k8s.of("POST", f"/api/v1/namespaces/tenant-alpha-r{reservation.pk}/pods")
    assert dry_runs and all(r.query.get("dryRun") == ["All"] for r in dry_runs)


def test_verify_checks_the_namespace_pins_pods_to_the_booked_nodes(world, t0, k8s):
    reservation = book(world, "alpha-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    assert k8s.of("POST", f"/api/v1/namespaces/tenant-alpha-r{reservation.pk}/pods")


def test_reconcile_reports_a_cluster_whose_pods_are_no_longer_pinned_to_its_nodes(world, t0, k8s, capsys):
    from django.core.management import call_command

    reservation, _cluster = ready_k8s_cluster(world, t0)
    call_command("reconcile", "--backend", "kubernetes")
    assert "0 drifts" in capsys.readouterr().out
    k8s.admission_plugins = set()  # switched off on the API server after the hand-over
    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes", "--fix")
    out = capsys.readouterr().out
    assert (f"mismatch tenant-alpha-r{reservation.pk}: the API server does not pin its pods to the booked nodes: "
            "enable the admission plugin(s) PodNodeSelector") in out, out
    assert "PodTolerationRestriction" in out and "1 drift, 0 repaired" in out


def test_a_dry_run_pod_refused_in_one_namespace_is_reported_for_that_cluster_only(world, t0, k8s, capsys):
    # A tenant that filled its pod quota: the API server refuses even a dry-run pod (403). That cluster's check
    # is reported; the rest of reconcile goes on (it is not an unreachable backend).
    from django.core.management import call_command

    reservation, _cluster = ready_k8s_cluster(world, t0)
    namespace = f"tenant-alpha-r{reservation.pk}"
    k8s.inject[("POST", f"/api/v1/namespaces/{namespace}/pods")] = [403]
    with pytest.raises(SystemExit):
        call_command("reconcile", "--backend", "kubernetes")
    out = capsys.readouterr().out
    assert f"unknown {namespace}: admission check: dry-run pod in {namespace} failed: 403" in out, out
    assert "unreachable" not in out and "1 drift, 0 repaired" in out


def test_a_token_the_api_server_grants_for_less_than_the_booking_is_renewed_before_it_expires(world, t0, k8s,
                                                                                              monkeypatch):
    # --service-account-max-token-expiration caps the token asked to last to the window's end: the tenant's
    # kubeconfig would stop working mid-booking. The portal records the granted expiry and the tick has the
    # cluster's kubeconfig issued again (reservation_sync, as a window change does) before it runs out.
    k8s.token_max_seconds = 3600
    reservation, cluster = ready_k8s_cluster(world, t0)
    cluster.refresh_from_db()
    expires = timezone.datetime.fromisoformat(cluster.backend_state["token_expires_at"])
    assert timedelta(minutes=55) < expires - timezone.now() <= timedelta(hours=1)
    first = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")

    sent: list = []
    monkeypatch.setattr(services, "_send", lambda name, *args, countdown=None: sent.append((name, args)))
    services.lifecycle_tick(now=timezone.now() + timedelta(minutes=10))
    assert ("sync_reservation", (reservation.pk,)) not in sent  # not due yet
    services.lifecycle_tick(now=expires - timedelta(minutes=10))
    assert sent.count(("sync_reservation", (reservation.pk,))) == 1
    # Asked for and not done yet (the API server down, the sync retrying): not asked again every minute.
    services.lifecycle_tick(now=expires - timedelta(minutes=9))
    assert sent.count(("sync_reservation", (reservation.pk,))) == 1
    tokens = len(k8s.of("POST", f"/api/v1/namespaces/tenant-alpha-r{reservation.pk}/serviceaccounts"))
    assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    assert len(k8s.of("POST", f"/api/v1/namespaces/tenant-alpha-r{reservation.pk}/serviceaccounts")) == tokens + 1
    renewed = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")
    assert renewed.pk != first.pk
    cluster.refresh_from_db()
    assert cluster.backend_state["token_renewal_asked_at"] is None  # done: the next renewal is asked on time
    sent.clear()
    services.lifecycle_tick(now=timezone.now() + timedelta(minutes=10))
    assert ("sync_reservation", (reservation.pk,)) not in sent  # the new token is not due yet
