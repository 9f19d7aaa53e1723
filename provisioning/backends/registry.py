"""Choose and build backends from PORTAL_PROVISIONING_BACKEND (and wrap them in faults if asked)."""

from __future__ import annotations

from ..conf import backend_names, setting
from .base import BackendError, ProvisioningBackend
from .faults import FaultyBackend, parse_faults

__all__ = ["BACKENDS", "backend_for_orchestrator", "backend_class", "configured_backends", "get_backend",
           "holds_bookings"]

BACKENDS = ("simulated", "slurm", "kubernetes")


def backend_for_orchestrator(orchestrator: str) -> str:
    """Return the backend a new cluster gets.

    One configured name serves every cluster; a list (``slurm,kubernetes``) picks the one
    named like the cluster's orchestrator, else the first.
    """
    names = backend_names()
    for name in names:
        if name not in BACKENDS:
            raise BackendError(f"PORTAL_PROVISIONING_BACKEND names unknown backend {name!r}", transient=False)
    return orchestrator if orchestrator in names else names[0]


def configured_backends() -> list[str]:
    return [name for name in backend_names() if name in BACKENDS]


def backend_class(name: str) -> type[ProvisioningBackend]:
    if name == "simulated":
        from .simulated import SimulatedBackend

        return SimulatedBackend
    if name == "slurm":
        from .slurm import SlurmBackend

        return SlurmBackend
    if name == "kubernetes":
        from .kubernetes import KubernetesBackend

        return KubernetesBackend
    raise BackendError(f"unknown provisioning backend {name!r}", transient=False)


def holds_bookings(name: str) -> bool:
    """Tell whether backend name keeps the window from booking time (Slurm reservations)."""
    return name in BACKENDS and backend_class(name).holds_bookings


def get_backend(name: str) -> ProvisioningBackend:
    """Build backend name (the caller closes it)."""
    backend = backend_class(name)()
    faults = parse_faults(setting("PORTAL_PROVISIONING_FAULTS", "") or "")
    return FaultyBackend(backend, faults) if faults else backend
