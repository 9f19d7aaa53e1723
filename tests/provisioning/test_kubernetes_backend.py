"""The Kubernetes backend through the real `kubernetes` client against the loopback API server.

No API server runs here (see provisioning/backends/k8s_apply.py for what was and was not
tried): the loopback server records what the client sends and answers like the API server.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import yaml

from provisioning import crypto, services
from provisioning.backends import k8s_manifests as m
from provisioning.models import ClusterCredential, VirtualCluster
from reservations.models import Allocation
from tests.k8s.conftest import api_server, make_node, make_spec  # noqa: F401 - the loopback fixture

from .conftest import book

pytestmark = pytest.mark.django_db


@pytest.fixture
def k8s(api_server, world, tmp_path, settings):  # noqa: F811 - the imported fixture
    kubeconfig = tmp_path / "portal-kubeconfig"
    kubeconfig.write_text(m.kubeconfig_yaml(make_spec(api_server_url=api_server.url), "portal-admin-token"))
    settings.PORTAL_PROVISIONING_BACKEND = "slurm,kubernetes"
    settings.PORTAL_K8S_KUBECONFIG = str(kubeconfig)
    settings.PORTAL_K8S_STORAGE_CLASS = "cephfs"
    for node in world.nodes:
        api_server.nodes[node.hostname] = make_node(node.hostname)
    return api_server


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
