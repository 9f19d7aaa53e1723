"""Fault injection by setting, for any backend (the chaos switch of demos and tests).

PORTAL_PROVISIONING_FAULTS is a comma list of ``operation=action``:

- operations: ``allocating_nodes``, ``configuring_network``, ``attaching_storage``,
  ``installing_drivers``, ``running_acceptance_tests``, ``teardown``, ``book``, ``swap``, ``drain``;
- actions: ``error`` (a transient backend error every time), ``error:N`` (the first N
  calls per cluster fail, later ones pass), ``fatal`` (a permanent error), ``sleep:S``
  (wait S seconds, then run the real call; used to kill a worker mid-phase);
- ``drain=incomplete`` / ``drain=incomplete:N``: a node's drain takes it out of service but cannot
  empty it (DrainIncomplete, as a pod held by its PodDisruptionBudget or Slurm jobs still ending),
  every time or on the first N drains of each node (counted per hostname until it is resumed).

Counters for ``error:N`` live in the shared cache, keyed by cluster id and creation time,
so every worker process sees the same count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.core.cache import cache

from .base import BackendError, ClusterContext, DrainIncomplete, PhaseResult, ProvisioningBackend

__all__ = ["Fault", "parse_faults", "FaultyBackend"]


@dataclass(frozen=True)
class Fault:
    action: str  # error | fatal | sleep | incomplete (drain only)
    value: float | None = None


def parse_faults(spec: str) -> dict[str, Fault]:
    """Parse the setting; raise ValueError on anything unknown (a typo must not pass silently)."""
    faults: dict[str, Fault] = {}
    for item in filter(None, (part.strip() for part in (spec or "").split(","))):
        op, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"fault {item!r}: expected operation=action")
        name, _, arg = action.strip().partition(":")
        if name not in ("error", "fatal", "sleep", "incomplete"):
            raise ValueError(f"fault {item!r}: unknown action {name!r}")
        if name == "incomplete" and op.strip() != "drain":
            raise ValueError(f"fault {item!r}: only a drain can be left incomplete")
        if name == "sleep" and not arg:
            raise ValueError(f"fault {item!r}: sleep needs seconds")
        faults[op.strip()] = Fault(name, float(arg) if arg else None)
    return faults


class FaultyBackend(ProvisioningBackend):
    """Wrap a backend; before each named operation apply its fault, then call through."""

    def __init__(self, inner: ProvisioningBackend, faults: dict[str, Fault]) -> None:
        self.inner = inner
        self.faults = faults
        self.name = inner.name
        self.holds_bookings = inner.holds_bookings

    def _inject(self, op: str, ctx: ClusterContext | None) -> None:
        fault = self.faults.get(op)
        if fault is None:
            return
        if fault.action == "sleep":
            time.sleep(fault.value or 0)
            return
        if fault.action == "fatal":
            raise BackendError(f"injected permanent fault in {op}", transient=False)
        if fault.value is not None and ctx is not None:
            stamp = ctx.created_at.timestamp() if ctx.created_at else 0
            key = f"prov-fault:{ctx.cluster_id}:{stamp}:{op}"
            cache.add(key, 0, 86400)
            if cache.incr(key) > fault.value:
                return
        raise BackendError(f"injected transient fault in {op}")

    def _wrap(self, op: str, method: str, ctx: ClusterContext, *args: Any) -> Any:
        self._inject(op, ctx)
        return getattr(self.inner, method)(ctx, *args)

    def allocate_nodes(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("allocating_nodes", "allocate_nodes", ctx)

    def configure_network(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("configuring_network", "configure_network", ctx)

    def attach_storage(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("attaching_storage", "attach_storage", ctx)

    def install_drivers(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("installing_drivers", "install_drivers", ctx)

    def verify(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("running_acceptance_tests", "verify", ctx)

    def book(self, ctx: ClusterContext) -> PhaseResult:
        return self._wrap("book", "book", ctx)

    def release_booking(self, ctx: ClusterContext) -> None:
        return self.inner.release_booking(ctx)

    def update_window(self, ctx: ClusterContext) -> PhaseResult:
        return self.inner.update_window(ctx)

    def swap_node(self, ctx: ClusterContext, old: str, new: str) -> PhaseResult:
        return self._wrap("swap", "swap_node", ctx, old, new)

    def teardown(self, ctx: ClusterContext) -> bool:
        return self._wrap("teardown", "teardown", ctx)

    def status(self, ctx):
        return self.inner.status(ctx)

    def drain_node(self, hostname: str, reason: str) -> None:
        fault = self.faults.get("drain")
        if fault is not None and fault.action == "incomplete":
            self.inner.drain_node(hostname, reason)  # out of service, as a cordon is; not yet empty
            key = f"prov-fault:drain:{hostname}"
            cache.add(key, 0, 86400)
            if fault.value is None or cache.incr(key) <= fault.value:
                raise DrainIncomplete(f"node {hostname}: injected fault: 1 tenant job not finished yet")
            return
        self._inject("drain", None)
        self.inner.drain_node(hostname, reason)

    def resume_node(self, hostname: str) -> None:
        cache.delete(f"prov-fault:drain:{hostname}")
        self.inner.resume_node(hostname)

    def reconcile(self, wanted, *, fix, tenants=None, live=None, guard=None):
        return self.inner.reconcile(wanted, fix=fix, tenants=tenants, live=live, guard=guard)

    def reconcile_nodes(self, states, *, fix, guard=None):
        return self.inner.reconcile_nodes(states, fix=fix, guard=guard)

    def close(self) -> None:
        self.inner.close()
