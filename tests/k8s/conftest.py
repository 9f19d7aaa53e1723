"""Fixtures for the Kubernetes manifest and apply tests: a spec factory and a loopback API server.

The loopback server is a real HTTP server on 127.0.0.1 that the real ``kubernetes`` client
talks to. It records every request and answers the handful of calls the applier makes the
way the API server does (JSON bodies, Status objects on errors, a 409 on a stale
``resourceVersion`` in a merge patch). It is not a Kubernetes emulator: it checks nothing
the real server would check beyond that.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from provisioning.backends.k8s_manifests import TenantClusterSpec

NOW = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
WINDOW_END = NOW + timedelta(days=3)
# Not a real certificate: the tests use plain http, and only the encoding is checked.
FAKE_CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"


def make_spec(**overrides: Any) -> TenantClusterSpec:
    """Return a valid spec for tenant ``research``, reservation 42, two 8-GPU nodes."""
    values: dict[str, Any] = {
        "tenant_slug": "research",
        "reservation_id": 42,
        "node_hostnames": ("h100-sxm-001", "h100-sxm-002"),
        "gpus_per_node": 8,
        "window_end": WINDOW_END,
        "cuda_version": "12.8",
        "api_server_url": "https://k8s.example.internal:6443",
        "api_ca_data": FAKE_CA_PEM,
        "storage_class": "cephfs",
        "shared_storage_gib": 2048,
        "default_memory_per_gpu_gib": 120,
        "default_cpu_per_gpu": 12,
    }
    values.update(overrides)
    return TenantClusterSpec(**values)


def make_node(name: str, *, resource_version: str = "100", taints: list[dict[str, str]] | None = None,
              labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a Node as the API server would send it: a GPU node the operator already tainted."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": resource_version,
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true", **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})},
        },
        "spec": {
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
            if taints is None else taints
        },
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 JSON merge patch, as the API server does for merge-patch+json."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@dataclass
class Recorded:
    """One request as it arrived on the wire."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def make_pod(name: str, namespace: str, node: str, *, labels: dict[str, str] | None = None,
             owner_kind: str | None = "ReplicaSet", phase: str = "Running",
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a Pod bound to ``node`` as the API server would send it (owned by a ReplicaSet by default)."""
    owners = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": f"{name}-owner", "uid": f"uid-{name}-owner",
               "controller": True, "blockOwnerDeletion": True}] if owner_kind else []
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}", "resourceVersion": "1",
                     "labels": dict(labels or {}), "annotations": dict(annotations or {}), "ownerReferences": owners},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda:12.8"}]},
        "status": {"phase": phase},
    }


def make_pdb(name: str, namespace: str, match_labels: dict[str, str], *, disruptions_allowed: int) -> dict[str, Any]:
    """Return a policy/v1 PodDisruptionBudget whose controller currently allows ``disruptions_allowed``."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": dict(match_labels)}, "maxUnavailable": 1},
            "status": {"disruptionsAllowed": disruptions_allowed, "currentHealthy": 1, "desiredHealthy": 1,
                       "expectedPods": 1}}


@dataclass
class LoopbackApiServer:
    """State and request log of the loopback server (see module docstring)."""

    url: str = ""
    requests: list[Recorded] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    namespaces: dict[str, dict[str, Any]] = field(default_factory=dict)
    # How many more reads a deleted namespace stays visible (Terminating) for.
    terminating_reads: int = 0
    # (method, path) -> statuses to answer with, one per matching request, before normal handling.
    inject: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # (namespace, name) -> Pod. An evicted pod stays, terminating (metadata.deletionTimestamp), as it
    # does while the kubelet stops it; a test deletes it when it wants it gone.
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # (namespace, name) -> PodDisruptionBudget; an eviction spends one of status.disruptionsAllowed.
    pdbs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # Called with the node name just before a node PATCH is handled (to simulate a racing writer).
    before_node_patch: Callable[[str], None] | None = None
    # Request path -> namespaced object as last server-side applied (GET answers it, DELETE removes it).
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The admission plugins the API server runs that read the tenant namespace's annotations (a dry-run pod
    # create shows their effect); a cluster without them leaves the pods' node selector and tolerations alone.
    admission_plugins: set[str] = field(default_factory=lambda: {"PodNodeSelector", "PodTolerationRestriction"})
    # The API server's --service-account-max-token-expiration, in seconds (None: tokens last as long as asked).
    token_max_seconds: int | None = None
    _pending_deletes: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, method: str, path_prefix: str = "") -> list[Recorded]:
        """Return the recorded requests with this method whose path starts with ``path_prefix``."""
        return [r for r in self.requests if r.method == method and r.path.startswith(path_prefix)]

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(Recorded(method, path, query, headers, body))
            queued = self.inject.get((method, path))
            if queued:
                code = queued.pop(0)
                return code, _status(code, "Injected", f"injected {code}")
            if method == "GET" and path in ("/api/v1/nodes", "/api/v1/namespaces"):
                return self._list(path, (query.get("labelSelector") or [""])[0])
            if method == "GET" and (m := re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/pods", path)):
                return self._list_pods(m.group(1), (query.get("fieldSelector") or [""])[0])
            if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", path):
                if method != "POST":
                    return 405, _status(405, "MethodNotAllowed", f"the server does not allow {method} on eviction")
                return self._evict(m.group(1), m.group(2), headers, body)
            if method == "POST" and (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)):
                return self._create_pod(m.group(1), query, body)
            return self._route(method, path, headers, body)

    def _create_pod(self, namespace: str, query: dict[str, list[str]], body: bytes) -> tuple[int, dict[str, Any]]:
        """A dry-run pod create: the pod as the namespace's admission plugins (where enabled) would leave it."""
        if query.get("dryRun") != ["All"]:
            return 400, _status(400, "BadRequest", "the loopback server only creates pods with dryRun=All")
        if namespace not in self.namespaces:
            return 404, _status(404, "NotFound", f'namespaces "{namespace}" not found')
        pod = json.loads(body)
        annotations = self.namespaces[namespace]["metadata"].get("annotations") or {}
        spec = pod.setdefault("spec", {})
        selector = annotations.get("scheduler.alpha.kubernetes.io/node-selector")
        if "PodNodeSelector" in self.admission_plugins and selector:
            for term in selector.split(","):
                key, _, value = term.partition("=")
                if spec.setdefault("nodeSelector", {}).get(key, value) != value:
                    return 403, _status(403, "Forbidden", "pod node label selector conflicts with its namespace "
                                        "node label selector")
                spec["nodeSelector"][key] = value
        tolerations = annotations.get("scheduler.alpha.kubernetes.io/defaultTolerations")
        if "PodTolerationRestriction" in self.admission_plugins and tolerations:
            spec["tolerations"] = [*(spec.get("tolerations") or []), *json.loads(tolerations)]
        pod.setdefault("metadata", {})["namespace"] = namespace
        return 201, pod

    def _list(self, path: str, selector: str) -> tuple[int, dict[str, Any]]:
        """List nodes or namespaces matching an equality/existence label selector (``a=b,c``)."""
        kind, items = ("NodeList", self.nodes) if path.endswith("nodes") else ("NamespaceList", self.namespaces)
        terms = [t for t in selector.split(",") if t]

        def matches(obj: dict[str, Any]) -> bool:
            labels = (obj.get("metadata") or {}).get("labels") or {}
            for term in terms:
                key, _, value = term.partition("=")
                if key not in labels or (value and labels[key] != value):
                    return False
            return True

        return 200, {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                     "items": [copy.deepcopy(obj) for obj in items.values() if matches(obj)]}

    def _list_pods(self, namespace: str | None, selector: str) -> tuple[int, dict[str, Any]]:
        """List pods (of one namespace, or all) matching a field selector of ``spec.nodeName=`` terms."""
        terms = [t.partition("=") for t in selector.split(",") if t]
        for key, _, _ in terms:
            if key not in ("spec.nodeName", "metadata.namespace"):
                return 400, _status(400, "BadRequest", f'field label not supported: "{key}"')

        def matches(pod: dict[str, Any]) -> bool:
            values = {"spec.nodeName": pod["spec"].get("nodeName", ""),
                      "metadata.namespace": pod["metadata"]["namespace"]}
            return all(values[key] == value for key, _, value in terms)

        items = [copy.deepcopy(p) for (ns, _), p in sorted(self.pods.items())
                 if (namespace is None or ns == namespace) and matches(p)]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}

    def _evict(self, namespace: str, name: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """The pods/eviction subresource as the API server answers it (PodDisruptionBudgets honoured)."""
        # No Content-Type is read as the first supported one, JSON (as the API server negotiates it).
        content_type = headers.get("content-type") or "application/json"
        if not content_type.startswith("application/json"):
            return 415, _status(415, "UnsupportedMediaType", content_type)
        eviction = json.loads(body)
        if eviction.get("kind") != "Eviction" or eviction.get("apiVersion") not in ("policy/v1", "policy/v1beta1"):
            what = f"{eviction.get('apiVersion')}/{eviction.get('kind')}"
            return 400, _status(400, "BadRequest", f"not an Eviction: {what}")
        if (eviction.get("metadata") or {}).get("name") != name:
            return 400, _status(400, "BadRequest", "name in URL does not match name in Eviction object")
        pod = self.pods.get((namespace, name))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found')
        ok = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") in ("Succeeded", "Failed"):
            return 201, ok  # already going, or done: no budget to spend
        labels = pod["metadata"].get("labels") or {}
        budgets = [b for (ns, _), b in sorted(self.pdbs.items()) if ns == namespace and all(
            labels.get(k) == v for k, v in b["spec"]["selector"]["matchLabels"].items())]
        if len(budgets) > 1:
            return 500, _status(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the "
                                "eviction subresource does not support.")
        if budgets:
            budget = budgets[0]
            if budget["status"]["disruptionsAllowed"] <= 0:
                status = _status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's "
                                 "disruption budget.")
                status["details"] = {"causes": [{"reason": "DisruptionBudget", "message": (
                    f"The disruption budget {budget['metadata']['name']} needs "
                    f"{budget['status']['desiredHealthy']} healthy pods and has "
                    f"{budget['status']['currentHealthy']} currently")}]}
                return 429, status
            budget["status"]["disruptionsAllowed"] -= 1
        pod["metadata"]["deletionTimestamp"] = "2026-03-02T09:00:30Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        return 201, ok

    def _route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        content_type = headers.get("content-type", "")
        if m := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
            return self._node(method, m.group(1), content_type, body)
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)", path):
            name = m.group(1)
            if method == "GET":
                return self._read_namespace(name)
            if method == "DELETE":
                if name not in self.namespaces:
                    return 404, _status(404, "NotFound", f'namespaces "{name}" not found')
                if name in self._pending_deletes:
                    # What the namespace registry answers to a delete while finalizers run.
                    return 409, _status(409, "Conflict", "The system is ensuring all content is removed "
                                        "from this namespace.")
                self._pending_deletes[name] = self.terminating_reads
                ns = self.namespaces[name]
                ns["status"] = {"phase": "Terminating"}
                return 200, ns
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)/token", path):
            request = json.loads(body)
            expires = "2030-01-01T00:00:00Z"
            if self.token_max_seconds is not None:
                granted = min(self.token_max_seconds, request["spec"].get("expirationSeconds") or 3600)
                request["spec"]["expirationSeconds"] = granted
                expires = (datetime.now(UTC) + timedelta(seconds=granted)).strftime("%Y-%m-%dT%H:%M:%SZ")
            request["status"] = {"token": f"token-for-{m.group(1)}-{m.group(2)}", "expirationTimestamp": expires}
            return 201, request
        if method == "PATCH" and content_type == "application/apply-patch+yaml":
            obj = yaml.safe_load(body)  # JSON is YAML; the API server parses it as YAML.
            obj.setdefault("metadata", {})["resourceVersion"] = "1"
            if obj.get("kind") == "Namespace":
                self.namespaces[obj["metadata"]["name"]] = obj
            else:
                self.objects[path] = obj
            return 200, obj
        if path in self.objects and method in ("GET", "DELETE"):
            obj = self.objects[path] if method == "GET" else self.objects.pop(path)
            return 200, copy.deepcopy(obj)
        if method == "GET" and re.fullmatch(r"/apis?/.*/namespaces/[^/]+/[^/]+/[^/]+", path):
            return 404, _status(404, "NotFound", f"{path.rsplit('/', 1)[-1]} not found")
        return 404, _status(404, "NotFound", f"no route for {method} {path}")

    def _read_namespace(self, name: str) -> tuple[int, dict[str, Any]]:
        if name not in self.namespaces:
            return 404, _status(404, "NotFound", f'namespaces "{name}" not found')
        if name in self._pending_deletes:
            if self._pending_deletes[name] <= 0:
                del self._pending_deletes[name]
                del self.namespaces[name]
                for path in [p for p in self.objects if f"/namespaces/{name}/" in p]:
                    del self.objects[path]  # the namespace controller deleted its content first
                return 404, _status(404, "NotFound", f'namespaces "{name}" not found')
            self._pending_deletes[name] -= 1
        return 200, self.namespaces[name]

    def _node(self, method: str, name: str, content_type: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if name not in self.nodes:
            return 404, _status(404, "NotFound", f'nodes "{name}" not found')
        if method == "GET":
            return 200, self.nodes[name]
        if method == "PATCH" and content_type == "application/merge-patch+json":
            if self.before_node_patch is not None:
                self.before_node_patch(name)
            patch = json.loads(body)
            current = self.nodes[name]
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", "the object has been modified")
            updated = merge_patch(current, patch)
            updated["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
            self.nodes[name] = updated
            return 200, updated
        return 415, _status(415, "UnsupportedMediaType", content_type)


@pytest.fixture
def api_server() -> Iterator[LoopbackApiServer]:
    """Run a loopback API server on 127.0.0.1 for one test."""
    state = LoopbackApiServer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # Keep-alive, as urllib3 expects from an API server.
        disable_nagle_algorithm = True  # Headers and body go out in two writes; don't stall on ACKs.

        def _serve(self) -> None:
            split = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            code, payload = state.handle(self.command, split.path, parse_qs(split.query), headers, body)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = do_DELETE = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
