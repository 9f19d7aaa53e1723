"""Kubernetes backend: per reservation a namespace with quota, limits, network policies, RBAC,
a shared PVC and a ServiceAccount kubeconfig; nodes labelled and tainted for the window.

Objects come from :mod:`k8s_manifests` and are applied by :class:`TenantClusterApplier`
(server-side apply) when ``PORTAL_K8S_KUBECONFIG`` names the portal's own kubeconfig.
Without it the backend runs **render-only**: it builds and checks every object (the spec's
own validation) and records the namespace, but talks to no cluster and issues no
kubeconfig. See ``k8s_apply`` for what was and was not tried against a live API server.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from portal.core.words import count_of

from ..conf import setting
from .base import (
    BackendError,
    BackendStatus,
    BackendWait,
    ClusterContext,
    DrainIncomplete,
    Drift,
    NodeRepairGuard,
    PhaseResult,
    ProvisioningBackend,
    RepairGuard,
    guarded_node_repair,
    repaired_drift,
)
from .k8s_apply import K8sApplyError, TenantClusterApplier, object_ref
from .k8s_manifests import (
    CORDON_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RESERVATION_LABEL,
    TENANT_LABEL,
    WINDOW_END_ANNOTATION,
    NodeClaimConflict,
    TenantClusterSpec,
    admission_gaps,
    dns_label,
    drifted_fields,
    tenant_objects,
)

__all__ = ["KubernetesBackend"]

logger = logging.getLogger(__name__)

# Node states in which the portal keeps work off a node (reservations.choices.OUT_OF_SERVICE, by value).
OUT_OF_SERVICE = frozenset({"failed", "draining", "maintenance", "retired"})


def node_name(hostname: str) -> str:
    """The Kubernetes Node of a portal hostname: the kubelet registers its node name lowercased, and the portal
    takes hostnames as the inventory spells them."""
    return hostname.lower()


_RENDER_ONLY_CA = base64.b64encode(b"render-only: no cluster configured").decode()

# How often a claim waiting for the previous booking's window (and teardown) to end is tried again.
WAIT_POLL_MIN_SECONDS = 5.0
WAIT_POLL_MAX_SECONDS = 60.0

# API answers no retry changes: a malformed or invalid request (400, 422), something that is not there (404:
# a booked node the cluster does not have), a method or media type the server does not take (405, 415).
# Not 401/403 (a rotated token, a namespace still terminating), 409, 429 or 5xx: those pass.
PERMANENT_STATUSES = frozenset({400, 404, 405, 415, 422})


def _api_status(exc: BaseException) -> int | None:
    """The HTTP status of the API answer behind ``exc`` (itself, or the one it was raised from), if any."""
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, ApiException):
            return candidate.status
    return None


def _cluster_entry(kubeconfig: str, context: str | None) -> tuple[str, str]:
    """Return (server URL, CA data) of the kubeconfig's current (or named) context."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    context_name = context or config.get("current-context")
    ctx = next((c["context"] for c in config.get("contexts", []) if c.get("name") == context_name), None)
    if ctx is None:
        raise BackendError(f"kubeconfig {kubeconfig} has no context {context_name!r}", transient=False)
    cluster = next((c["cluster"] for c in config.get("clusters", []) if c.get("name") == ctx.get("cluster")), None)
    if cluster is None:
        raise BackendError(f"kubeconfig {kubeconfig} has no cluster {ctx.get('cluster')!r}", transient=False)
    ca = cluster.get("certificate-authority-data")
    if not ca and cluster.get("certificate-authority"):
        # A relative path is relative to the kubeconfig's folder, as kubectl and the client read it.
        ca = (Path(kubeconfig).parent / cluster["certificate-authority"]).read_text()
    return cluster["server"], ca or _RENDER_ONLY_CA


def _accepts_pods(namespace: dict[str, Any] | None) -> bool:
    """Whether a namespace as read from the API server is there and not terminating."""
    return namespace is not None and not ((namespace.get("metadata") or {}).get("deletionTimestamp")
                                          or (namespace.get("status") or {}).get("phase") == "Terminating")


class KubernetesBackend(ProvisioningBackend):
    name = "kubernetes"

    def __init__(self, applier: TenantClusterApplier | None = None) -> None:
        self.kubeconfig = setting("PORTAL_K8S_KUBECONFIG", None) or None
        self.context = setting("PORTAL_K8S_CONTEXT", None) or None
        self.applier = applier
        if self.applier is None and self.kubeconfig:
            self.applier = TenantClusterApplier.from_kubeconfig(self.kubeconfig, context=self.context)
        if self.kubeconfig:
            server, ca = _cluster_entry(self.kubeconfig, self.context)
        else:
            server, ca = "https://k8s.gpu-portal.internal:6443", _RENDER_ONLY_CA
        # What tenants are given may differ from how the portal reaches the API (e.g. a public name).
        self.api_server_url = setting("PORTAL_K8S_API_SERVER_URL", None) or server
        self.api_ca_data = setting("PORTAL_K8S_CA_DATA", None) or ca
        self.storage_class = setting("PORTAL_K8S_STORAGE_CLASS", "standard")

    @property
    def render_only(self) -> bool:
        return self.applier is None

    def close(self) -> None:
        if self.applier is not None:
            self.applier.close()

    def spec(self, ctx: ClusterContext, *, allow_no_nodes: bool = False) -> TenantClusterSpec:
        """The reservation's spec; with allow_no_nodes (a built cluster's changes, reconcile, teardown) also
        for a booking that lost every node: its namespace stays with a quota of zero and it claims no node."""
        try:
            return TenantClusterSpec(
                tenant_slug=ctx.tenant_slug,
                reservation_id=ctx.reservation_id,
                node_hostnames=tuple(node_name(h) for h in ctx.nodes),
                gpus_per_node=ctx.gpus_per_node,
                window_end=ctx.end,
                cuda_version=ctx.cuda_version,
                api_server_url=self.api_server_url,
                api_ca_data=self.api_ca_data,
                storage_class=self.storage_class,
                shared_storage_gib=ctx.shared_storage_gib,
                default_memory_per_gpu_gib=ctx.default_memory_per_gpu_gib,
                mig_profile=ctx.mig_profile or None,
                mig_instances_per_gpu=ctx.mig_instances_per_gpu if ctx.mig_profile else None,
                allow_no_nodes=allow_no_nodes,
            )
        except ValueError as exc:
            raise BackendError(f"invalid Kubernetes spec: {exc}", transient=False)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NodeClaimConflict as exc:
            # Usually the previous holder's teardown has not finished: retry, then fail. The error is shown to
            # the tenant (the cluster's reason, its page, Slack): the other booking is named in the log only.
            logger.warning("%s: %s", what, exc)
            raise BackendError(f"{what}: {exc.public}") from exc
        except (K8sApplyError, ApiException) as exc:
            raise BackendError(f"{what}: {exc}", transient=_api_status(exc) not in PERMANENT_STATUSES)
        except urllib3.exceptions.HTTPError as exc:
            # Connection refused, a timeout, a reset: the API server is unreachable for now (retry).
            raise BackendError(f"{what}: Kubernetes API server unreachable: {exc}")

    def _connection(self, spec: TenantClusterSpec) -> dict[str, str]:
        return {"api_server": self.api_server_url, "namespace": spec.namespace,
                "kubectl_hint": f"kubectl --kubeconfig kubeconfig.yaml -n {spec.namespace} get pods"}

    # --- phases ---

    def allocate_nodes(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx)
        if not self.render_only:
            try:
                self._call("claim nodes", self.applier.claim_nodes, spec)
            except BackendError as exc:
                # Provisioning runs its lead time ahead of the window: a node whose previous booking ends by
                # this one's start is handed over then (its teardown lifts the claim). Until this window starts
                # that is a wait, not a failed attempt; after it, a claim still held counts as any other.
                conflict = exc.__cause__
                now = datetime.now(UTC)
                if (isinstance(conflict, NodeClaimConflict) and conflict.held_until is not None
                        and conflict.held_until <= ctx.start and now < ctx.start):
                    wait = min(WAIT_POLL_MAX_SECONDS, max(WAIT_POLL_MIN_SECONDS,
                                                          (conflict.held_until - now).total_seconds()))
                    raise BackendWait(f"{exc.message}; waiting for the previous booking to end",
                                      countdown=wait) from conflict
                raise
        return PhaseResult(connection=self._connection(spec), backend_state={"namespace": spec.namespace},
                           detail=f"{count_of(len(spec.node_hostnames), 'node')} labelled, "
                                  f"tainted dedicated={spec.tenant_label}")

    def configure_network(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx)
        objects = [m for m in tenant_objects(spec) if m["kind"] != "PersistentVolumeClaim"]
        if self.render_only:
            return PhaseResult(detail=f"render-only: {len(objects)} objects built for {spec.namespace}")
        applied = self._call("apply namespace objects", self.applier.apply_all, objects)
        result = self._kubeconfig(spec)
        result.detail = f"{count_of(len(applied), 'object')} applied in {spec.namespace}{result.detail}"
        return result

    def attach_storage(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx)
        pvcs = [m for m in tenant_objects(spec) if m["kind"] == "PersistentVolumeClaim"]
        if not pvcs:
            return PhaseResult(detail="no shared storage asked for: no volume claim")
        if not self.render_only:
            self._call("apply shared volume", self.applier.apply_all, pvcs)
        name = pvcs[0]["metadata"]["name"]
        return PhaseResult(connection={"shared_pvc": name},
                           detail=f"PVC {name} {spec.shared_storage_gib}Gi ({self.storage_class})")

    def install_drivers(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx)
        mig = f", MIG {spec.mig_profile}" if spec.mig_profile else ""
        # The node labels set in allocate_nodes drive the GPU operator (driver, MIG manager).
        return PhaseResult(detail=f"CUDA {spec.cuda_version}{mig} via node labels")

    def verify(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx)
        if self.render_only:
            return PhaseResult(detail="render-only: nothing to verify")
        if not self._call("read namespace", self.applier.namespace_exists, spec):
            raise BackendError(f"namespace {spec.namespace} is missing")
        self._check_admission(spec)
        return PhaseResult(detail=f"namespace {spec.namespace} exists; its pods are pinned to the booked nodes")

    def _check_admission(self, spec: TenantClusterSpec) -> None:
        """Refuse to hand over a namespace whose pods would not be kept on the booked nodes: without the
        PodNodeSelector and PodTolerationRestriction admission plugins its annotations do nothing, and a
        tenant's pod without tolerations runs on any free, untainted GPU node. No retry changes that."""
        gaps = admission_gaps(spec, self._call("admission check", self.applier.admission_dry_run, spec))
        if gaps:
            raise BackendError(f"the Kubernetes API server does not pin the tenant's pods to the booked nodes: "
                               f"enable the admission plugin(s) {'; '.join(gaps)} (see docs/operations.md)",
                               transient=False)

    # --- changes ---

    def update_window(self, ctx: ClusterContext) -> PhaseResult:
        spec = self.spec(ctx, allow_no_nodes=True)
        if not self.render_only:
            self._call("re-apply", self.applier.provision, spec)
            # A node set that shrank (a node lost with no spare): the lost node must not keep the
            # tenant's label and toleration-matched taint, or the namespace's pods still land on it.
            self._call("release lost nodes", self.applier.release_nodes_not_held, spec)
            # The tenant's token expires with the window it was issued for: an extended booking's
            # kubeconfig would stop working at the old end. A new one lasts to the new end.
            result = self._kubeconfig(spec)
            result.detail = f"window end {spec.window_end_rfc3339} applied; new kubeconfig{result.detail}"
            return result
        return PhaseResult(detail=f"window end {spec.window_end_rfc3339} applied")

    def swap_node(self, ctx: ClusterContext, old: str, new: str) -> PhaseResult:
        spec = self.spec(ctx)
        if not self.render_only:
            # Converge on the booking's node set (ctx.nodes), not on old -> new as told: two swaps of one
            # booking (A -> S, then S -> T) may run in either order, and the late A -> S must not claim S.
            self._call("release lost nodes", self.applier.release_nodes_not_held, spec)
            self._call("claim nodes", self.applier.claim_nodes, spec)
            self._call("re-apply quota", self.applier.apply_objects, spec)
        return PhaseResult(detail=f"{old} replaced by {new}")

    def teardown(self, ctx: ClusterContext) -> bool:
        if self.render_only:
            return True
        return bool(self._call("teardown", self.applier.teardown, self.spec(ctx, allow_no_nodes=True)))

    def status(self, ctx: ClusterContext) -> BackendStatus:
        spec = self.spec(ctx, allow_no_nodes=True)
        if self.render_only:
            return BackendStatus(exists=False, detail="render-only")
        exists = self._call("read namespace", self.applier.namespace_exists, spec)
        return BackendStatus(exists=exists, nodes=spec.node_hostnames if exists else (), end=ctx.end,
                             detail=spec.namespace)

    def reconcile(self, wanted: list[ClusterContext], *, fix: bool,
                  tenants: Collection[str] | None = None, live: Callable[[int], bool] | None = None,
                  guard: RepairGuard | None = None) -> list[Drift]:
        if self.render_only:
            return []
        drifts: list[Drift] = []
        # Built clusters must be complete: their namespace, and a claim on exactly their nodes.
        built: dict[str, TenantClusterSpec] = {}
        ctx_of: dict[str, ClusterContext] = {}
        for ctx in wanted:
            if ctx.status in ("ready", "degraded"):
                try:
                    built[str(ctx.reservation_id)] = self.spec(ctx, allow_no_nodes=True)
                    ctx_of[str(ctx.reservation_id)] = ctx
                except BackendError as exc:
                    drifts.append(Drift("unknown", f"reservation-{ctx.reservation_id}", exc.message))
        wanted_ids = {str(ctx.reservation_id) for ctx in wanted}
        # A namespace or claim labelled for a tenant the portal does not know is not ours (another portal on
        # the same cluster, an operator's copy): never reported or deleted. One without a tenant label is.
        known = None if tenants is None else {dns_label(slug) for slug in tenants}

        def foreign(obj: dict[str, Any]) -> bool:
            tenant = ((obj.get("metadata") or {}).get("labels") or {}).get(TENANT_LABEL)
            return known is not None and tenant is not None and tenant not in known

        # Read everything before changing anything: an API server that does not answer leaves a
        # report (BackendError), not repairs nobody was told about.
        missing = {holder for holder, spec in built.items()
                   if not self._call("read namespace", self.applier.namespace_exists, spec)}
        listed = self._call("list namespaces", self.applier.list_namespaces, f"{MANAGED_BY_LABEL}={MANAGED_BY}")
        claimed = self._call("list claimed nodes", self.applier.claimed_nodes)
        # Each built cluster's objects as the API server has them: the guard rails (quota, limits, network
        # policies, RBAC, the namespace's admission annotations) an operator may have edited or deleted.
        observed = {holder: [(obj, self._call("read object", self.applier.read_object, obj))
                             for obj in tenant_objects(spec)]
                    for holder, spec in built.items() if holder not in missing}
        # And whether the API server still pins their pods to the booked nodes (admission plugins switched
        # off since the hand-over): nothing the portal can repair, so a report for the operators.
        # A namespace that is going (a teardown) takes no new pod, not even a dry-run one, nor does one whose
        # booking lost every node (a quota of zero pods): not asked. One refusal (a full pod quota) is reported
        # for that cluster, not as an unreachable backend.
        unpinned: dict[str, list[str]] = {}
        for holder, objects in observed.items():
            if not (_accepts_pods(objects[0][1]) and built[holder].node_hostnames):
                continue
            try:
                if gaps := admission_gaps(built[holder], self._call(
                        "admission check", self.applier.admission_dry_run, built[holder])):
                    unpinned[holder] = gaps
            except BackendError as exc:
                refusal = exc.__cause__ or exc.__context__  # the K8sApplyError _call turned into exc
                if not exc.transient or (refusal is not None and _api_status(refusal) == 403):
                    drifts.append(Drift("unknown", built[holder].namespace, exc.message))
                else:
                    raise
        if live is not None:
            # Read after `wanted`: a reservation provisioned meanwhile is live, not an orphan.
            holders = {((ns.get("metadata") or {}).get("labels") or {}).get(RESERVATION_LABEL) for ns in listed}
            holders |= {((node.get("metadata") or {}).get("labels") or {}).get(RESERVATION_LABEL) for node in claimed}
            wanted_ids |= {h for h in holders - wanted_ids if h and h.isdigit() and live(int(h))}
        for holder in sorted(missing):
            spec = built[holder]
            drifts.append(repaired_drift("missing", spec.namespace, "namespace missing", fix=fix,
                                         repair=lambda spec=spec: self._rebuild(spec),
                                         cluster_id=ctx_of[holder].cluster_id, ctx=ctx_of[holder], guard=guard))
        for holder, objects in observed.items():
            drifts += self._object_drifts(objects, ctx_of[holder], fix=fix, guard=guard)
        drifts += [Drift("mismatch", built[holder].namespace, "the API server does not pin its pods to the booked "
                         f"nodes: enable the admission plugin(s) {'; '.join(gaps)}")
                   for holder, gaps in sorted(unpinned.items())]
        orphan_namespaces: dict[str, list[str]] = {}  # reservation id -> its namespaces still there
        terminating: set[str] = set()  # namespaces already going when listed (a teardown in progress)
        for ns in listed:
            meta = ns.get("metadata") or {}
            holder = (meta.get("labels") or {}).get(RESERVATION_LABEL)
            if holder not in wanted_ids and not foreign(ns):
                orphan_namespaces.setdefault(holder or "", []).append(meta["name"])
                if meta.get("deletionTimestamp") or (ns.get("status") or {}).get("phase") == "Terminating":
                    terminating.add(meta["name"])
                    continue  # already going
                drifts.append(repaired_drift(
                    "orphan", meta["name"], "namespace has no live booking", fix=fix,
                    repair=lambda name=meta["name"]: self._call("delete orphan", self.applier.delete_namespace, name)))
        drifts += self._reconcile_claims(claimed, wanted_ids, built, missing, orphan_namespaces, terminating, fix=fix,
                                         ctx_of=ctx_of, guard=guard, foreign=foreign)
        return drifts

    def _object_drifts(self, objects: list[tuple[dict[str, Any], dict[str, Any] | None]], ctx: ClusterContext, *,
                       fix: bool, guard: RepairGuard | None) -> list[Drift]:
        """A built cluster's objects that are missing or no longer hold what the portal applies; the repair
        applies them again (server-side apply, as provisioning does)."""
        drifts: list[Drift] = []
        namespace = objects[0][1] if objects and objects[0][0]["kind"] == "Namespace" else None
        if namespace is not None and ((namespace.get("metadata") or {}).get("deletionTimestamp")
                                      or (namespace.get("status") or {}).get("phase") == "Terminating"):
            return drifts  # its namespace is going (a teardown): nothing to put back
        for obj, live in objects:
            if live is None:
                kind, detail = "missing", "object missing"
            else:
                changed = drifted_fields(obj, live)
                if not changed:
                    continue
                more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
                kind, detail = "mismatch", f"differs from what the portal applies at {', '.join(changed[:3])}{more}"
            drifts.append(repaired_drift(kind, object_ref(obj), detail, fix=fix, ctx=ctx, guard=guard,
                                         repair=lambda obj=obj: self._call("re-apply", self.applier.apply, obj)))
        return drifts

    # --- nodes the portal took out of service ---

    def drain_node(self, hostname: str, reason: str) -> None:
        """Cordon the node (no new pod lands there), then evict the tenants' pods still running on it.

        Evictions go through the Eviction API, which honours each pod's PodDisruptionBudget; the pods'
        controllers start them again elsewhere (the booking moves to a spare). Pods of other namespaces
        (the operator's, kube-system) and DaemonSet pods stay. A pod that could not be evicted (a budget
        that allows no disruption now) is a DrainIncomplete naming it, after every other pod was tried:
        the caller tries again later, as reconcile does. Safe to repeat.
        """
        if not self.render_only:
            self._call("cordon node", self.applier.cordon_node, node_name(hostname), " ".join(reason.split())[:250])
            self._evict(hostname, self._tenant_namespaces())

    def _tenant_namespaces(self) -> set[str]:
        listed = self._call("list namespaces", self.applier.list_namespaces, f"{MANAGED_BY_LABEL}={MANAGED_BY}")
        return {name for ns in listed if (name := (ns.get("metadata") or {}).get("name"))}

    def _evict(self, hostname: str, namespaces: set[str]) -> None:
        _evicted, refused = self._call("evict pods", self.applier.evict_tenant_pods, node_name(hostname), namespaces)
        if refused:
            more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
            raise DrainIncomplete(f"node {hostname}: {count_of(len(refused), 'tenant pod')} not evicted: "
                               f"{'; '.join(refused[:3])}{more}")

    def resume_node(self, hostname: str) -> None:
        if not self.render_only:
            self._call("uncordon node", self.applier.uncordon_node, node_name(hostname))

    def reconcile_nodes(self, states: dict[str, str], *, fix: bool,
                        guard: NodeRepairGuard | None = None) -> list[Drift]:
        """Cordon and empty what the portal took out of service; uncordon what it cordoned and put back."""
        if self.render_only:
            return []
        drifts: list[Drift] = []
        nodes = self._call("list nodes", self.applier.list_nodes)
        portal = {node_name(h): h for h in states}  # Kubernetes node name -> the portal's hostname
        out = sorted(name for node in nodes if states.get(
            portal.get(name := (node.get("metadata") or {}).get("name", "?"), "")) in OUT_OF_SERVICE)
        # Read every pod before changing anything (as everywhere in reconcile).
        namespaces = self._tenant_namespaces() if out else set()
        running = {hostname: [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in self._call(
            "list pods", self.applier.tenant_pods_on_node, hostname, namespaces)] for hostname in out}
        for node in nodes:
            meta = node.get("metadata") or {}
            name = meta.get("name", "?")
            hostname = portal.get(name, "")
            state = states.get(hostname)
            if state is None:
                continue  # not a portal node
            out_of_service = state in OUT_OF_SERVICE
            cordoned = bool((node.get("spec") or {}).get("unschedulable"))
            ours = CORDON_ANNOTATION in (meta.get("annotations") or {})
            pods = running.get(name) or []
            still = f"; {count_of(len(pods), 'tenant pod')} still on it: {', '.join(pods[:3])}" if pods else ""
            if out_of_service and not cordoned:
                drifts.append(repaired_drift(
                    "node", hostname, f"portal says {state}, the node is schedulable{still}", fix=fix,
                    repair=guarded_node_repair(guard, hostname, state, lambda hostname=hostname, state=state:
                                               self.drain_node(hostname, f"node is {state} in the portal"))))
            elif out_of_service and pods:
                drifts.append(repaired_drift(
                    "node", hostname, f"portal says {state}, cordoned{still}", fix=fix,
                    repair=guarded_node_repair(guard, hostname, state,
                                               lambda hostname=hostname: self._evict(hostname, namespaces))))
            elif not out_of_service and cordoned and ours:
                drifts.append(repaired_drift(
                    "node", hostname, f"portal says {state}, cordoned for us", fix=fix,
                    repair=guarded_node_repair(guard, hostname, state,
                                               lambda hostname=hostname: self.resume_node(hostname))))
            elif not out_of_service and cordoned:
                drifts.append(Drift("node", hostname, f"portal says {state}, cordoned by someone else: set the "
                                    "node's state in the portal or uncordon it"))
        return drifts

    def _rebuild(self, spec: TenantClusterSpec) -> PhaseResult:
        """Apply a lost namespace again. Its ServiceAccount is new, so the stored kubeconfig's token no
        longer works: hand a new one back with the repair, and its token's times (backend_state)."""
        self._call("re-apply", self.applier.provision, spec)
        return self._kubeconfig(spec)

    def _kubeconfig(self, spec: TenantClusterSpec) -> PhaseResult:
        """A new kubeconfig for the tenant, and when its token expires (backend_state ``token_issued_at`` and
        ``token_expires_at``, ISO 8601). An API server that caps token lifetimes may grant less than the window:
        the lifecycle tick then has it issued again (reservation_sync) before it runs out."""
        issued = datetime.now(UTC)
        kubeconfig, expires = self._call("issue kubeconfig", self.applier.tenant_credentials, spec)
        state = {"token_issued_at": issued.isoformat(), "token_expires_at": expires.isoformat() if expires else None,
                 "token_renewal_asked_at": None}
        detail = ""
        if expires is not None and expires < spec.window_end:
            logger.warning("%s: the API server granted a token until %s only, not to the window end %s: it is "
                           "renewed before then", spec.namespace, expires.isoformat(), spec.window_end_rfc3339)
            detail = f"; its token expires {expires.strftime('%Y-%m-%dT%H:%M:%SZ')} (renewed before then)"
        return PhaseResult(secrets={"kubeconfig": kubeconfig}, backend_state=state, detail=detail)

    def _namespace_gone(self, name: str) -> bool:
        try:
            return not self._call("read namespace", self.applier.namespace_named_exists, name)
        except BackendError:
            return False  # cannot tell: keep the claim

    def _reconcile_claims(self, claimed: list[dict[str, Any]], wanted_ids: set[str],
                          built: dict[str, TenantClusterSpec], rebuilt: set[str],
                          orphan_namespaces: dict[str, list[str]], terminating: set[str], *,
                          fix: bool, ctx_of: dict[str, ClusterContext] | None = None,
                          guard: RepairGuard | None = None,
                          foreign: Callable[[dict[str, Any]], bool] | None = None) -> list[Drift]:
        """Node claims (labels, window-end annotation, ``dedicated`` taint) both ways.

        A claim of a reservation that is not live is lifted, and so is a built cluster's claim on a
        node it no longer holds (a swap or shrink that failed half-way); a node a built cluster holds
        but does not claim is claimed. Only the portal's claims (a node labelled with a reservation)
        are looked at, and only the ``dedicated`` taint of the claim's own tenant is removed. As in
        teardown, a dead reservation's claim is lifted only once its namespace is gone, so no tenant
        pod is on a node handed back. A claim made or renewed for a built cluster goes through guard
        (see reconcile): a teardown lifting the claims meanwhile must not find them put back. A claim
        ``foreign`` says is not ours (a tenant the portal does not know) is never lifted.
        """
        drifts: list[Drift] = []
        ctx_of = ctx_of or {}
        holder_of: dict[str, str] = {}

        def release(hostname: str, holder: str) -> Any:
            return lambda: self._call("release claim", self.applier.release_claim, hostname, holder)

        for node in claimed:
            meta = node.get("metadata") or {}
            labels = meta.get("labels") or {}
            holder, hostname = labels.get(RESERVATION_LABEL), meta.get("name", "?")
            if not holder:
                continue
            if holder in built and hostname not in built[holder].node_hostnames:
                drifts.append(repaired_drift("mismatch", hostname,
                                             f"claimed for reservation {holder}, which no longer holds it",
                                             fix=fix, repair=release(hostname, holder)))
                continue
            holder_of[hostname] = holder
            if holder in built and holder not in rebuilt:
                # A stale window end (an extension whose sync was lost) lets another claim take the node
                # over once it passes, while the reservation still holds it.
                spec = built[holder]
                ends = (meta.get("annotations") or {}).get(WINDOW_END_ANNOTATION)
                if ends != spec.window_end_rfc3339:
                    drifts.append(repaired_drift(
                        "mismatch", hostname, f"claim for reservation {holder} ends {ends}, "
                        f"the booking {spec.window_end_rfc3339}", fix=fix,
                        repair=lambda spec=spec, hostname=hostname: self._call(
                            "claim node", self.applier.claim_node, spec, hostname),
                        ctx=ctx_of.get(holder), guard=guard))
            if holder in wanted_ids or (foreign is not None and foreign(node)):
                continue
            detail = f"claimed for reservation {holder} (tenant {labels.get(TENANT_LABEL, '?')}), which is not live"
            remaining = [name for name in orphan_namespaces.get(holder, []) if not self._namespace_gone(name)]
            if remaining and set(remaining) <= terminating:
                continue  # its namespace was already going: the teardown (or the run that deleted it) lifts it
            if remaining:
                drifts.append(Drift("orphan", hostname, f"{detail}; released once namespace {remaining[0]} is gone"))
                continue
            drifts.append(repaired_drift("orphan", hostname, detail, fix=fix, repair=release(hostname, holder)))
        for holder, spec in built.items():
            if holder in rebuilt:
                continue  # provision claims its nodes
            for hostname in spec.node_hostnames:
                other = holder_of.get(hostname)
                if other == holder:
                    continue
                drifts.append(repaired_drift(
                    "missing", hostname, f"not claimed for reservation {holder}"
                    + (f" (claimed for reservation {other})" if other else ""), fix=fix,
                    repair=lambda spec=spec, hostname=hostname: self._call(
                        "claim node", self.applier.claim_node, spec, hostname),
                    ctx=ctx_of.get(holder), guard=guard))
        return drifts
