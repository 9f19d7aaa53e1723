"""The applier, driving the real ``kubernetes`` client against a loopback HTTP server.

The client is configured from a real kubeconfig file, so what the server records is what
the client would send to a real API server: path, verb, query, headers and body.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from provisioning.backends import k8s_manifests as m
from provisioning.backends.k8s_apply import (
    APPLY_CONTENT_TYPE,
    FIELD_MANAGER,
    MERGE_PATCH_CONTENT_TYPE,
    K8sApplyError,
    TenantClusterApplier,
)

from .conftest import NOW, WINDOW_END, LoopbackApiServer, make_node, make_pdb, make_pod, make_spec

NS = "tenant-research-r42"
EXPECTED_APPLY_PATHS = [
    f"/api/v1/namespaces/{NS}",
    f"/api/v1/namespaces/{NS}/resourcequotas/gpu-quota",
    f"/api/v1/namespaces/{NS}/limitranges/container-defaults",
    f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/default-deny",
    f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/allow-same-namespace",
    f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/allow-dns",
    f"/api/v1/namespaces/{NS}/serviceaccounts/tenant-admin",
    f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/tenant-admin",
    f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/tenant-admin",
    f"/api/v1/namespaces/{NS}/persistentvolumeclaims/shared",
]


def write_kubeconfig(tmp_path: Path, server: LoopbackApiServer, token: str) -> Path:
    """Write a kubeconfig pointing at the loopback server, as the portal's own config would."""
    spec = make_spec(api_server_url=server.url)
    path = tmp_path / "kubeconfig"
    path.write_text(m.kubeconfig_yaml(spec, token))
    return path


@pytest.fixture
def applier(api_server: LoopbackApiServer, tmp_path: Path):
    with TenantClusterApplier.from_kubeconfig(write_kubeconfig(tmp_path, api_server, "portal-token"),
                                              conflict_retries=2) as instance:
        yield instance


@pytest.fixture
def spec() -> m.TenantClusterSpec:
    return make_spec()


def add_nodes(server: LoopbackApiServer, spec: m.TenantClusterSpec) -> None:
    for hostname in spec.node_hostnames:
        server.nodes[hostname] = make_node(hostname)


def test_apply_objects_uses_server_side_apply(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                              spec: m.TenantClusterSpec) -> None:
    refs = applier.apply_objects(spec)
    assert refs[0] == f"Namespace/{NS}" and refs[-1] == f"PersistentVolumeClaim/{NS}/shared"
    patches = api_server.of("PATCH")
    assert [r.path for r in patches] == EXPECTED_APPLY_PATHS
    for request, manifest in zip(patches, m.tenant_objects(spec), strict=True):
        assert request.headers["content-type"] == APPLY_CONTENT_TYPE == "application/apply-patch+yaml"
        assert request.query == {"fieldManager": ["gpu-portal"], "force": ["true"]}
        assert request.headers["authorization"] == "Bearer portal-token"
        # The body is the full object, apiVersion and kind included, as apply requires.
        assert yaml.safe_load(request.body) == manifest
    assert FIELD_MANAGER == "gpu-portal"


def test_apply_returns_the_servers_object(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                          spec: m.TenantClusterSpec) -> None:
    returned = applier.apply(m.namespace_manifest(spec))
    assert returned["metadata"]["name"] == NS
    assert returned["metadata"]["resourceVersion"] == "1"


def test_apply_failure_names_the_object(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                        spec: m.TenantClusterSpec) -> None:
    api_server.inject[("PATCH", f"/api/v1/namespaces/{NS}/resourcequotas/gpu-quota")] = [422]
    with pytest.raises(K8sApplyError, match=f"ResourceQuota/{NS}/gpu-quota failed: 422"):
        applier.apply_objects(spec)
    # Stopped at the failure: nothing after the quota was sent.
    assert [r.path for r in api_server.of("PATCH")] == EXPECTED_APPLY_PATHS[:2]


def test_apply_refuses_an_unknown_kind(applier: TenantClusterApplier) -> None:
    with pytest.raises(K8sApplyError, match="no apply route"):
        applier.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x", "namespace": "y"}})


def test_provision_claims_nodes_then_applies(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                             spec: m.TenantClusterSpec) -> None:
    add_nodes(api_server, spec)
    applier.provision(spec, now=NOW)
    sequence = [(r.method, r.path) for r in api_server.requests]
    assert sequence[:4] == [
        ("GET", "/api/v1/nodes/h100-sxm-001"), ("PATCH", "/api/v1/nodes/h100-sxm-001"),
        ("GET", "/api/v1/nodes/h100-sxm-002"), ("PATCH", "/api/v1/nodes/h100-sxm-002"),
    ]
    assert [path for _method, path in sequence[4:]] == EXPECTED_APPLY_PATHS
    for request in api_server.of("PATCH", "/api/v1/nodes/"):
        assert request.headers["content-type"] == MERGE_PATCH_CONTENT_TYPE
        # Not an apply request: force must be absent (the API server rejects it otherwise).
        assert request.query == {"fieldManager": ["gpu-portal"]}
        body = request.json()
        assert body["metadata"]["resourceVersion"] == "100"
        assert body["spec"]["taints"][-1] == {"key": "dedicated", "value": "research", "effect": "NoSchedule"}
    for hostname in spec.node_hostnames:
        node = api_server.nodes[hostname]
        assert node["metadata"]["labels"]["gpuportal.io/tenant"] == "research"
        assert node["metadata"]["annotations"]["gpuportal.io/window-end"] == "2026-03-05T09:00:00Z"
        assert {t["key"] for t in node["spec"]["taints"]} == {"nvidia.com/gpu", "dedicated"}


def test_provision_twice_converges(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                   spec: m.TenantClusterSpec) -> None:
    add_nodes(api_server, spec)
    applier.provision(spec, now=NOW)
    first = {h: api_server.nodes[h]["spec"] for h in spec.node_hostnames}
    applier.provision(spec, now=NOW)
    assert {h: api_server.nodes[h]["spec"] for h in spec.node_hostnames} == first
    applies = [r for r in api_server.of("PATCH") if r.headers["content-type"] == APPLY_CONTENT_TYPE]
    assert [r.path for r in applies] == EXPECTED_APPLY_PATHS * 2


def test_node_conflict_rereads_and_keeps_the_racing_taint(api_server: LoopbackApiServer,
                                                          applier: TenantClusterApplier,
                                                          spec: m.TenantClusterSpec) -> None:
    add_nodes(api_server, spec)
    raced: list[str] = []

    def someone_else_taints(name: str) -> None:
        # Between our GET and PATCH, another writer adds a taint and bumps resourceVersion.
        if name == "h100-sxm-001" and not raced:
            raced.append(name)
            node = api_server.nodes[name]
            node["spec"]["taints"].append({"key": "maintenance", "value": "soon", "effect": "NoSchedule"})
            node["metadata"]["resourceVersion"] = "101"

    api_server.before_node_patch = someone_else_taints
    applier.claim_nodes(spec, now=NOW)
    node_requests = [(r.method, r.path) for r in api_server.requests if r.path == "/api/v1/nodes/h100-sxm-001"]
    assert node_requests == [("GET", "/api/v1/nodes/h100-sxm-001"), ("PATCH", "/api/v1/nodes/h100-sxm-001")] * 2
    taints = api_server.nodes["h100-sxm-001"]["spec"]["taints"]
    assert {t["key"] for t in taints} == {"nvidia.com/gpu", "maintenance", "dedicated"}


def test_node_conflicts_give_up_after_the_retry_budget(api_server: LoopbackApiServer,
                                                       applier: TenantClusterApplier,
                                                       spec: m.TenantClusterSpec) -> None:
    add_nodes(api_server, spec)
    api_server.inject[("PATCH", "/api/v1/nodes/h100-sxm-001")] = [409, 409, 409]
    with pytest.raises(K8sApplyError, match="kept changing"):
        applier.claim_node(spec, "h100-sxm-001", now=NOW)
    assert len(api_server.of("PATCH", "/api/v1/nodes/")) == 3  # 1 try + conflict_retries=2


def test_claim_conflict_sends_no_patch_and_creates_nothing(api_server: LoopbackApiServer,
                                                           applier: TenantClusterApplier,
                                                           spec: m.TenantClusterSpec) -> None:
    add_nodes(api_server, spec)
    other = make_spec(tenant_slug="vision", reservation_id=7)
    node = api_server.nodes["h100-sxm-002"]
    node["metadata"]["labels"].update({"gpuportal.io/reservation": "7", "gpuportal.io/tenant": "vision"})
    node["metadata"]["annotations"]["gpuportal.io/window-end"] = other.window_end_rfc3339
    with pytest.raises(m.NodeClaimConflict):
        applier.provision(spec, now=NOW)
    assert [r.path for r in api_server.of("PATCH")] == ["/api/v1/nodes/h100-sxm-001"]
    assert api_server.namespaces == {}


def test_a_stale_claim_is_not_taken_over_while_its_pods_are_still_on_the_node(
    api_server: LoopbackApiServer, applier: TenantClusterApplier, spec: m.TenantClusterSpec
) -> None:
    # Back to back: reservation 42's window ended, its teardown is still waiting for the namespace (its
    # pod in its grace period, still on the node with the GPUs). The next booking must not get it yet.
    add_nodes(api_server, spec)
    applier.provision(spec, now=NOW)
    api_server.terminating_reads = 100
    assert applier.teardown(spec) is False
    pod = make_pod("train-0", NS, "h100-sxm-002")
    pod["metadata"]["deletionTimestamp"] = "2026-03-02T09:00:30Z"
    api_server.pods[(NS, "train-0")] = pod
    api_server.pods[("kube-system", "dcgm")] = make_pod("dcgm", "kube-system", "h100-sxm-002",
                                                        owner_kind="DaemonSet")
    following = make_spec(tenant_slug="vision", reservation_id=43, node_hostnames=["h100-sxm-002"],
                          window_end=WINDOW_END + timedelta(days=2))
    api_server.requests.clear()
    with pytest.raises(m.NodeClaimConflict, match=f"reservation 42, whose pod {NS}/train-0 is still on it") \
            as raised:
        applier.claim_node(following, "h100-sxm-002", now=WINDOW_END + timedelta(minutes=1))
    assert "teardown has not finished" in raised.value.public and "42" not in raised.value.public
    assert raised.value.held_until == WINDOW_END
    assert api_server.of("PATCH") == []
    assert api_server.nodes["h100-sxm-002"]["metadata"]["labels"]["gpuportal.io/reservation"] == "42"

    # The pod is gone; the namespace stays, stuck terminating on a finalizer: nothing of 42 runs there now.
    del api_server.pods[(NS, "train-0")]
    applier.claim_node(following, "h100-sxm-002", now=WINDOW_END + timedelta(minutes=2))
    assert api_server.nodes["h100-sxm-002"]["metadata"]["labels"]["gpuportal.io/reservation"] == "43"


def test_claim_of_a_missing_node_fails(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                       spec: m.TenantClusterSpec) -> None:
    with pytest.raises(K8sApplyError, match="claim node h100-sxm-001 failed: 404"):
        applier.claim_node(spec, "h100-sxm-001", now=NOW)


def test_teardown_deletes_namespace_and_releases_nodes_only_once_it_is_gone(
    api_server: LoopbackApiServer, applier: TenantClusterApplier, spec: m.TenantClusterSpec
) -> None:
    add_nodes(api_server, spec)
    pristine = {h: api_server.nodes[h]["spec"]["taints"][:] for h in spec.node_hostnames}
    applier.provision(spec, now=NOW)
    api_server.terminating_reads = 2
    api_server.requests.clear()

    assert applier.teardown(spec) is False  # Namespace still terminating: nodes stay dedicated.
    (delete,) = api_server.of("DELETE")
    assert delete.path == f"/api/v1/namespaces/{NS}"
    assert delete.query == {"propagationPolicy": ["Background"]}
    assert api_server.of("PATCH") == []
    assert api_server.nodes["h100-sxm-001"]["metadata"]["labels"]["gpuportal.io/reservation"] == "42"

    # Still terminating on the second call: the repeated DELETE gets the registry's 409,
    # which is not an error.
    api_server.requests.clear()
    assert applier.teardown(spec) is False
    assert [(r.method, r.path) for r in api_server.requests] == [
        ("DELETE", f"/api/v1/namespaces/{NS}"), ("GET", f"/api/v1/namespaces/{NS}"),
    ]

    assert applier.teardown(spec) is True  # Gone now.
    for hostname in spec.node_hostnames:
        node = api_server.nodes[hostname]
        assert node["spec"]["taints"] == pristine[hostname]
        assert not any(k.startswith("gpuportal.io/") for k in node["metadata"]["labels"])
        assert "gpuportal.io/window-end" not in node["metadata"]["annotations"]
    for request in api_server.of("PATCH", "/api/v1/nodes/"):
        assert request.headers["content-type"] == MERGE_PATCH_CONTENT_TYPE
        assert request.json()["metadata"]["labels"]["gpuportal.io/tenant"] is None

    api_server.requests.clear()
    assert applier.teardown(spec) is True  # Idempotent: nothing left, no node patched.
    assert api_server.of("PATCH") == []


def test_teardown_spares_a_node_the_next_reservation_already_holds(
    api_server: LoopbackApiServer, applier: TenantClusterApplier, spec: m.TenantClusterSpec
) -> None:
    add_nodes(api_server, spec)
    applier.provision(spec, now=NOW)
    following = make_spec(tenant_slug="vision", reservation_id=43, node_hostnames=["h100-sxm-002"],
                          window_end=WINDOW_END + timedelta(days=2))
    applier.claim_node(following, "h100-sxm-002", now=WINDOW_END)
    assert applier.teardown(spec) is True
    assert api_server.nodes["h100-sxm-002"]["metadata"]["labels"]["gpuportal.io/reservation"] == "43"
    assert "gpuportal.io/reservation" not in api_server.nodes["h100-sxm-001"]["metadata"]["labels"]


def test_release_of_a_node_that_left_the_cluster(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                                 spec: m.TenantClusterSpec) -> None:
    assert applier.release_node(spec, "h100-sxm-001") is False


def test_teardown_surfaces_server_errors(api_server: LoopbackApiServer, applier: TenantClusterApplier,
                                         spec: m.TenantClusterSpec) -> None:
    api_server.inject[("DELETE", f"/api/v1/namespaces/{NS}")] = [500]
    with pytest.raises(K8sApplyError, match="delete namespace .* 500"):
        applier.teardown(spec)


def test_issue_token_requests_a_token_that_ends_with_the_window(
    api_server: LoopbackApiServer, applier: TenantClusterApplier, spec: m.TenantClusterSpec
) -> None:
    assert applier.issue_token(spec, now=NOW) == f"token-for-{NS}-tenant-admin"
    (post,) = api_server.of("POST")
    assert post.path == f"/api/v1/namespaces/{NS}/serviceaccounts/tenant-admin/token"
    assert post.json() == {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3 * 24 * 3600},
    }


def test_tenant_kubeconfig_authenticates_as_the_service_account(
    api_server: LoopbackApiServer, applier: TenantClusterApplier, tmp_path: Path
) -> None:
    spec = make_spec(api_server_url=api_server.url)
    applier.apply_objects(spec)
    tenant_config = tmp_path / "tenant-kubeconfig"
    tenant_config.write_text(applier.tenant_kubeconfig(spec, now=NOW))
    api_server.requests.clear()
    with TenantClusterApplier.from_kubeconfig(tenant_config) as as_tenant:
        assert as_tenant.namespace_exists(spec) is True
    (read,) = api_server.requests
    assert read.path == f"/api/v1/namespaces/{NS}"
    assert read.headers["authorization"] == f"Bearer token-for-{NS}-tenant-admin"
    assert yaml.safe_load(tenant_config.read_text())["contexts"][0]["context"]["namespace"] == NS


def test_evicting_a_nodes_tenant_pods_uses_the_eviction_api_and_honours_budgets(
        api_server: LoopbackApiServer, applier: TenantClusterApplier) -> None:
    """Only the tenants' running pods on that node are evicted, each through pods/eviction (policy/v1), so a
    PodDisruptionBudget is honoured; one the budget keeps (429) is named, and the others are still evicted."""
    node, other = "h100-sxm-001", "h100-sxm-002"
    pods = [
        make_pod("train-a", NS, node, labels={"app": "train"}),
        make_pod("serve-a", NS, node, labels={"app": "serve"}),
        make_pod("serve-b", NS, node, labels={"app": "serve-b"}),
        make_pod("monitor", NS, node, owner_kind="DaemonSet"),  # its controller would put it straight back
        make_pod("done", NS, node, phase="Succeeded"),
        make_pod("static", NS, node, owner_kind=None, annotations={"kubernetes.io/config.mirror": "x"}),
        make_pod("elsewhere", NS, other),  # the tenant's pod on a healthy node
        make_pod("dns", "kube-system", node),  # not a tenant's namespace
    ]
    for pod in pods:
        api_server.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
    api_server.pdbs[(NS, "serve")] = make_pdb("serve", NS, {"app": "serve"}, disruptions_allowed=0)
    api_server.pdbs[(NS, "serve-b")] = make_pdb("serve-b", NS, {"app": "serve-b"}, disruptions_allowed=1)

    evicted, refused = applier.evict_tenant_pods(node, {NS})
    assert evicted == [f"{NS}/serve-b", f"{NS}/train-a"]
    assert len(refused) == 1 and refused[0].startswith(f"{NS}/serve-a: its PodDisruptionBudget allows no disruption")
    assert "The disruption budget serve needs 1 healthy pods" in refused[0]
    posts = api_server.of("POST", f"/api/v1/namespaces/{NS}/pods/")
    assert {r.path for r in posts} == {f"/api/v1/namespaces/{NS}/pods/{n}/eviction" for n in ("train-a", "serve-a",
                                                                                             "serve-b")}
    body = posts[0].json()
    assert posts[0].headers["content-type"] == "application/json"
    assert body["apiVersion"] == "policy/v1" and body["kind"] == "Eviction"
    assert body["metadata"] == {"name": posts[0].path.split("/")[-2], "namespace": NS}
    assert api_server.pods[(NS, "train-a")]["metadata"]["deletionTimestamp"]
    assert not api_server.pods[(NS, "serve-a")]["metadata"].get("deletionTimestamp")
    for key in ((NS, "monitor"), (NS, "elsewhere"), ("kube-system", "dns")):
        assert not api_server.pods[key]["metadata"].get("deletionTimestamp")

    # Again: the pods already going are not evicted twice; the budget still says no.
    assert applier.evict_tenant_pods(node, {NS})[0] == []
    assert len(api_server.of("POST", f"/api/v1/namespaces/{NS}/pods/")) == 4
    api_server.pdbs[(NS, "serve")]["status"]["disruptionsAllowed"] = 1  # the replacement is ready elsewhere
    assert applier.evict_tenant_pods(node, {NS}) == ([f"{NS}/serve-a"], [])
    assert applier.tenant_pods_on_node(node, {NS}) == []


def test_an_eviction_of_a_pod_gone_meanwhile_is_done_and_a_server_error_is_named(
        api_server: LoopbackApiServer, applier: TenantClusterApplier) -> None:
    node = "h100-sxm-001"
    for name in ("gone", "ambiguous"):
        api_server.pods[(NS, name)] = make_pod(name, NS, node, labels={"app": name})
    api_server.pdbs[(NS, "one")] = make_pdb("one", NS, {"app": "ambiguous"}, disruptions_allowed=1)
    api_server.pdbs[(NS, "two")] = make_pdb("two", NS, {"app": "ambiguous"}, disruptions_allowed=1)
    api_server.inject[("POST", f"/api/v1/namespaces/{NS}/pods/gone/eviction")] = [404]
    evicted, refused = applier.evict_tenant_pods(node, {NS})
    assert evicted == [f"{NS}/gone"]
    assert refused == [f"{NS}/ambiguous: 500 This pod has more than one PodDisruptionBudget, which the eviction "
                       "subresource does not support."]


def test_request_token_returns_the_expiry_the_api_server_granted(
    api_server: LoopbackApiServer, applier: TenantClusterApplier
) -> None:
    # --service-account-max-token-expiration: the API server grants less than the window asked for.
    api_server.token_max_seconds = 3600
    before = datetime.now(UTC)
    token, expires = applier.request_token(make_spec(), now=NOW)
    assert token == f"token-for-{NS}-tenant-admin"
    assert before + timedelta(minutes=59) <= expires <= datetime.now(UTC) + timedelta(hours=1)
