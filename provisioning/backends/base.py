"""The one interface every provisioning backend implements, and the plain data it receives.

Backends know nothing of Django models: the services build a :class:`ClusterContext` from
the database and pass it in, and persist what a backend returns. Every method must be
idempotent (a retried or redelivered task calls it again) and may be slow: the services
never call a backend inside a database transaction.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "BackendError",
    "BackendConflict",
    "BackendWait",
    "DrainIncomplete",
    "ClusterContext",
    "PhaseResult",
    "BackendStatus",
    "Drift",
    "ProvisioningBackend",
    "NodeRepairGuard",
    "RepairGuard",
    "guarded_node_repair",
    "repaired_drift",
]


class BackendError(Exception):
    """A backend call failed. transient=True: retry with backoff; False: fail the cluster now."""

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


class BackendConflict(BackendError):
    """The backend holds something else where the portal allocated (e.g. a stale Slurm reservation).

    ``conflicting`` names the backend objects in the way, so the caller can converge them
    from the database first and try again.
    """

    def __init__(self, message: str, *, conflicting: Iterable[str] = ()) -> None:
        super().__init__(message, transient=True)
        self.conflicting = tuple(conflicting)


class BackendWait(BackendError):
    """Not yet, and through no failure: what the step needs is still another booking's (a node the previous
    booking holds until its window ends, just before this one starts). The caller tries again in about
    ``countdown`` seconds without counting an attempt."""

    def __init__(self, message: str, *, countdown: float) -> None:
        super().__init__(message, transient=True)
        self.countdown = countdown


class DrainIncomplete(BackendError):
    """A drain took the node out of service but could not empty it yet (a pod's disruption budget said
    "not now"): the caller tries again later."""


@dataclass(frozen=True, kw_only=True)
class ClusterContext:
    """Everything a backend may need about one cluster, read from the database."""

    cluster_id: int
    reservation_id: int
    tenant_slug: str
    pool_name: str
    gpu_model: str
    gpus_per_node: int
    nodes: tuple[str, ...]
    start: datetime
    end: datetime
    orchestrator: str
    orchestrator_version: str
    cuda_version: str
    mig_profile: str = ""
    mig_instances_per_gpu: int | None = None
    default_memory_per_gpu_gib: int = 64
    shared_storage_gib: int = 1024
    vlan_id: int | None = None
    cidr: str = ""
    volume_name: str = ""
    backend_state: dict[str, Any] = field(default_factory=dict)
    # The cluster's phase when the context was read (reconcile: only built clusters can be missing).
    status: str = ""
    # A nonce that is new for every cluster row (fault-injection counters key on it).
    created_at: datetime | None = None


@dataclass
class PhaseResult:
    """What a step produced: connection details (not secret), state to keep, secrets to encrypt."""

    connection: dict[str, Any] = field(default_factory=dict)
    backend_state: dict[str, Any] = field(default_factory=dict)
    # kind → plaintext; the services encrypt before anything is stored. Never log this.
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    detail: str = ""


@dataclass(frozen=True)
class BackendStatus:
    """The backend's own view of one cluster (for the cluster page and reconcile)."""

    exists: bool
    nodes: tuple[str, ...] = ()
    start: datetime | None = None
    end: datetime | None = None
    detail: str = ""


@dataclass(frozen=True)
class Drift:
    """One difference between the portal's database and the backend."""

    kind: str  # missing | orphan | mismatch | node
    name: str
    detail: str
    repaired: bool = False
    # A repair that made new credentials (a re-created ServiceAccount's kubeconfig): the services
    # store them on this cluster, as they store a phase's, with the state the backend keeps about them
    # (when the new token was issued and expires). Never logged.
    cluster_id: int | None = None
    secrets: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    backend_state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# reconcile's caller decides whether a repair of one wanted cluster may run now: guard(ctx, repair) returns what
# repair() returned, or raises BackendError saying why it was left alone (a task holds the cluster, it is being
# torn down, it changed since ctx was read).
RepairGuard = Callable[[ClusterContext, Callable[[], object]], object]


# reconcile_nodes' caller decides likewise whether a repair of one node may run now: guard(hostname, state,
# repair), state being the portal's state of the node as the caller read it.
NodeRepairGuard = Callable[[str, str, Callable[[], object]], object]


def guarded_node_repair(guard: NodeRepairGuard | None, hostname: str, state: str,
                        repair: Callable[[], object]) -> Callable[[], object]:
    """The repair of one node, run through guard when given (for repaired_drift)."""
    if guard is None:
        return repair
    return lambda: guard(hostname, state, repair)


def repaired_drift(kind: str, name: str, detail: str, *, fix: bool, repair: Callable[[], object],
                   cluster_id: int | None = None, ctx: ClusterContext | None = None,
                   guard: RepairGuard | None = None) -> Drift:
    """Return the drift, running ``repair`` first when fix; a repair that fails is reported, not raised.

    One repair refused (an overlap, a node the backend does not know) or a backend that stops
    answering half-way must neither hide the drifts found so far nor the repairs already made. A
    repair returning a PhaseResult hands its secrets and backend state on (for cluster_id). A repair of the wanted
    cluster ctx goes through guard, when given.
    """
    if not fix:
        return Drift(kind, name, detail)
    try:
        outcome = guard(ctx, repair) if guard is not None and ctx is not None else repair()
    except BackendError as exc:
        return Drift(kind, name, f"{detail}; repair failed: {exc.message}")
    if not isinstance(outcome, PhaseResult):
        return Drift(kind, name, detail, True, cluster_id=cluster_id)
    return Drift(kind, name, detail, True, cluster_id=cluster_id, secrets=dict(outcome.secrets),
                 backend_state=dict(outcome.backend_state))


class ProvisioningBackend(abc.ABC):
    """Provision, resize/swap, tear down, report status and reconcile tenant clusters."""

    name: str = ""
    # True when the backend should hold the window from booking time (Slurm reservations
    # block the nodes in Slurm's own scheduler long before the cluster is built).
    holds_bookings: bool = False

    # --- provisioning, one call per phase (choices.PROVISION_PHASES) ---

    @abc.abstractmethod
    def allocate_nodes(self, ctx: ClusterContext) -> PhaseResult:
        """Claim the reservation's nodes for the tenant for [start, end)."""

    @abc.abstractmethod
    def configure_network(self, ctx: ClusterContext) -> PhaseResult:
        """Isolate the tenant's network segment and set up access (accounts, RBAC, credentials)."""

    @abc.abstractmethod
    def attach_storage(self, ctx: ClusterContext) -> PhaseResult:
        """Attach the tenant's shared volume."""

    @abc.abstractmethod
    def install_drivers(self, ctx: ClusterContext) -> PhaseResult:
        """Put the chosen CUDA driver and GPU settings (MIG layout) on the nodes."""

    @abc.abstractmethod
    def verify(self, ctx: ClusterContext) -> PhaseResult:
        """Backend half of the acceptance tests: is what we built really there?"""

    # --- changes while booked or running ---

    def book(self, ctx: ClusterContext) -> PhaseResult:
        """Hold (or update) the booking window in the backend; a no-op unless holds_bookings."""
        return PhaseResult()

    def release_booking(self, ctx: ClusterContext) -> None:  # noqa: B027 - optional hook, no-op by default
        """Drop a booking that will not be provisioned (cancelled, failed)."""

    @abc.abstractmethod
    def update_window(self, ctx: ClusterContext) -> PhaseResult:
        """Apply a changed end (or start, before it began) and node set to a provisioned cluster."""

    @abc.abstractmethod
    def swap_node(self, ctx: ClusterContext, old: str, new: str) -> PhaseResult:
        """Replace node old by node new in a provisioned cluster (ctx.nodes already holds new)."""

    @abc.abstractmethod
    def teardown(self, ctx: ClusterContext) -> bool:
        """Remove everything of the cluster; return False while still in progress (call again)."""

    @abc.abstractmethod
    def status(self, ctx: ClusterContext) -> BackendStatus:
        """Report the backend's view of the cluster."""

    def drain_node(self, hostname: str, reason: str) -> None:  # noqa: B027 - optional hook
        """Take a node out of service in the backend (no new work)."""

    def resume_node(self, hostname: str) -> None:  # noqa: B027 - optional hook
        """Return a node drained by the portal to service."""

    @abc.abstractmethod
    def reconcile(self, wanted: list[ClusterContext], *, fix: bool,
                  tenants: Collection[str] | None = None, live: Callable[[int], bool] | None = None,
                  guard: RepairGuard | None = None) -> list[Drift]:
        """Compare the backend with what the portal wants; repair if fix.

        ``wanted`` holds every cluster whose artefacts may exist (being built, live, or a
        held booking); anything of ours the backend has beyond them is an orphan. Only
        clusters whose ``status`` is ready/degraded must be complete. ``tenants`` (the slugs the
        portal knows), when given, narrows "ours": an object named for another name is an
        operator's, never reported or deleted. ``live``, when given, is asked (with the
        reservation id) about each would-be orphan after the backend was read: ``wanted`` was read
        before, so a booking made meanwhile is in the backend but not in it, and must not be
        deleted as an orphan. ``guard``, when given, runs each repair of a cluster of ``wanted``
        (repaired_drift's ctx): the caller's say on whether it may run now.
        """

    def reconcile_nodes(self, states: dict[str, str], *, fix: bool,
                        guard: NodeRepairGuard | None = None) -> list[Drift]:
        """Compare node states (hostname → portal state) with the backend; repair if fix, each repair of a
        node through guard when given (guarded_node_repair): states were read before the backend."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
