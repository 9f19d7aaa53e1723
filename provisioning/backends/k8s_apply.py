"""Apply a tenant's Kubernetes objects with the official ``kubernetes`` client.

- Namespaced objects (and the Namespace) go in by **server-side apply**: a PATCH with
  ``Content-Type: application/apply-patch+yaml``, ``fieldManager=gpu-portal`` and
  ``force=true``. Applying is idempotent, so a retried provisioning task converges instead
  of failing on "already exists"; force makes the portal the owner of the fields it
  declares even if someone edited them by hand, which is what a controller of record
  should do.
- Nodes are read, then changed by a conditional JSON merge patch (see ``k8s_manifests``
  for why taints cannot be server-side applied); a 409 from a concurrent change re-reads
  and retries a bounded number of times.
- Teardown deletes the Namespace (the API server's namespace controller deletes
  everything in it) and releases the nodes only once the Namespace is gone, so no tenant
  pod is still on a node when it is handed back. ``teardown`` returns False until then;
  the caller polls (a Celery retry).
- Credentials: a TokenRequest for the tenant's ServiceAccount, asked to expire with the window; the
  expiry the API server granted (it may cap it) is returned beside it.
- Draining a node the portal took out of service: the tenants' pods on it are evicted through
  the ``pods/eviction`` subresource (policy/v1), which honours PodDisruptionBudgets; a 429 is
  "not now" and is reported for a later try, never turned into a plain delete.

Responses are read raw (``_preload_content=False``) and parsed as JSON: the pure
functions in ``k8s_manifests`` work on the API's own camelCase dicts, and this does not
depend on how a given client version models them.

What was tried, and what was not. No Kubernetes API server runs where this was written.
Tests drive the real ``kubernetes`` client (configured from a real kubeconfig file)
against a loopback HTTP server that records the requests (method, path, query,
headers, body) and answers like the API server would for the calls used; they check the
paths, verbs, content types, ``fieldManager``/``force`` parameters, bodies, bearer token,
the 404/409 handling and the teardown order. Never tried against a live cluster: that the
API server accepts these apply bodies and merge patches (the objects are validated
against the published OpenAPI schemas, not by an API server's admission chain), the
409 on a stale ``resourceVersion`` in a merge patch, the eviction subresource's answers (modelled
on the API server's 201/404/429/500, not observed), TokenRequest expiry caps
(``--service-account-max-token-expiration`` may shorten tokens), namespace finalisation
timing, and the effect of the admission-plugin annotations, Pod Security labels,
NetworkPolicies (CNI-dependent) and the GPU operator's MIG label.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime
from typing import Any, Self

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from .k8s_manifests import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RESERVATION_LABEL,
    SERVICE_ACCOUNT_NAME,
    WINDOW_END_ANNOTATION,
    Manifest,
    NodeClaimConflict,
    TenantClusterSpec,
    _parse_rfc3339,
    admission_probe_pod,
    claim_release_patch,
    kubeconfig_yaml,
    node_claim_patch,
    node_cordon_patch,
    node_release_patch,
    node_uncordon_patch,
    tenant_objects,
    token_expiration_seconds,
)

FIELD_MANAGER = "gpu-portal"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"
# The kubelet's copy of a static pod: deleting it through the API does nothing.
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"


class K8sApplyError(Exception):
    """A Kubernetes request failed in a way the caller must handle (or retry later)."""


# (apiVersion, kind) -> (API class, patch method, namespaced). A fixed table rather than the
# dynamic client: no discovery round-trips, and an unexpected kind fails loudly here.
_APPLY_TABLE: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "Namespace"): ("core", "patch_namespace", False),
    ("v1", "ResourceQuota"): ("core", "patch_namespaced_resource_quota", True),
    ("v1", "LimitRange"): ("core", "patch_namespaced_limit_range", True),
    ("v1", "ServiceAccount"): ("core", "patch_namespaced_service_account", True),
    ("v1", "PersistentVolumeClaim"): ("core", "patch_namespaced_persistent_volume_claim", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networking", "patch_namespaced_network_policy", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("rbac", "patch_namespaced_role", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rbac", "patch_namespaced_role_binding", True),
}


def _json(response: Any) -> dict[str, Any]:
    data = response.data
    return json.loads(data) if data else {}


def _evictable(pod: dict[str, Any], namespaces: Collection[str]) -> bool:
    meta = pod.get("metadata") or {}
    if meta.get("namespace") not in namespaces or meta.get("deletionTimestamp"):
        return False
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    if MIRROR_POD_ANNOTATION in (meta.get("annotations") or {}):
        return False
    owners = meta.get("ownerReferences") or []
    return not any(ref.get("kind") == "DaemonSet" and ref.get("controller") for ref in owners)


def _refusal(exc: ApiException) -> str:
    """Say why the API server refused an eviction, with the budget's own words when it gives them."""
    try:
        status = json.loads(exc.body or "{}")
    except ValueError:
        status = {}
    causes = [c.get("message") for c in ((status.get("details") or {}).get("causes") or []) if c.get("message")]
    message = "; ".join(causes) or status.get("message") or exc.reason
    if exc.status == 429:
        return f"its PodDisruptionBudget allows no disruption now ({message}); try again later"
    return f"{exc.status} {message}"


def object_ref(manifest: Manifest) -> str:
    """Return ``Kind/namespace/name`` (or ``Kind/name``) for logs and results."""
    meta = manifest["metadata"]
    return "/".join(p for p in (manifest["kind"], meta.get("namespace"), meta["name"]) if p)


class TenantClusterApplier:
    """Create, update and remove one tenant's objects on a Kubernetes cluster."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        field_manager: str = FIELD_MANAGER,
        conflict_retries: int = 5,
        request_timeout: float = 30.0,
    ) -> None:
        self.api_client = api_client
        self.field_manager = field_manager
        self.conflict_retries = conflict_retries
        self.request_timeout = request_timeout
        self._apis: dict[str, Any] = {
            "core": k8s.CoreV1Api(api_client),
            "networking": k8s.NetworkingV1Api(api_client),
            "rbac": k8s.RbacAuthorizationV1Api(api_client),
        }

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str], *, context: str | None = None, **kwargs: Any) -> Self:
        """Build an applier for the cluster named by a kubeconfig file (the portal's own credentials)."""
        api_client = k8s_config.new_client_from_config(config_file=os.fspath(path), context=context)
        return cls(api_client, **kwargs)

    def close(self) -> None:
        """Release the client's connection pool."""
        self.api_client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _core(self) -> k8s.CoreV1Api:
        return self._apis["core"]

    # --- Server-side apply ---

    def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply one object and return the object as the API server now has it."""
        key = (manifest["apiVersion"], manifest["kind"])
        if key not in _APPLY_TABLE:
            raise K8sApplyError(f"no apply route for {key}")
        api_name, method_name, namespaced = _APPLY_TABLE[key]
        method: Callable[..., Any] = getattr(self._apis[api_name], method_name)
        meta = manifest["metadata"]
        kwargs: dict[str, Any] = {"namespace": meta["namespace"]} if namespaced else {}
        try:
            response = method(
                name=meta["name"],
                body=manifest,
                field_manager=self.field_manager,
                force=True,
                _content_type=APPLY_CONTENT_TYPE,
                _preload_content=False,
                _request_timeout=self.request_timeout,
                **kwargs,
            )
        except ApiException as exc:
            raise K8sApplyError(f"apply {object_ref(manifest)} failed: {exc.status} {exc.reason}") from exc
        return _json(response)

    def read_object(self, manifest: Manifest) -> dict[str, Any] | None:
        """Return the object ``manifest`` names as the API server has it now; None if it does not exist."""
        key = (manifest["apiVersion"], manifest["kind"])
        if key not in _APPLY_TABLE:
            raise K8sApplyError(f"no read route for {key}")
        api_name, method_name, namespaced = _APPLY_TABLE[key]
        method: Callable[..., Any] = getattr(self._apis[api_name], method_name.replace("patch_", "read_", 1))
        meta = manifest["metadata"]
        kwargs: dict[str, Any] = {"namespace": meta["namespace"]} if namespaced else {}
        try:
            response = method(name=meta["name"], _preload_content=False, _request_timeout=self.request_timeout,
                              **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise K8sApplyError(f"read {object_ref(manifest)} failed: {exc.status} {exc.reason}") from exc
        return _json(response)

    def apply_all(self, manifests: Iterable[Manifest]) -> list[str]:
        """Apply objects in the given order, stopping at the first failure; return their refs."""
        applied = []
        for manifest in manifests:
            self.apply(manifest)
            applied.append(object_ref(manifest))
        return applied

    def apply_objects(self, spec: TenantClusterSpec) -> list[str]:
        """Apply the reservation's Namespace and everything in it."""
        return self.apply_all(tenant_objects(spec))

    # --- Nodes ---

    def _read_node(self, hostname: str) -> dict[str, Any]:
        return _json(self._core.read_node(hostname, _preload_content=False, _request_timeout=self.request_timeout))

    def _patch_node_until_settled(
        self, hostname: str, make_patch: Callable[[dict[str, Any]], Manifest | None]
    ) -> bool:
        """Read the node, build a patch from it, send it; on 409 start over. Return whether it patched."""
        for _attempt in range(self.conflict_retries + 1):
            patch = make_patch(self._read_node(hostname))
            if patch is None:
                return False
            try:
                self._core.patch_node(
                    hostname,
                    patch,
                    field_manager=self.field_manager,
                    _content_type=MERGE_PATCH_CONTENT_TYPE,
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                )
                return True
            except ApiException as exc:
                if exc.status != 409:
                    raise
        raise K8sApplyError(f"node {hostname} kept changing; gave up after {self.conflict_retries} retries")

    def claim_node(self, spec: TenantClusterSpec, hostname: str, *, now: datetime | None = None) -> None:
        """Label, taint and annotate one node for the reservation (raises ``NodeClaimConflict``).

        A claim of another reservation whose window has ended is taken over only once none of that
        reservation's pods is on the node: its teardown is still running, and its pods (in their grace
        period, or stuck) hold the node's GPUs. A namespace stuck terminating with none of its pods on the
        node (a finalizer) does not hold the node.
        """
        at = now or datetime.now(UTC)

        def make_patch(node: dict[str, Any]) -> Manifest | None:
            patch = node_claim_patch(spec, node, now=at)
            holder = ((node.get("metadata") or {}).get("labels") or {}).get(RESERVATION_LABEL)
            if holder is not None and holder != str(spec.reservation_id):
                listed = self.list_namespaces(f"{MANAGED_BY_LABEL}={MANAGED_BY},{RESERVATION_LABEL}={holder}")
                left = {name for ns in listed if (name := (ns.get("metadata") or {}).get("name"))}
                running = [pod for pod in (self.pods_on_node(hostname) if left else [])
                           if (pod.get("metadata") or {}).get("namespace") in left
                           and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
                if running:
                    meta = running[0]["metadata"]
                    raise NodeClaimConflict(
                        f"node {hostname} is still claimed for reservation {holder}, whose pod "
                        f"{meta['namespace']}/{meta.get('name', '?')} is still on it", public=f"node {hostname} "
                        "is held by another booking (its teardown has not finished)", held_until=_parse_rfc3339(
                            ((node.get("metadata") or {}).get("annotations") or {}).get(WINDOW_END_ANNOTATION)))
            return patch

        try:
            self._patch_node_until_settled(hostname, make_patch)
        except ApiException as exc:
            raise K8sApplyError(f"claim node {hostname} failed: {exc.status} {exc.reason}") from exc

    def claim_nodes(self, spec: TenantClusterSpec, *, now: datetime | None = None) -> None:
        """Claim every node of the reservation."""
        for hostname in spec.node_hostnames:
            self.claim_node(spec, hostname, now=now)

    def _patch_existing_node(
        self, what: str, hostname: str, make_patch: Callable[[dict[str, Any]], Manifest | None]
    ) -> bool:
        """_patch_node_until_settled for a node that may have left the cluster (False: nothing to change)."""
        try:
            return self._patch_node_until_settled(hostname, make_patch)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise K8sApplyError(f"{what} node {hostname} failed: {exc.status} {exc.reason}") from exc

    def release_node(self, spec: TenantClusterSpec, hostname: str) -> bool:
        """Undo the claim on one node; return False if it was not (or no longer) this reservation's."""
        return self._patch_existing_node("release", hostname, lambda node: node_release_patch(spec, node))

    def release_nodes(self, spec: TenantClusterSpec) -> list[str]:
        """Release every node of the reservation; return the hostnames actually changed."""
        return [h for h in spec.node_hostnames if self.release_node(spec, h)]

    def cordon_node(self, hostname: str, reason: str) -> bool:
        """Mark the node unschedulable for the portal (reason annotated); False if it already was, or is gone."""
        return self._patch_existing_node("cordon", hostname, lambda node: node_cordon_patch(node, reason))

    def uncordon_node(self, hostname: str) -> bool:
        """Undo the portal's cordon; an operator's stays. Return whether it changed the node."""
        return self._patch_existing_node("uncordon", hostname, node_uncordon_patch)

    def list_nodes(self, label_selector: str | None = None, *, what: str = "list nodes") -> list[dict[str, Any]]:
        """Return every node (matching ``label_selector``, if given), as the API sends them."""
        try:
            response = self._core.list_node(label_selector=label_selector, _preload_content=False,
                                            _request_timeout=self.request_timeout)
        except ApiException as exc:
            raise K8sApplyError(f"{what} failed: {exc.status} {exc.reason}") from exc
        return list(_json(response).get("items") or [])

    def claimed_nodes(self, reservation_id: int | None = None) -> list[dict[str, Any]]:
        """Return the nodes that carry a claim of the portal (of one reservation, if given), as the API sends them."""
        selector = RESERVATION_LABEL if reservation_id is None else f"{RESERVATION_LABEL}={reservation_id}"
        return self.list_nodes(selector, what="list claimed nodes")

    def release_nodes_not_held(self, spec: TenantClusterSpec) -> list[str]:
        """Lift the reservation's claim from nodes outside its node set (it lost them); return those changed."""
        stale = [name for node in self.claimed_nodes(spec.reservation_id)
                 if (name := (node.get("metadata") or {}).get("name")) and name not in spec.node_hostnames]
        return [h for h in stale if self.release_node(spec, h)]

    def release_claim(self, hostname: str, reservation_id: str) -> bool:
        """Lift reservation ``reservation_id``'s claim from a node without its spec (reconcile's orphans).

        Return False if the node no longer carries that claim (or left the cluster).
        """
        return self._patch_existing_node(
            "release", hostname, lambda node: claim_release_patch(node, reservation_id=reservation_id))

    # --- Pods on a node the portal drains ---

    def pods_on_node(self, hostname: str) -> list[dict[str, Any]]:
        """Return every pod bound to the node, of any namespace, as the API sends them."""
        try:
            response = self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={hostname}", _preload_content=False,
                _request_timeout=self.request_timeout)
        except ApiException as exc:
            raise K8sApplyError(f"list pods on node {hostname} failed: {exc.status} {exc.reason}") from exc
        return list(_json(response).get("items") or [])

    def tenant_pods_on_node(self, hostname: str, namespaces: Collection[str]) -> list[dict[str, Any]]:
        """The node's pods a drain evicts: those of ``namespaces`` (the tenants') that still run there.

        Left alone, as ``kubectl drain`` leaves them: DaemonSet pods (their controller ignores the
        cordon and would put them straight back), static (mirror) pods, pods already terminating
        and pods that have finished.
        """
        return [pod for pod in self.pods_on_node(hostname) if _evictable(pod, namespaces)]

    def evict_pod(self, namespace: str, name: str) -> str | None:
        """Evict one pod through the Eviction API (policy/v1), which honours its PodDisruptionBudget.

        Return None once the eviction is accepted (or the pod is gone), else why it was refused:
        a 429 is a budget that allows no disruption now (try again later).
        """
        body = k8s.V1Eviction(api_version="policy/v1", kind="Eviction",
                              metadata=k8s.V1ObjectMeta(name=name, namespace=namespace))
        try:
            # This client version ignores _content_type here and would send no Content-Type at all.
            self._core.create_namespaced_pod_eviction(
                name, namespace, body, _headers={"Content-Type": "application/json"}, _preload_content=False,
                _request_timeout=self.request_timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            return _refusal(exc)
        return None

    def evict_tenant_pods(self, hostname: str, namespaces: Collection[str]) -> tuple[list[str], list[str]]:
        """Evict the tenants' pods from the node; return (evicted, refused) as ``ns/name`` (``: why``).

        Every pod is tried, whatever happened to the one before: one budget that says "not now"
        must not keep the others on a failing node.
        """
        evicted, refused = [], []
        for pod in self.tenant_pods_on_node(hostname, namespaces):
            meta = pod["metadata"]
            ref = f"{meta['namespace']}/{meta['name']}"
            why = self.evict_pod(meta["namespace"], meta["name"])
            if why is None:
                evicted.append(ref)
            else:
                refused.append(f"{ref}: {why}")
        return evicted, refused

    # --- Admission ---

    def admission_dry_run(self, spec: TenantClusterSpec) -> dict[str, Any]:
        """Create the probe pod in the reservation's namespace with ``dryRun=All`` (nothing is stored, nothing
        runs) and return the pod as admission left it (see ``k8s_manifests.admission_gaps``)."""
        try:
            response = self._core.create_namespaced_pod(
                spec.namespace, admission_probe_pod(spec), dry_run="All", _preload_content=False,
                _request_timeout=self.request_timeout)
        except ApiException as exc:
            raise K8sApplyError(f"dry-run pod in {spec.namespace} failed: {exc.status} {exc.reason}") from exc
        return _json(response)

    # --- Whole lifecycle ---

    def provision(self, spec: TenantClusterSpec, *, now: datetime | None = None) -> list[str]:
        """Claim the nodes, then apply the objects; idempotent, so safe to retry after a failure.

        Nodes first: a node held by someone else fails the step before any tenant object
        exists.
        """
        self.claim_nodes(spec, now=now)
        return self.apply_objects(spec)

    def namespace_exists(self, spec: TenantClusterSpec) -> bool:
        """Return whether the reservation's Namespace still exists (possibly terminating)."""
        return self.namespace_named_exists(spec.namespace)

    def namespace_named_exists(self, name: str) -> bool:
        """Return whether Namespace ``name`` still exists (possibly terminating)."""
        try:
            self._core.read_namespace(name, _preload_content=False, _request_timeout=self.request_timeout)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise K8sApplyError(f"read namespace {name} failed: {exc.status} {exc.reason}") from exc
        return True

    def list_namespaces(self, label_selector: str) -> list[dict[str, Any]]:
        """Return the Namespaces matching ``label_selector``, as the API sends them."""
        try:
            response = self._core.list_namespace(label_selector=label_selector, _preload_content=False,
                                                 _request_timeout=self.request_timeout)
        except ApiException as exc:
            raise K8sApplyError(f"list namespaces failed: {exc.status} {exc.reason}") from exc
        return list(_json(response).get("items") or [])

    def delete_namespace(self, name: str) -> None:
        """Delete Namespace ``name`` (asynchronous: it may stay, terminating, for a while)."""
        try:
            self._core.delete_namespace(name, propagation_policy="Background", _preload_content=False,
                                        _request_timeout=self.request_timeout)
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or already terminating
                raise K8sApplyError(f"delete namespace {name} failed: {exc.status} {exc.reason}") from exc

    def teardown(self, spec: TenantClusterSpec) -> bool:
        """Delete the Namespace; once it is gone, release every node claimed for it. Return True when all is done.

        Call again until it returns True: namespace deletion is asynchronous (pods get
        their grace period, the PVC's volume is reclaimed per its storage class).
        """
        try:
            self._core.delete_namespace(
                spec.namespace,
                propagation_policy="Background",
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            # 404: already gone. 409: already terminating -- the namespace registry refuses a
            # second delete while its finalizers run ("The system is ensuring all content is
            # removed from this namespace"), which is exactly the state we are waiting for.
            if exc.status not in (404, 409):
                raise K8sApplyError(f"delete namespace {spec.namespace} failed: {exc.status} {exc.reason}") from exc
        if self.namespace_exists(spec):
            return False
        self.release_nodes(spec)
        # And a claim left on a node the reservation no longer holds (a swap that failed half-way, a node
        # lost while a provisioning that then failed ran): nothing else lifts it once the cluster is gone.
        self.release_nodes_not_held(spec)
        return True

    # --- Credentials ---

    def issue_token(self, spec: TenantClusterSpec, *, now: datetime | None = None) -> str:
        """Request a token for the tenant's ServiceAccount that expires at the window end."""
        return self.request_token(spec, now=now)[0]

    def request_token(self, spec: TenantClusterSpec, *, now: datetime | None = None) -> tuple[str, datetime | None]:
        """Request a token asked to expire at the window end; return it and when it really expires.

        The API server may grant less than asked (``--service-account-max-token-expiration``): the
        answer's ``status.expirationTimestamp`` is the truth (None if it gave none).
        """
        at = now or datetime.now(UTC)
        body = k8s.AuthenticationV1TokenRequest(
            api_version="authentication.k8s.io/v1",
            kind="TokenRequest",
            spec=k8s.V1TokenRequestSpec(audiences=[], expiration_seconds=token_expiration_seconds(spec, now=at)),
        )
        try:
            response = self._core.create_namespaced_service_account_token(
                SERVICE_ACCOUNT_NAME,
                spec.namespace,
                body,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            raise K8sApplyError(f"token request for {spec.namespace} failed: {exc.status} {exc.reason}") from exc
        status = _json(response).get("status") or {}
        token = status.get("token")
        if not token:
            raise K8sApplyError(f"token request for {spec.namespace} returned no token")
        return token, _parse_rfc3339(status.get("expirationTimestamp"))

    def tenant_kubeconfig(self, spec: TenantClusterSpec, *, now: datetime | None = None) -> str:
        """Issue a token and return the tenant's kubeconfig YAML (a secret: encrypt it at rest)."""
        return self.tenant_credentials(spec, now=now)[0]

    def tenant_credentials(self, spec: TenantClusterSpec, *,
                           now: datetime | None = None) -> tuple[str, datetime | None]:
        """The tenant's kubeconfig YAML and when its token expires (see ``request_token``)."""
        token, expires = self.request_token(spec, now=now)
        return kubeconfig_yaml(spec, token), expires
