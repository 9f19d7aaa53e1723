"""The generated objects: schema-valid, well named, and meaning what they should."""

from __future__ import annotations

import base64
import copy
import json
import re
from datetime import datetime, timedelta, timezone

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from provisioning.backends import k8s_manifests as m

from .conftest import FAKE_CA_PEM, NOW, WINDOW_END, make_node, make_spec, merge_patch

# Newest schemas the installed kubernetes-validate ships, and its oldest, so the objects are
# known good across every cluster version from 1.25 on. Strict: unknown fields are errors.
NEWEST_SCHEMA = "1.37.0"
OLDEST_SCHEMA = "1.25.0"
SCHEMA_VERSIONS = (NEWEST_SCHEMA, OLDEST_SCHEMA)

SPECS = {
    "plain": make_spec(),
    "mig": make_spec(mig_profile="1g.10gb", mig_instances_per_gpu=7, gpus_per_node=4,
                     node_hostnames=["gpu-a.rack1.example", "gpu-b.rack1.example", "gpu-c.rack1.example"]),
    "odd-slug": make_spec(tenant_slug="Research_Team.ÄI  (prod)", reservation_id=987654321),
    "restricted": make_spec(pod_security_level="restricted", cluster_name="eu-west"),
}

HYPO = settings(max_examples=200, deadline=None, database=None)


def validate(obj: dict, version: str) -> None:
    assert kubernetes_validate.validate(obj, version, strict=True) == version[: version.rindex(".")]


def test_schema_versions_are_shipped_by_kubernetes_validate() -> None:
    shipped = set(kubernetes_validate.utils.all_versions())
    assert {NEWEST_SCHEMA, OLDEST_SCHEMA} <= shipped
    assert kubernetes_validate.utils.latest_version() == NEWEST_SCHEMA


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_every_object_validates_strictly(spec_name: str, version: str) -> None:
    objects = m.tenant_objects(SPECS[spec_name])
    assert [o["kind"] for o in objects] == [
        "Namespace", "ResourceQuota", "LimitRange", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy",
        "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim",
    ]
    for obj in objects:
        validate(obj, version)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_strict_validation_is_not_vacuous(version: str) -> None:
    policy = m.network_policy_manifests(make_spec())[0]
    typo = copy.deepcopy(policy)
    typo["spec"]["podSelectr"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)
    wrong_type = copy.deepcopy(m.resource_quota_manifest(make_spec()))
    wrong_type["spec"]["hard"] = ["requests.nvidia.com/gpu"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, version, strict=True)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_patched_nodes_validate_strictly(spec_name: str, version: str) -> None:
    spec = SPECS[spec_name]
    node = make_node(spec.node_hostnames[0])
    claimed = merge_patch(node, m.node_claim_patch(spec, node, now=NOW))
    validate(claimed, version)
    released = merge_patch(claimed, m.node_release_patch(spec, claimed))
    validate(released, version)


def test_all_manifests_render_as_yaml_stream() -> None:
    spec = make_spec()
    docs = list(yaml.safe_load_all(m.manifests_yaml(m.tenant_objects(spec))))
    assert docs == m.tenant_objects(spec)


# --- Names ---


def test_namespace_name_for_a_plain_slug() -> None:
    assert make_spec(tenant_slug="research", reservation_id=42).namespace == "tenant-research-r42"
    assert make_spec(tenant_slug="research").tenant_label == "research"


@pytest.mark.parametrize(
    "slug",
    ["Research_Team", "a.b", "a_b", "-lead-", "ÄÖÜ", "日本語チーム", "x" * 300, "UPPER", "9lives", "a--b", " "],
)
def test_odd_slugs_give_valid_names(slug: str) -> None:
    spec = make_spec(tenant_slug=slug, reservation_id=2**40)
    assert m.is_dns_label(spec.namespace), spec.namespace
    assert spec.namespace.startswith("tenant-") and spec.namespace.endswith(f"-r{2**40}")
    assert m.is_dns_label(spec.tenant_label) and m.is_label_value(spec.tenant_label)


def test_slugs_that_sanitise_alike_still_get_distinct_names() -> None:
    names = {make_spec(tenant_slug=s).namespace for s in ("a_b", "a.b", "A-B", "a b", "a-b")}
    assert len(names) == 5
    long_a, long_b = "team-" + "x" * 80 + "a", "team-" + "x" * 80 + "b"
    assert make_spec(tenant_slug=long_a).namespace != make_spec(tenant_slug=long_b).namespace


@HYPO
@given(slug=st.text(min_size=1, max_size=120), reservation_id=st.integers(min_value=1, max_value=10**15))
def test_any_slug_gives_valid_deterministic_names(slug: str, reservation_id: int) -> None:
    spec = make_spec(tenant_slug=slug, reservation_id=reservation_id)
    again = make_spec(tenant_slug=slug, reservation_id=reservation_id)
    assert spec.namespace == again.namespace
    assert m.is_dns_label(spec.namespace)
    assert re.fullmatch(rf"tenant-[a-z0-9-]+-r{reservation_id}", spec.namespace)
    assert m.is_label_value(spec.tenant_label)
    for obj in m.tenant_objects(spec):
        assert m.is_dns_label(obj["metadata"]["name"])
        assert all(m.is_label_value(v) for v in obj["metadata"]["labels"].values())


@HYPO
@given(a=st.text(min_size=1, max_size=80), b=st.text(min_size=1, max_size=80))
def test_distinct_slugs_give_distinct_namespaces(a: str, b: str) -> None:
    if a != b:
        assert make_spec(tenant_slug=a).namespace != make_spec(tenant_slug=b).namespace


def test_dns_label_keeps_valid_labels_and_bounds_length() -> None:
    assert m.dns_label("research") == "research"
    assert len(m.dns_label("r" * 100, 20)) == 20
    assert m.dns_label("!!!").startswith("x")
    with pytest.raises(ValueError):
        m.dns_label("anything", 7)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"window_end": datetime(2026, 3, 5, 9, 0)}, "timezone-aware"),
        ({"node_hostnames": ()}, "node_hostnames is empty"),
        ({"node_hostnames": ("Bad_Host",)}, "DNS-1123"),
        ({"node_hostnames": ("n1", "n1")}, "duplicates"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"reservation_id": 0}, "reservation_id"),
        ({"reservation_id": True}, "reservation_id"),
        ({"tenant_slug": ""}, "tenant_slug"),
        ({"cuda_version": "12.8 beta"}, "cuda_version"),
        ({"storage_class": "Fast_SSD"}, "storage_class"),
        ({"api_server_url": "k8s.example:6443"}, "api_server_url"),
        ({"api_ca_data": "not base64 at all!"}, "api_ca_data"),
        ({"mig_profile": "1g.10gb"}, "go together"),
        ({"mig_profile": "big", "mig_instances_per_gpu": 1}, "mig_profile"),
        ({"pod_security_level": "lax"}, "pod_security_level"),
    ],
)
def test_spec_rejects_bad_input(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(**override)


def test_spec_normalises_hostnames_to_a_tuple() -> None:
    spec = make_spec(node_hostnames=["n1", "n2"])
    assert spec.node_hostnames == ("n1", "n2")
    hash(spec)


# --- Object semantics ---


def test_namespace_labels_and_admission_annotations() -> None:
    spec = make_spec()
    ns = m.namespace_manifest(spec)
    assert ns["metadata"]["name"] == "tenant-research-r42"
    labels, annotations = ns["metadata"]["labels"], ns["metadata"]["annotations"]
    assert labels[m.TENANT_LABEL] == "research"
    assert labels[m.RESERVATION_LABEL] == "42"
    assert labels[m.CUDA_VERSION_LABEL] == "12.8"
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert annotations[m.WINDOW_END_ANNOTATION] == "2026-03-05T09:00:00Z"
    assert annotations[m.NODE_SELECTOR_ANNOTATION] == "gpuportal.io/reservation=42"
    tolerations = json.loads(annotations[m.DEFAULT_TOLERATIONS_ANNOTATION])
    # The default toleration tolerates exactly the taint put on the reservation's nodes.
    node = make_node("h100-sxm-001")
    taint = next(t for t in m.node_claim_patch(spec, node, now=NOW)["spec"]["taints"] if t["key"] == "dedicated")
    assert tolerations == [{"key": taint["key"], "operator": "Equal", "value": taint["value"],
                            "effect": taint["effect"]}]


def test_window_end_is_written_in_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    spec = make_spec(window_end=datetime(2026, 3, 5, 11, 30, tzinfo=plus_two))
    assert spec.window_end_rfc3339 == "2026-03-05T09:30:00Z"


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 1), (2, 8), (16, 8), (3, 4)])
def test_quota_counts_nodes_times_gpus(nodes: int, gpus: int) -> None:
    spec = make_spec(node_hostnames=[f"n{i}" for i in range(nodes)], gpus_per_node=gpus)
    hard = m.resource_quota_manifest(spec)["spec"]["hard"]
    assert hard["requests.nvidia.com/gpu"] == str(nodes * gpus)
    assert hard["pods"] == str(nodes * m.PODS_PER_NODE)
    assert hard["requests.storage"] == "2048Gi"
    assert hard["services.nodeports"] == "0" and hard["services.loadbalancers"] == "0"
    assert all(isinstance(v, str) for v in hard.values())


def test_quota_with_mig_counts_slices() -> None:
    spec = SPECS["mig"]
    hard = m.resource_quota_manifest(spec)["spec"]["hard"]
    assert hard["requests.nvidia.com/mig-1g.10gb"] == str(3 * 4 * 7)
    assert "requests.nvidia.com/gpu" not in hard


def test_limit_range_sets_memory_and_cpu_but_no_gpu() -> None:
    (item,) = m.limit_range_manifest(make_spec())["spec"]["limits"]
    assert item["type"] == "Container"
    assert item["defaultRequest"] == {"memory": "120Gi", "cpu": "12"}
    # No GPU default and no GPU max: a max alone would be defaulted into every container's limit.
    assert not any("nvidia.com" in key for section in item.values() if isinstance(section, dict)
                   for key in section)


def test_network_policies() -> None:
    spec = make_spec()
    deny, same, dns = m.network_policy_manifests(spec)
    assert deny["metadata"]["name"] == "default-deny"
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
    assert same["spec"]["podSelector"] == {}
    assert same["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]
    assert same["spec"]["egress"] == [{"to": [{"podSelector": {}}]}]
    # A bare podSelector peer (no namespaceSelector) means "this namespace only".
    assert "namespaceSelector" not in same["spec"]["ingress"][0]["from"][0]
    assert dns["spec"]["policyTypes"] == ["Egress"]
    (rule,) = dns["spec"]["egress"]
    (peer,) = rule["to"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert sorted((p["protocol"], p["port"]) for p in rule["ports"]) == [("TCP", 53), ("UDP", 53)]
    for policy in (deny, same, dns):
        assert policy["metadata"]["namespace"] == spec.namespace


def test_rbac_makes_the_service_account_namespace_admin_without_touching_guard_rails() -> None:
    spec = make_spec()
    sa = m.service_account_manifest(spec)
    role = m.role_manifest(spec)
    binding = m.role_binding_manifest(spec)
    assert sa["automountServiceAccountToken"] is False
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": spec.namespace},
    ]
    writable = {
        (group, resource)
        for rule in role["rules"] if "create" in rule["verbs"]
        for group in rule["apiGroups"] for resource in rule["resources"]
    }
    assert ("", "pods") in writable and ("batch", "jobs") in writable and ("apps", "deployments") in writable
    for guarded in [("", "resourcequotas"), ("", "limitranges"), ("networking.k8s.io", "networkpolicies"),
                    ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings"),
                    ("", "namespaces")]:
        assert guarded not in writable
    assert all("*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"] for rule in role["rules"])


def test_shared_pvc() -> None:
    pvc = m.shared_pvc_manifest(make_spec())
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "cephfs"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2048Gi"


def test_every_namespaced_object_is_in_the_namespace_and_labelled() -> None:
    spec = make_spec()
    for obj in m.tenant_objects(spec)[1:]:
        assert obj["metadata"]["namespace"] == spec.namespace
        assert obj["metadata"]["labels"] == {
            "app.kubernetes.io/managed-by": "gpu-portal", m.TENANT_LABEL: "research", m.RESERVATION_LABEL: "42",
        }


# --- Node patches ---


def test_claim_labels_taints_and_annotates_keeping_other_taints() -> None:
    spec = make_spec()
    node = make_node("h100-sxm-001")
    patch = m.node_claim_patch(spec, node, now=NOW)
    assert patch["metadata"]["resourceVersion"] == "100"
    assert patch["metadata"]["labels"] == {
        "gpuportal.io/tenant": "research", "gpuportal.io/reservation": "42", "gpuportal.io/cuda-version": "12.8",
    }
    assert patch["metadata"]["annotations"] == {"gpuportal.io/window-end": "2026-03-05T09:00:00Z"}
    assert patch["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "research", "effect": "NoSchedule"},
    ]
    claimed = merge_patch(node, patch)
    assert claimed["metadata"]["labels"]["kubernetes.io/hostname"] == "h100-sxm-001"  # untouched
    # Claiming again is a no-op: same labels, one dedicated taint.
    again = merge_patch(claimed, m.node_claim_patch(spec, claimed, now=NOW))
    assert again == claimed


def test_release_is_the_inverse_of_claim() -> None:
    spec = make_spec()
    node = make_node("h100-sxm-001")
    claimed = merge_patch(node, m.node_claim_patch(spec, node, now=NOW))
    patch = m.node_release_patch(spec, claimed)
    assert patch is not None
    assert patch["metadata"]["labels"] == {
        "gpuportal.io/tenant": None, "gpuportal.io/reservation": None, "gpuportal.io/cuda-version": None,
    }
    assert patch["metadata"]["annotations"] == {"gpuportal.io/window-end": None}
    released = merge_patch(claimed, patch)
    assert released == node
    assert m.node_release_patch(spec, released) is None  # Nothing left to undo.


def test_release_leaves_the_next_reservation_alone() -> None:
    ours, theirs = make_spec(), make_spec(tenant_slug="vision", reservation_id=43)
    node = make_node("h100-sxm-001")
    taken = merge_patch(node, m.node_claim_patch(theirs, node, now=NOW))
    assert m.node_release_patch(ours, taken) is None


def test_claim_refuses_a_node_held_by_an_active_reservation() -> None:
    other = make_spec(tenant_slug="vision", reservation_id=7)
    node = make_node("h100-sxm-001")
    held = merge_patch(node, m.node_claim_patch(other, node, now=NOW))
    with pytest.raises(m.NodeClaimConflict, match="reservation 7"):
        m.node_claim_patch(make_spec(), held, now=NOW)


def test_claim_takes_over_a_stale_claim_whose_window_ended() -> None:
    stale = make_spec(tenant_slug="vision", reservation_id=7, window_end=NOW - timedelta(hours=1))
    node = make_node("h100-sxm-001")
    left_behind = merge_patch(node, m.node_claim_patch(stale, node, now=NOW - timedelta(days=1)))
    claimed = merge_patch(left_behind, m.node_claim_patch(make_spec(), left_behind, now=NOW))
    assert claimed["metadata"]["labels"]["gpuportal.io/reservation"] == "42"
    assert [t for t in claimed["spec"]["taints"] if t["key"] == "dedicated"] == [
        {"key": "dedicated", "value": "research", "effect": "NoSchedule"}
    ]


def test_claim_refuses_a_dedicated_taint_the_portal_did_not_set() -> None:
    node = make_node("h100-sxm-001", taints=[{"key": "dedicated", "value": "ops", "effect": "NoSchedule"}])
    with pytest.raises(m.NodeClaimConflict, match="did not set"):
        m.node_claim_patch(make_spec(), node, now=NOW)


def test_claim_of_a_node_without_taints_or_resource_version() -> None:
    node = make_node("h100-sxm-001", taints=[])
    del node["metadata"]["resourceVersion"]
    patch = m.node_claim_patch(make_spec(), node, now=NOW)
    assert "resourceVersion" not in patch["metadata"]
    assert patch["spec"]["taints"] == [{"key": "dedicated", "value": "research", "effect": "NoSchedule"}]


def test_mig_claim_sets_and_release_resets_the_mig_config_label() -> None:
    spec = SPECS["mig"]
    node = make_node(spec.node_hostnames[0], labels={"nvidia.com/mig.config": "all-disabled"})
    claimed = merge_patch(node, m.node_claim_patch(spec, node, now=NOW))
    assert claimed["metadata"]["labels"]["nvidia.com/mig.config"] == "all-1g.10gb"
    released = merge_patch(claimed, m.node_release_patch(spec, claimed))
    assert released["metadata"]["labels"]["nvidia.com/mig.config"] == "all-disabled"
    assert released == node


# --- Credentials ---


def test_kubeconfig_structure() -> None:
    spec = make_spec()
    cfg = m.kubeconfig_for(spec, "sekrit")
    assert cfg["apiVersion"] == "v1" and cfg["kind"] == "Config"
    (cluster,) = cfg["clusters"]
    (user,) = cfg["users"]
    (context,) = cfg["contexts"]
    assert cluster == {"name": "gpu-portal", "cluster": {
        "server": "https://k8s.example.internal:6443",
        "certificate-authority-data": base64.b64encode(FAKE_CA_PEM.encode()).decode(),
    }}
    assert user == {"name": "tenant-research-r42-tenant-admin", "user": {"token": "sekrit"}}
    assert context["context"] == {"cluster": "gpu-portal", "user": user["name"], "namespace": "tenant-research-r42"}
    assert cfg["current-context"] == context["name"]
    assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]).decode() == FAKE_CA_PEM
    assert yaml.safe_load(m.kubeconfig_yaml(spec, "sekrit")) == cfg


def test_kubeconfig_accepts_base64_ca_as_is() -> None:
    b64 = base64.b64encode(FAKE_CA_PEM.encode()).decode()
    cfg = m.kubeconfig_for(make_spec(api_ca_data=b64), "t")
    assert cfg["clusters"][0]["cluster"]["certificate-authority-data"] == b64
    with pytest.raises(ValueError):
        m.kubeconfig_for(make_spec(), "")


def test_kubeconfig_loads_with_the_official_loader() -> None:
    configuration = k8s.Configuration()
    k8s_config.load_kube_config_from_dict(m.kubeconfig_for(make_spec(), "sekrit"),
                                          client_configuration=configuration)
    assert configuration.host == "https://k8s.example.internal:6443"
    assert configuration.auth_settings()["BearerToken"]["value"] == "Bearer sekrit"
    with open(configuration.ssl_ca_cert) as ca:
        assert ca.read().strip() == FAKE_CA_PEM.strip()


def test_token_lifetime_ends_with_the_window() -> None:
    spec = make_spec()
    assert m.token_expiration_seconds(spec, now=NOW) == int((WINDOW_END - NOW).total_seconds())
    assert m.token_expiration_seconds(spec, now=WINDOW_END - timedelta(seconds=30)) == m.MIN_TOKEN_SECONDS
    assert m.token_expiration_seconds(spec, now=WINDOW_END + timedelta(days=1)) == m.MIN_TOKEN_SECONDS


def test_taking_over_a_stale_mig_claim_switches_mig_off_for_a_whole_gpu_booking() -> None:
    # A MIG booking whose teardown never finished left its partition layout on the node; the next
    # booking wants whole GPUs, which a node split into MIG slices does not offer (nvidia.com/gpu = 0).
    stale = make_spec(tenant_slug="vision", reservation_id=7, mig_profile="1g.10gb", mig_instances_per_gpu=7,
                      window_end=NOW - timedelta(hours=1))
    node = make_node("h100-sxm-001", labels={"nvidia.com/mig.config": "all-disabled"})
    left_behind = merge_patch(node, m.node_claim_patch(stale, node, now=NOW - timedelta(days=1)))
    claimed = merge_patch(left_behind, m.node_claim_patch(make_spec(), left_behind, now=NOW))
    assert claimed["metadata"]["labels"]["nvidia.com/mig.config"] == "all-disabled"


def test_claim_of_a_whole_gpu_booking_leaves_an_operators_mig_layout_alone() -> None:
    node = make_node("h100-sxm-001", labels={"nvidia.com/mig.config": "custom-layout"})
    claimed = merge_patch(node, m.node_claim_patch(make_spec(), node, now=NOW))
    assert claimed["metadata"]["labels"]["nvidia.com/mig.config"] == "custom-layout"


def test_no_shared_storage_means_no_volume_claim_and_no_storage_quota() -> None:
    spec = make_spec(shared_storage_gib=0)
    assert "PersistentVolumeClaim" not in [obj["kind"] for obj in m.tenant_objects(spec)]
    assert m.resource_quota_manifest(spec)["spec"]["hard"]["requests.storage"] == "0Gi"
    with pytest.raises(ValueError, match="shared_storage_gib"):
        make_spec(shared_storage_gib=-1)


def test_a_container_asking_more_memory_than_the_default_without_a_limit_is_admitted() -> None:
    # The LimitRanger admission plugin sets a missing limit to the LimitRange's default, then validation
    # refuses a request above its limit ("must be less than or equal to memory limit"). A multi-GPU job
    # that requests 4 GPUs' memory and sets no limit must not be refused for it.
    (item,) = m.limit_range_manifest(make_spec())["spec"]["limits"]
    requests = {"memory": "480Gi", "nvidia.com/gpu": "4"}
    for key, limit in (item.get("default") or {}).items():
        if key in requests:
            assert m.parse_quantity(requests[key]) <= m.parse_quantity(limit), f"{key} request above its default limit"
