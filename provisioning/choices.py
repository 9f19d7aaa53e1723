"""Cluster phases, credential kinds and what each pool flavour supports by default."""

from __future__ import annotations

from django.db import models


class ClusterStatus(models.TextChoices):
    """Together AI's phases (WaitingFor… → RunningAcceptanceTests → Ready) in our words."""

    PENDING = "pending", "Pending"
    ALLOCATING_NODES = "allocating_nodes", "Allocating nodes"
    CONFIGURING_NETWORK = "configuring_network", "Configuring network"
    ATTACHING_STORAGE = "attaching_storage", "Attaching storage"
    INSTALLING_DRIVERS = "installing_drivers", "Installing drivers"
    RUNNING_ACCEPTANCE_TESTS = "running_acceptance_tests", "Running acceptance tests"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    TEARING_DOWN = "tearing_down", "Tearing down"
    DELETED = "deleted", "Deleted"
    FAILED = "failed", "Failed"


# The provisioning pipeline, in order; each is one step of a backend.
PROVISION_PHASES: tuple[str, ...] = (
    ClusterStatus.ALLOCATING_NODES,
    ClusterStatus.CONFIGURING_NETWORK,
    ClusterStatus.ATTACHING_STORAGE,
    ClusterStatus.INSTALLING_DRIVERS,
    ClusterStatus.RUNNING_ACCEPTANCE_TESTS,
)
# Handed over to the tenant.
LIVE_STATUSES: tuple[str, ...] = (ClusterStatus.READY, ClusterStatus.DEGRADED)
# Phases in which a provisioning task has (or should have) work to do.
PROVISIONING_STATUSES: tuple[str, ...] = (ClusterStatus.PENDING, *PROVISION_PHASES)
# Nothing more will happen without a person.
TERMINAL_STATUSES: tuple[str, ...] = (ClusterStatus.DELETED, ClusterStatus.FAILED)


class FailedDuring(models.TextChoices):
    PROVISIONING = "provisioning", "Provisioning"
    TEARDOWN = "teardown", "Teardown"


class CredentialKind(models.TextChoices):
    SSH_KEY = "ssh_key", "SSH key pair (private key)"
    KUBECONFIG = "kubeconfig", "Kubeconfig"


CREDENTIAL_FILENAMES = {
    CredentialKind.SSH_KEY: "id_ed25519",
    CredentialKind.KUBECONFIG: "kubeconfig.yaml",
}


class VolumeStatus(models.TextChoices):
    ACTIVE = "active", "Active"
    RELEASED = "released", "Released"


class TransitionSource(models.TextChoices):
    LIFECYCLE = "lifecycle", "Lifecycle (worker)"
    API = "api", "API or web page"
    ADMIN = "admin", "Staff"
    NODE = "node", "Node state change"
    RECONCILE = "reconcile", "Reconcile"


ORCHESTRATOR_VERSIONS: dict[str, tuple[str, ...]] = {
    "slurm": ("23.11", "24.05", "24.11"),
    "kubernetes": ("1.30", "1.31", "1.32"),
}
DEFAULT_ORCHESTRATOR_VERSION: dict[str, str] = {"slurm": "24.05", "kubernetes": "1.31"}

# MIG profiles (NVIDIA MIG user guide, "supported profiles") → instances of that profile per GPU,
# matched case-insensitively against the pool's gpu_model. A pool's own PoolCapability row wins.
MIG_PROFILES_BY_MODEL: tuple[tuple[str, dict[str, int]], ...] = (
    ("h200", {"1g.18gb": 7, "1g.35gb": 4, "2g.35gb": 3, "3g.71gb": 2, "4g.71gb": 1, "7g.141gb": 1}),
    ("h100", {"1g.10gb": 7, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}),
    ("a100", {"1g.10gb": 7, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}),
)
DEFAULT_MEMORY_PER_GPU_GIB = 64
MAX_MEMORY_PER_GPU_GIB = 240
