"""A backend's error reaches the team (cluster page, API, Slack) without the credentials it may carry; the full
text stays in the log and the admin (portal.core.redact.without_secrets)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from portal.core import events
from portal.core.redact import without_secrets
from provisioning import services
from provisioning.backends.base import BackendError
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import ClusterTransition, VirtualCluster

from .conftest import book

pytestmark = pytest.mark.django_db

SECRETS = ("hunter2", "eyJhbGciOiJIUzI1NiJ9", "s3cr3tpw", "0123456789abcdef0123456789abcdef")
ERROR = ("Get https://admin:hunter2@k8s-api.internal:6443/api/v1/namespaces/alpha: dial tcp 10.0.3.4:6443: "
         "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl; "
         "sbatch --password=s3cr3tpw; key 0123456789abcdef0123456789abcdef")


def test_without_secrets_keeps_the_message_useful() -> None:
    told = without_secrets(ERROR)
    assert not any(s in told for s in SECRETS)
    assert "k8s-api.internal:6443/api/v1/namespaces/alpha" in told and "Authorization: Bearer [redacted]" in told
    assert "password=[redacted]" in told
    for plain in ("token expired", "basic checks passed", "signal: 9", "injected transient fault in install_drivers",
                  "scontrol: error: Invalid node name specified: gpu-017 (/etc/slurm/slurm.conf)",
                  "GET https://k8s-api.internal:6443/apis/apps/v1/namespaces/alpha-team/statefulsets/worker-0: 409",
                  "mount failed: /var/lib/kubelet/pods/0f3c2b9e-1d2a-4c5b/volumes/kubernetes.io~csi/shared"):
        assert without_secrets(plain) == plain
    assert len(without_secrets("x" * 5000)) == 500 and without_secrets("x" * 5000).endswith("…")
    assert without_secrets(without_secrets(ERROR)) == without_secrets(ERROR)
    assert without_secrets("key aGVsbG8gd29y/bGQgdGhpcyBpcyBhIGxvbmcgc2VjcmV0IGtleQ==") == "key [redacted]"


def test_long_names_the_backends_are_told_are_not_taken_for_secrets() -> None:
    """A Kubernetes namespace is tenant-<slug>-r<id> (a slug of up to 50 characters), a claim or volume is named
    after it, a Slurm reservation <slug>-<id>, a node by its inventory hostname: past 40 characters with a digit
    in them, each was blanked as a "long base64" run, and the team read "namespace [redacted] is missing",
    "PVC [redacted] 1024Gi", "node [redacted] is held by another booking" — told nothing of what failed. A
    name (one case, its words joined by - or _) is kept; a base64 key (both cases) still goes."""
    namespace = "tenant-computational-biology-research-group-r1234"  # as TenantClusterSpec.namespace names it
    for plain in (f"namespace {namespace} is missing",
                  f"PVC {namespace}-shared 1024Gi (standard)",
                  "claim nodes: node dgx-h100-rack07-u38-cluster-west-2a-0001 is held by another booking",
                  "claim nodes: node DGX-H100-RACK07-U38-CLUSTER-WEST-2A-0001 is held by another booking",
                  "scontrol: error: Reservation computational_biology_research_group_1234 not found"):
        assert len(max(plain.split(), key=len)) >= 40
        assert without_secrets(plain) == plain
    for secret in ("aGVsbG8td29ybGQtdGhpcy1pcy1hLWxvbmctc2VjcmV0LWtleQ-Zm9vYmFy",
                   "Zm9v_YmFyX2Jhel9xdXV4X2NvcmdlX2dyYXVsdF9nYXJwbHkxMjM0NTY3OA"):
        assert without_secrets(f"key {secret}") == "key [redacted]"


def test_ordinary_error_texts_are_not_taken_for_key_value_secrets() -> None:
    """A URL's path ending in a secret-like word ("…/serviceaccounts/y/token": dial tcp …, as Go's net/http
    quotes the URL it failed on) was read as the key of "token": value, and the team read "[redacted] tcp …";
    "Invalid credential: Expired credential" became "Invalid credential: [redacted] credential" and MySQL's
    "(using password: YES)" lost its answer and its parenthesis. A word that says whether or how a credential
    was used (YES, NO, Expired, …) is no secret, nor is a path segment a key; a value after a key still goes."""
    for plain in ('Get "https://10.0.0.1:6443/api/v1/namespaces/x/serviceaccounts/y/token": dial tcp '
                  "10.0.0.1:6443: connect: connection refused",
                  'Post "https://k8s-api.internal:6443/api/v1/namespaces/x/serviceaccounts/y-token": EOF',
                  "Invalid credential: Expired credential",
                  "ERROR 1045 (28000): Access denied for user 'slurm'@'localhost' (using password: YES)",
                  "ERROR 1045 (28000): Access denied for user 'slurm'@'localhost' (using password: NO)",
                  "mount failed: secret: none, token: missing"):
        assert without_secrets(plain) == plain
    for told, secret in (("password: [redacted]", "password: hunter2"),
                         ("password: [redacted]", "password: Expired2"),
                         ("(using password: [redacted]", "(using password: yesyes)"),
                         ('{"token": [redacted]}', '{"token": "YES-abc"}'),
                         ("secret=[redacted]", "secret=letmein"),
                         ("sbatch --password=[redacted]", "sbatch --password=s3cr3tpw"),
                         ("url?access_token=[redacted]&x=1", "url?access_token=abc&x=1")):
        assert without_secrets(secret) == told


def test_a_backend_error_reaches_the_team_without_its_secrets(world, t0, web, monkeypatch,
                                                               django_capture_on_commit_callbacks):
    def fail(self, ctx):
        raise BackendError(ERROR, transient=False)

    monkeypatch.setattr(SimulatedBackend, "install_drivers", fail)
    seen: list[tuple[str, dict]] = []

    def record(event, payload):
        seen.append((event, payload))

    events.subscribe("*", record)
    try:
        reservation = book(world, "alpha-lead", t0)
        services.lifecycle_tick(now=t0 - timedelta(minutes=10))
        cluster = VirtualCluster.objects.get(reservation=reservation)
        with django_capture_on_commit_callbacks(execute=True):
            assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.FAILED
    finally:
        events._subscribers["*"].remove(record)

    cluster.refresh_from_db()
    reservation.refresh_from_db()
    failed = [p for name, p in seen if name == "cluster.failed"]
    told = [cluster.status_reason, reservation.status_reason, failed[0]["reason"],
            *ClusterTransition.objects.filter(cluster=cluster).values_list("detail", flat=True)]
    for text in told:
        assert not any(s in text for s in SECRETS), text
    assert "k8s-api.internal" in cluster.status_reason and "[redacted]" in cluster.status_reason
    assert cluster.last_error == ERROR  # the operators' copy (admin), whole

    client = web("alpha-lead")
    for path in (f"/clusters/{cluster.pk}/", f"/reservations/{reservation.pk}/",
                 f"/api/v1/clusters/{cluster.pk}/", f"/api/v1/reservations/{reservation.pk}/"):
        response = client.get(path)
        assert response.status_code == 200, path
        body = response.content.decode()
        assert "k8s-api.internal" in body, path
        assert not any(s in body for s in SECRETS), path
