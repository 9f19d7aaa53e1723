"""Build the Kubernetes objects of one tenant's virtual cluster from a plain, typed spec.

Everything here is pure: no client, no I/O, no Django. The functions return plain dicts
shaped exactly as the Kubernetes API expects them (camelCase keys, quantities as strings),
so the same dicts can be server-side applied by ``k8s_apply``, dumped to YAML for a human,
or validated against the published schemas in tests.

What one reservation gets, all in its own namespace ``tenant-<slug>-r<id>``:

- the Namespace, labelled with tenant and reservation, annotated so that the
  ``PodNodeSelector`` / ``PodTolerationRestriction`` admission plugins (which the cluster must
  enable; ``admission_gaps`` checks a dry-run pod for their effect) pin its pods to the
  reservation's nodes and give them the matching toleration, and
  with Pod Security Admission ``baseline`` enforced;
- a ResourceQuota on ``requests.nvidia.com/gpu`` (or the MIG resource), pods and storage;
- a LimitRange with default container memory and CPU requests (no default limit);
- NetworkPolicies: default-deny (ingress and egress), allow within the namespace,
  allow DNS to kube-dns in ``kube-system``;
- a ServiceAccount, and a Role + RoleBinding making it the tenant's admin in the namespace;
- a PersistentVolumeClaim for the shared storage (none when the booking asked for none);
- per node: a label ``gpuportal.io/tenant=<slug>`` (plus reservation and CUDA labels), a
  taint ``dedicated=<slug>:NoSchedule`` and an annotation holding the window end, and the
  inverse patch for teardown.

Node patches are JSON merge patches computed from the node as it is now, not
server-side-apply bodies: ``spec.taints`` is an *atomic* list in the Node schema
(``x-kubernetes-list-type: atomic``), so applying our one taint would replace every other
taint on the node (the GPU operator's, the node lifecycle controller's). Instead the full
new list is computed here and sent together with the node's ``resourceVersion``, which
makes the API server refuse the patch (409) if the node changed in between.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import yaml
from kubernetes.utils import parse_quantity

Manifest = dict[str, Any]

# --- Names of labels, annotations and objects (part of the contract with the cluster) ---

TENANT_LABEL = "gpuportal.io/tenant"
RESERVATION_LABEL = "gpuportal.io/reservation"
CUDA_VERSION_LABEL = "gpuportal.io/cuda-version"
WINDOW_END_ANNOTATION = "gpuportal.io/window-end"
# Set with spec.unschedulable when the portal cordons a node it took out of service; its value is why.
CORDON_ANNOTATION = "gpuportal.io/cordon-reason"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-portal"

TAINT_KEY = "dedicated"
TAINT_EFFECT = "NoSchedule"

# The NVIDIA GPU operator's MIG manager repartitions a node when this label changes; the
# values name entries of its default mig-parted config ("all-1g.10gb", "all-disabled", ...).
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_DISABLED = "all-disabled"

GPU_RESOURCE = "nvidia.com/gpu"

# Read by the PodNodeSelector and PodTolerationRestriction admission plugins when the
# cluster enables them; ignored (harmlessly) otherwise.
NODE_SELECTOR_ANNOTATION = "scheduler.alpha.kubernetes.io/node-selector"
DEFAULT_TOLERATIONS_ANNOTATION = "scheduler.alpha.kubernetes.io/defaultTolerations"

SERVICE_ACCOUNT_NAME = "tenant-admin"
ROLE_NAME = "tenant-admin"
ROLE_BINDING_NAME = "tenant-admin"
QUOTA_NAME = "gpu-quota"
LIMIT_RANGE_NAME = "container-defaults"
DEFAULT_DENY_POLICY = "default-deny"
ALLOW_SAME_NAMESPACE_POLICY = "allow-same-namespace"
ALLOW_DNS_POLICY = "allow-dns"
SHARED_PVC_NAME = "shared"

# The kubelet's default --max-pods; the quota should never be what stops a full node.
PODS_PER_NODE = 110
# Shortest lifetime the TokenRequest API accepts.
MIN_TOKEN_SECONDS = 600

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")  # \Z, not $: no trailing newline
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_MIG_PROFILE_RE = re.compile(r"^[1-7]g\.[1-9][0-9]*gb$")
_POD_SECURITY_LEVELS = ("privileged", "baseline", "restricted")


class NodeClaimConflict(Exception):
    """The node is dedicated to someone else whose window has not ended.

    ``public`` says so without naming the other booking (its id, its window, a taint's value): it is what
    the tenant whose cluster could not claim the node is shown; the full message is for the operators.
    ``held_until`` is when the other booking's window ends (None: unknown, or not a booking's claim): a
    claim refused only until then is a hand-over still to come, not a failure.
    """

    def __init__(self, message: str, *, public: str = "", held_until: datetime | None = None) -> None:
        super().__init__(message)
        self.public = public or message
        self.held_until = held_until


# --- Names ---


def is_dns_label(name: str) -> bool:
    """Return whether ``name`` is a valid RFC 1123 label (namespace and most object names)."""
    return len(name) <= DNS_LABEL_MAX and bool(_DNS_LABEL_RE.match(name))


def is_dns_subdomain(name: str) -> bool:
    """Return whether ``name`` is a valid RFC 1123 subdomain (node and storage class names)."""
    return (
        0 < len(name) <= DNS_SUBDOMAIN_MAX
        and all(is_dns_label(part) for part in name.split("."))
    )


def is_label_value(value: str) -> bool:
    """Return whether ``value`` may be used as a Kubernetes label value."""
    return len(value) <= DNS_LABEL_MAX and bool(_LABEL_VALUE_RE.match(value))


def dns_label(text: str, max_length: int = DNS_LABEL_MAX) -> str:
    """Turn arbitrary text into a deterministic RFC 1123 label of at most ``max_length``.

    Text that already is a valid label comes back unchanged. Anything else is lowercased,
    runs of invalid characters become one ``-``, and a short hash of the *original* text
    is appended, so that two slugs which sanitise to the same string ("a_b", "a.b") still
    get different names, and truncation of long slugs stays unique.
    """
    if max_length < 8:
        raise ValueError("max_length must leave room for the hash suffix (at least 8)")
    if len(text) <= max_length and is_dns_label(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    cleaned = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    cleaned = cleaned[: max_length - len(digest) - 1].rstrip("-")
    return f"{cleaned}-{digest}" if cleaned else f"x{digest}"


# --- Spec ---


@dataclass(frozen=True, kw_only=True)
class TenantClusterSpec:
    """Everything needed to render one reservation's Kubernetes objects.

    ``api_ca_data`` is the cluster CA bundle, either PEM text or already base64-encoded
    (as in a kubeconfig's ``certificate-authority-data``). ``window_end`` must be aware.
    With ``mig_profile`` (e.g. ``"1g.10gb"``) the quota is on the GPU operator's "mixed"
    strategy resource ``nvidia.com/mig-<profile>``, and ``mig_instances_per_gpu`` (which
    depends on the GPU model, so the caller supplies it) sizes it.

    ``node_hostnames`` may be empty only with ``allow_no_nodes``: a reservation that lost every node
    (each failed, no spare free) keeps its namespace (its data, its kubeconfig) with a quota of zero
    GPUs and zero pods, and claims no node. Provisioning never builds one that way.
    """

    tenant_slug: str
    reservation_id: int
    node_hostnames: tuple[str, ...]
    gpus_per_node: int
    window_end: datetime
    cuda_version: str
    api_server_url: str
    api_ca_data: str
    storage_class: str
    shared_storage_gib: int
    default_memory_per_gpu_gib: int = 64
    default_cpu_per_gpu: int = 8
    mig_profile: str | None = None
    mig_instances_per_gpu: int | None = None
    pod_security_level: str = "baseline"
    cluster_name: str = "gpu-portal"
    allow_no_nodes: bool = False

    def __post_init__(self) -> None:
        # Accept any sequence of hostnames but store a tuple so the spec stays hashable.
        object.__setattr__(self, "node_hostnames", tuple(self.node_hostnames))
        errors: list[str] = []
        if not self.tenant_slug:
            errors.append("tenant_slug is empty")
        if isinstance(self.reservation_id, bool) or not isinstance(self.reservation_id, int) \
                or self.reservation_id < 1:
            errors.append("reservation_id must be a positive integer")
        if not self.node_hostnames and not self.allow_no_nodes:
            errors.append("node_hostnames is empty")
        if len(set(self.node_hostnames)) != len(self.node_hostnames):
            errors.append("node_hostnames has duplicates")
        errors += [f"node hostname {h!r} is not a DNS-1123 subdomain"
                   for h in self.node_hostnames if not is_dns_subdomain(h)]
        for field_name in ("gpus_per_node", "default_memory_per_gpu_gib", "default_cpu_per_gpu"):
            if getattr(self, field_name) < 1:
                errors.append(f"{field_name} must be at least 1")
        if self.shared_storage_gib < 0:
            errors.append("shared_storage_gib must not be negative")
        if self.window_end.tzinfo is None or self.window_end.utcoffset() is None:
            errors.append("window_end must be timezone-aware")
        if not is_label_value(self.cuda_version) or not self.cuda_version:
            errors.append(f"cuda_version {self.cuda_version!r} is not a valid label value")
        if not is_dns_subdomain(self.storage_class):
            errors.append(f"storage_class {self.storage_class!r} is not a DNS-1123 subdomain")
        if urlsplit(self.api_server_url).scheme not in ("https", "http") \
                or not urlsplit(self.api_server_url).hostname:
            errors.append("api_server_url must be an http(s) URL")
        try:
            _ca_data_b64(self.api_ca_data)
        except ValueError as exc:
            errors.append(str(exc))
        if (self.mig_profile is None) != (self.mig_instances_per_gpu is None):
            errors.append("mig_profile and mig_instances_per_gpu go together")
        if self.mig_profile is not None and not _MIG_PROFILE_RE.match(self.mig_profile):
            errors.append(f"mig_profile {self.mig_profile!r} is not like '1g.10gb'")
        if self.mig_instances_per_gpu is not None and not 1 <= self.mig_instances_per_gpu <= 7:
            errors.append("mig_instances_per_gpu must be 1..7")
        if self.pod_security_level not in _POD_SECURITY_LEVELS:
            errors.append(f"pod_security_level must be one of {_POD_SECURITY_LEVELS}")
        if not is_dns_label(self.cluster_name):
            errors.append("cluster_name must be a DNS-1123 label")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def tenant_label(self) -> str:
        """Return the tenant slug as a label/taint value (a DNS-1123 label)."""
        return dns_label(self.tenant_slug)

    @property
    def namespace(self) -> str:
        """Return ``tenant-<slug>-r<id>``, shortening the slug part to stay within 63 characters."""
        prefix, suffix = "tenant-", f"-r{self.reservation_id}"
        return f"{prefix}{dns_label(self.tenant_slug, DNS_LABEL_MAX - len(prefix) - len(suffix))}{suffix}"

    @property
    def gpu_resource(self) -> str:
        """Return the extended resource the tenant's pods request: whole GPUs or MIG slices."""
        return f"nvidia.com/mig-{self.mig_profile}" if self.mig_profile else GPU_RESOURCE

    @property
    def gpu_units_per_node(self) -> int:
        """Return how many units of ``gpu_resource`` one node offers."""
        return self.gpus_per_node * (self.mig_instances_per_gpu or 1)

    @property
    def gpu_units_total(self) -> int:
        """Return the reservation's GPU units: nodes × GPUs (× MIG slices per GPU)."""
        return len(self.node_hostnames) * self.gpu_units_per_node

    @property
    def window_end_rfc3339(self) -> str:
        """Return the window end in UTC with a ``Z`` suffix, as the API's own timestamps."""
        return self.window_end.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ca_data_b64(ca: str) -> str:
    """Return the CA bundle base64-encoded, accepting PEM text or base64; refuse anything else."""
    stripped = ca.strip()
    if stripped.startswith("-----BEGIN"):
        return base64.b64encode(stripped.encode() + b"\n").decode()
    if not stripped:
        raise ValueError("api_ca_data is empty")
    compact = "".join(stripped.split())  # base64 wrapped over several lines is still base64
    try:
        base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("api_ca_data is neither PEM nor base64") from None
    return compact


# --- Namespaced objects ---


def _labels(spec: TenantClusterSpec) -> dict[str, str]:
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        TENANT_LABEL: spec.tenant_label,
        RESERVATION_LABEL: str(spec.reservation_id),
    }


def _meta(spec: TenantClusterSpec, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec)}


def _tenant_toleration(spec: TenantClusterSpec) -> dict[str, str]:
    return {"key": TAINT_KEY, "operator": "Equal", "value": spec.tenant_label, "effect": TAINT_EFFECT}


def namespace_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build the reservation's Namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": spec.namespace,
            "labels": {
                **_labels(spec),
                CUDA_VERSION_LABEL: spec.cuda_version,
                # Privileged pods could reach the host network (bypassing NetworkPolicy)
                # and the kubelet's credentials; baseline forbids that by default.
                "pod-security.kubernetes.io/enforce": spec.pod_security_level,
                "pod-security.kubernetes.io/warn": spec.pod_security_level,
            },
            "annotations": {
                WINDOW_END_ANNOTATION: spec.window_end_rfc3339,
                # Select on the reservation, not the tenant: two reservations of one tenant
                # must not spill onto each other's nodes (their quotas are separate).
                NODE_SELECTOR_ANNOTATION: f"{RESERVATION_LABEL}={spec.reservation_id}",
                DEFAULT_TOLERATIONS_ANNOTATION: json.dumps([_tenant_toleration(spec)]),
            },
        },
    }


def resource_quota_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build the quota: the reservation's GPUs, pods for its nodes, and its shared storage."""
    nodes = len(spec.node_hostnames)
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": _meta(spec, QUOTA_NAME),
        "spec": {
            "hard": {
                # Extended resources can only be quota'd through their requests.
                f"requests.{spec.gpu_resource}": str(spec.gpu_units_total),
                "pods": str(nodes * PODS_PER_NODE),
                "requests.storage": f"{spec.shared_storage_gib}Gi",
                # NodePorts open on every node, other tenants' included, and load
                # balancers cost money outside the booking: neither is part of the product.
                "services.nodeports": "0",
                "services.loadbalancers": "0",
            }
        },
    }


def limit_range_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build container defaults: a memory and a CPU request, per GPU, and no default limit.

    No default memory limit: the LimitRanger admission plugin gives a container without a limit the
    default one, and the API server then refuses any container whose request exceeds it ("must be less
    than or equal to memory limit"), so a job asking for more than one GPU's memory without a limit of its
    own would not be admitted. The nodes are the reservation's alone: a container without a limit can only
    overcommit its own tenant's node. There is deliberately no GPU entry either. A default GPU limit
    would hand every container, sidecars and CPU-only helpers included, a GPU; and a ``max`` alone is no safer,
    because the API server defaults a missing ``default`` to ``max``, which would give every
    container a whole node's GPUs. A LimitRange also cannot scale by a container's GPU
    count, so these defaults are right for one-GPU containers; larger jobs set their own.
    """
    memory = f"{spec.default_memory_per_gpu_gib}Gi"
    return {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _meta(spec, LIMIT_RANGE_NAME),
        "spec": {
            "limits": [
                {
                    "type": "Container",
                    # Requests only (see above); CPU limits would also throttle data loaders.
                    "defaultRequest": {"memory": memory, "cpu": str(spec.default_cpu_per_gpu)},
                }
            ]
        },
    }


def network_policy_manifests(spec: TenantClusterSpec) -> list[Manifest]:
    """Build default-deny (both directions), allow-within-namespace and allow-DNS policies.

    Policies are additive, so the default-deny selects every pod and allows nothing; the
    two others open exactly what a tenant's jobs need among themselves and for name lookup.
    """
    same_namespace = [{"podSelector": {}}]
    dns_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(spec, DEFAULT_DENY_POLICY),
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(spec, ALLOW_SAME_NAMESPACE_POLICY),
            "spec": {
                "podSelector": {},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": same_namespace}],
                "egress": [{"to": same_namespace}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(spec, ALLOW_DNS_POLICY),
            "spec": {
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [dns_peer],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                    }
                ],
            },
        },
    ]


def service_account_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build the ServiceAccount the tenant's kubeconfig authenticates as."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(spec, SERVICE_ACCOUNT_NAME),
        # It is for people via the kubeconfig, not for pods: keep its token out of pods.
        "automountServiceAccountToken": False,
    }


_ALL_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
_READ_VERBS = ["get", "list", "watch"]


def role_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build the tenant-admin Role: run and manage workloads, read (not change) the guard rails.

    Not a wildcard: ``*`` would include the ResourceQuota, LimitRange and NetworkPolicies
    that bound the reservation, and RBAC objects through which it could be widened.
    """
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(spec, ROLE_NAME),
        "rules": [
            {
                "apiGroups": [""],
                "resources": [
                    "pods", "pods/log", "pods/exec", "pods/attach", "pods/portforward",
                    "services", "endpoints", "configmaps", "secrets", "persistentvolumeclaims",
                    "serviceaccounts",
                ],
                "verbs": _ALL_VERBS,
            },
            {
                "apiGroups": ["apps"],
                "resources": ["deployments", "statefulsets", "replicasets", "daemonsets"],
                "verbs": _ALL_VERBS,
            },
            {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": _ALL_VERBS},
            {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": _ALL_VERBS},
            {
                "apiGroups": [""],
                "resources": ["resourcequotas", "limitranges", "events", "pods/status"],
                "verbs": _READ_VERBS,
            },
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": _READ_VERBS},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": _READ_VERBS},
        ],
    }


def role_binding_manifest(spec: TenantClusterSpec) -> Manifest:
    """Bind the tenant-admin Role to the tenant's ServiceAccount."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(spec, ROLE_BINDING_NAME),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT_NAME, "namespace": spec.namespace}],
    }


def shared_pvc_manifest(spec: TenantClusterSpec) -> Manifest:
    """Build the shared-storage claim, mountable from every node of the reservation."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(spec, SHARED_PVC_NAME),
        "spec": {
            # Shared across nodes: pods of a multi-node job mount it at once.
            "accessModes": ["ReadWriteMany"],
            "storageClassName": spec.storage_class,
            "volumeMode": "Filesystem",
            "resources": {"requests": {"storage": f"{spec.shared_storage_gib}Gi"}},
        },
    }


def tenant_objects(spec: TenantClusterSpec) -> list[Manifest]:
    """Return every namespaced object of the reservation, Namespace first, in apply order.

    Quota, limits and network policies come before anything a tenant could run, so that
    nothing ever runs unbounded or unisolated, even for the seconds between two requests.
    A reservation without shared storage (0 GiB) gets no PersistentVolumeClaim.
    """
    objects = [
        namespace_manifest(spec),
        resource_quota_manifest(spec),
        limit_range_manifest(spec),
        *network_policy_manifests(spec),
        service_account_manifest(spec),
        role_manifest(spec),
        role_binding_manifest(spec),
    ]
    if spec.shared_storage_gib:
        objects.append(shared_pvc_manifest(spec))
    return objects


# --- Admission check ---

ADMISSION_PROBE_NAME = "gpu-portal-admission-check"


def admission_probe_pod(spec: TenantClusterSpec) -> Manifest:
    """A pod with no node selector and no tolerations, created with ``dryRun=All`` in the reservation's namespace:
    what the API server answers shows what its admission plugins would add to a tenant's pod."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": ADMISSION_PROBE_NAME, "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.9",
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
        },
    }


def admission_gaps(spec: TenantClusterSpec, admitted: Mapping[str, Any]) -> list[str]:
    """What the admitted probe pod lacks for the tenant's pods to run on the reservation's nodes only: the
    namespace's node selector (``PodNodeSelector``) and the toleration of its nodes' taint
    (``PodTolerationRestriction``). [] when both admission plugins acted."""
    pod_spec = admitted.get("spec") or {}
    gaps = []
    if (pod_spec.get("nodeSelector") or {}).get(RESERVATION_LABEL) != str(spec.reservation_id):
        gaps.append(f"PodNodeSelector (no {RESERVATION_LABEL}={spec.reservation_id} node selector added)")
    wanted = _tenant_toleration(spec)
    if not any(all(t.get(k) == v for k, v in wanted.items()) for t in pod_spec.get("tolerations") or []):
        gaps.append(f"PodTolerationRestriction (no {TAINT_KEY}={spec.tenant_label} toleration added)")
    return gaps


# --- Drift ---


def drifted_fields(manifest: Manifest, live: Mapping[str, Any]) -> list[str]:
    """Return the paths of what ``manifest`` declares that the object as the API server has it (``live``) lacks
    or holds otherwise; [] when it holds all of it.

    Only what the portal declares counts (its spec, rules, labels and annotations): fields the API server
    adds (defaults, status, its own labels, a PVC's volumeName) are not drift, and a quantity written in
    another form ("1Ti" for "1024Gi", as the API server canonicalises it) is the same quantity.
    """
    declared: dict[str, Any] = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = manifest.get("metadata") or {}
    declared["metadata"] = {k: meta[k] for k in ("labels", "annotations") if k in meta}
    return _differences(declared, live, "")


def _differences(want: Any, have: Any, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(have, Mapping):
            return [path or "."]
        return [d for key, value in want.items() for d in _differences(value, have.get(key), f"{path}.{key}")]
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return [path]
        return [d for i, (w, h) in enumerate(zip(want, have, strict=True)) for d in _differences(w, h, f"{path}[{i}]")]
    if want == have or (isinstance(want, str) and isinstance(have, str) and _same_quantity(want, have)):
        return []
    return [path]


def _same_quantity(a: str, b: str) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, TypeError, ArithmeticError):
        return False


# --- Node patches ---


def _parse_rfc3339(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else None


def _node_parts(node: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str], list[dict[str, Any]], str | None]:
    metadata = node.get("metadata") or {}
    return (
        dict(metadata.get("labels") or {}),
        dict(metadata.get("annotations") or {}),
        [dict(t) for t in ((node.get("spec") or {}).get("taints") or [])],
        metadata.get("resourceVersion"),
    )


def _with_resource_version(metadata: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
    # A merge patch carrying resourceVersion is conditional: the API server answers 409
    # if the node changed since it was read, so a concurrent taint is never lost.
    return {"resourceVersion": resource_version, **metadata} if resource_version else metadata


def _is_portal_mig_layout(value: str | None) -> bool:
    """Return whether a ``nvidia.com/mig.config`` value is one the portal sets (``all-<profile>``)."""
    return bool(value) and value.startswith("all-") and bool(_MIG_PROFILE_RE.match(value[len("all-"):]))


def node_claim_patch(spec: TenantClusterSpec, node: Mapping[str, Any], *, now: datetime) -> Manifest:
    """Return the merge patch that dedicates ``node`` (as read from the API) to the reservation.

    Idempotent: claiming a node this reservation already holds yields the same patch. A
    claim left behind by an earlier reservation whose window has ended (a teardown that
    never finished) is taken over. Raise ``NodeClaimConflict`` if the node is held by
    another reservation still in its window, or carries a ``dedicated`` taint the portal
    did not set.
    """
    labels, annotations, taints, resource_version = _node_parts(node)
    name = (node.get("metadata") or {}).get("name", "?")
    holder = labels.get(RESERVATION_LABEL)
    if holder is not None and holder != str(spec.reservation_id):
        held_until = _parse_rfc3339(annotations.get(WINDOW_END_ANNOTATION))
        if held_until is None or held_until > now:
            raise NodeClaimConflict(
                f"node {name} is held by reservation {holder} until "
                f"{annotations.get(WINDOW_END_ANNOTATION, 'an unknown time')}",
                public=f"node {name} is held by another booking (its teardown has not finished)",
                held_until=held_until,
            )
    elif holder is None:
        foreign = [t for t in taints if t.get("key") == TAINT_KEY and t.get("value") != spec.tenant_label]
        if foreign:
            raise NodeClaimConflict(f"node {name} carries a {TAINT_KEY} taint the portal did not set: {foreign}",
                                    public=f"node {name} carries a {TAINT_KEY} taint the portal did not set")

    new_labels: dict[str, str] = {
        TENANT_LABEL: spec.tenant_label,
        RESERVATION_LABEL: str(spec.reservation_id),
        CUDA_VERSION_LABEL: spec.cuda_version,
    }
    if spec.mig_profile:
        new_labels[MIG_CONFIG_LABEL] = f"all-{spec.mig_profile}"
    elif _is_portal_mig_layout(labels.get(MIG_CONFIG_LABEL)):
        # A stale claim taken over (its teardown never reset the layout): a whole-GPU booking must not
        # get a node split into MIG slices, which offers no nvidia.com/gpu at all.
        new_labels[MIG_CONFIG_LABEL] = MIG_DISABLED
    # Keep every other taint; ours replaces any earlier "dedicated" one.
    new_taints = [t for t in taints if t.get("key") != TAINT_KEY]
    new_taints.append({"key": TAINT_KEY, "value": spec.tenant_label, "effect": TAINT_EFFECT})
    return {
        "metadata": _with_resource_version(
            {"labels": new_labels, "annotations": {WINDOW_END_ANNOTATION: spec.window_end_rfc3339}},
            resource_version,
        ),
        "spec": {"taints": new_taints},
    }


def node_release_patch(spec: TenantClusterSpec, node: Mapping[str, Any]) -> Manifest | None:
    """Return the merge patch that undoes ``node_claim_patch``, or None if there is nothing to undo.

    Only a node this reservation holds is touched: after a late teardown the node may
    already belong to the next reservation, whose claim must survive.
    """
    return claim_release_patch(node, reservation_id=str(spec.reservation_id), tenant_label=spec.tenant_label,
                               reset_mig=bool(spec.mig_profile))


def claim_release_patch(node: Mapping[str, Any], *, reservation_id: str, tenant_label: str | None = None,
                        reset_mig: bool | None = None) -> Manifest | None:
    """Return the merge patch that lifts reservation ``reservation_id``'s claim from ``node``, or None.

    For a claim whose reservation the caller no longer knows (reconcile: no spec), the
    tenant and the MIG layout are read from what the claim itself put on the node: the
    ``dedicated`` taint removed is the one whose value is the node's tenant label (another
    ``dedicated`` taint is not the portal's and stays), and a MIG layout of the portal's
    form (``all-<profile>``) is switched off.
    """
    labels, _annotations, taints, resource_version = _node_parts(node)
    if labels.get(RESERVATION_LABEL) != reservation_id:
        return None
    if tenant_label is None:
        tenant_label = labels.get(TENANT_LABEL)
    if reset_mig is None:
        reset_mig = _is_portal_mig_layout(labels.get(MIG_CONFIG_LABEL))
    removed_labels: dict[str, str | None] = {
        TENANT_LABEL: None,
        RESERVATION_LABEL: None,
        CUDA_VERSION_LABEL: None,
    }
    if reset_mig:
        removed_labels[MIG_CONFIG_LABEL] = MIG_DISABLED
    kept_taints = [
        t for t in taints
        if not (tenant_label is not None and t.get("key") == TAINT_KEY and t.get("value") == tenant_label)
    ]
    return {
        "metadata": _with_resource_version(
            {"labels": removed_labels, "annotations": {WINDOW_END_ANNOTATION: None}},
            resource_version,
        ),
        "spec": {"taints": kept_taints},
    }


# --- Credentials ---


def token_expiration_seconds(spec: TenantClusterSpec, *, now: datetime) -> int:
    """Return a ServiceAccount token lifetime that ends with the window (at least 10 minutes)."""
    return max(MIN_TOKEN_SECONDS, math.ceil((spec.window_end - now).total_seconds()))


def kubeconfig_for(spec: TenantClusterSpec, token: str) -> Manifest:
    """Build a kubeconfig for the tenant's ServiceAccount, defaulting to its namespace."""
    if not token:
        raise ValueError("token is empty")
    user = f"{spec.namespace}-{SERVICE_ACCOUNT_NAME}"
    context = f"{spec.cluster_name}-{spec.namespace}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [
            {
                "name": spec.cluster_name,
                "cluster": {
                    "server": spec.api_server_url,
                    "certificate-authority-data": _ca_data_b64(spec.api_ca_data),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {"name": context, "context": {"cluster": spec.cluster_name, "user": user, "namespace": spec.namespace}}
        ],
        "current-context": context,
    }


def kubeconfig_yaml(spec: TenantClusterSpec, token: str) -> str:
    """Render ``kubeconfig_for`` as the YAML file ``kubectl`` reads."""
    return yaml.safe_dump(kubeconfig_for(spec, token), sort_keys=False)


def manifests_yaml(manifests: Sequence[Manifest]) -> str:
    """Render manifests as one multi-document YAML stream (for review or ``kubectl apply -f``)."""
    return yaml.safe_dump_all(list(manifests), sort_keys=False)


# --- Cordons (a node out of service in the portal) ---


def node_cordon_patch(node: Mapping[str, Any], reason: str) -> Manifest | None:
    """Return the merge patch that cordons ``node`` for the portal with ``reason``; None if it already is.

    A node an operator cordoned stays theirs: the portal adds its reason, so it may uncordon it later
    only if it was the portal that cordoned it (the annotation is set only when it was schedulable).
    """
    _labels, annotations, _taints, resource_version = _node_parts(node)
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    if cordoned and (CORDON_ANNOTATION not in annotations or annotations[CORDON_ANNOTATION] == reason):
        return None
    return {"metadata": _with_resource_version({"annotations": {CORDON_ANNOTATION: reason}}, resource_version),
            "spec": {"unschedulable": True}}


def node_uncordon_patch(node: Mapping[str, Any]) -> Manifest | None:
    """Return the merge patch that undoes the portal's cordon; None if the portal did not cordon it."""
    _labels, annotations, _taints, resource_version = _node_parts(node)
    if CORDON_ANNOTATION not in annotations:
        return None
    return {"metadata": _with_resource_version({"annotations": {CORDON_ANNOTATION: None}}, resource_version),
            "spec": {"unschedulable": None}}
