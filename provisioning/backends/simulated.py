"""A fleet that does not exist: the demo default.

Each phase takes PORTAL_SIMULATED_PHASE_SECONDS (realistic by default, 0 in tests); what
was "built" is kept in the shared cache (Redis), so status and reconcile see the same
state from the web process and every worker.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Collection
from dataclasses import asdict
from datetime import datetime
from typing import Any

import redis
from django.conf import settings

from portal.core.timefmt import format_utc
from portal.core.words import count_of

from ..conf import phase_seconds, setting
from .base import (
    BackendStatus,
    ClusterContext,
    Drift,
    PhaseResult,
    ProvisioningBackend,
    RepairGuard,
    repaired_drift,
)

__all__ = ["SimulatedBackend"]

_TTL = 60 * 60 * 24 * 400  # past the longest booking horizon


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _redis() -> redis.Redis:
    return _client(settings.REDIS_URL)


def _prefix() -> str:
    return f"{settings.CACHES['default'].get('KEY_PREFIX', '')}:prov-sim"


def _key(cluster_id: int) -> str:
    return f"{_prefix()}:cluster:{cluster_id}"


def _index() -> str:
    return f"{_prefix()}:index"


class SimulatedBackend(ProvisioningBackend):
    name = "simulated"

    def _pause(self, phase: str) -> None:
        seconds = phase_seconds(phase)
        if seconds > 0:
            time.sleep(seconds)

    def _load(self, ctx: ClusterContext) -> dict[str, Any]:
        raw = _redis().get(_key(ctx.cluster_id))
        return json.loads(raw) if raw else {}

    def _store(self, ctx: ClusterContext, **changes: Any) -> dict[str, Any]:
        state = self._load(ctx)
        state.update(changes)
        state.update(nodes=list(ctx.nodes), start=format_utc(ctx.start), end=format_utc(ctx.end),
                     tenant=ctx.tenant_slug, reservation=ctx.reservation_id)
        pipe = _redis().pipeline()
        pipe.set(_key(ctx.cluster_id), json.dumps(state), ex=_TTL)
        pipe.sadd(_index(), ctx.cluster_id)
        pipe.expire(_index(), _TTL)
        pipe.execute()
        return state

    def _forget(self, cluster_id: int) -> None:
        pipe = _redis().pipeline()
        pipe.delete(_key(cluster_id))
        pipe.srem(_index(), cluster_id)
        pipe.execute()

    def _connection(self, ctx: ClusterContext) -> dict[str, Any]:
        login = setting("PORTAL_LOGIN_HOST", "login.gpu-portal.internal")
        if ctx.orchestrator == "kubernetes":
            return {"namespace": f"tenant-{ctx.tenant_slug}-r{ctx.reservation_id}",
                    "api_server": setting("PORTAL_K8S_API_SERVER_URL", "https://k8s.gpu-portal.internal:6443")}
        return {"login_host": login, "ssh_user": ctx.tenant_slug, "slurm_account": ctx.tenant_slug,
                "slurm_reservation": f"{ctx.tenant_slug}-{ctx.reservation_id}"}

    def allocate_nodes(self, ctx: ClusterContext) -> PhaseResult:
        self._pause("allocating_nodes")
        self._store(ctx, phase="allocating_nodes")
        return PhaseResult(connection=self._connection(ctx),
                           detail=f"{count_of(len(ctx.nodes), 'simulated node')} claimed")

    def configure_network(self, ctx: ClusterContext) -> PhaseResult:
        self._pause("configuring_network")
        self._store(ctx, phase="configuring_network", vlan_id=ctx.vlan_id, cidr=ctx.cidr)
        return PhaseResult(detail=f"VLAN {ctx.vlan_id} {ctx.cidr}")

    def attach_storage(self, ctx: ClusterContext) -> PhaseResult:
        self._pause("attaching_storage")
        self._store(ctx, phase="attaching_storage", volume=ctx.volume_name)
        return PhaseResult(detail=f"{ctx.shared_storage_gib} GiB at /shared")

    def install_drivers(self, ctx: ClusterContext) -> PhaseResult:
        self._pause("installing_drivers")
        self._store(ctx, phase="installing_drivers", cuda=ctx.cuda_version, mig=ctx.mig_profile)
        mig = f", MIG {ctx.mig_profile}" if ctx.mig_profile else ""
        return PhaseResult(detail=f"CUDA {ctx.cuda_version}{mig}")

    def verify(self, ctx: ClusterContext) -> PhaseResult:
        self._pause("running_acceptance_tests")
        state = self._store(ctx, phase="verified")
        return PhaseResult(detail=f"{count_of(len(state['nodes']), 'node')} answer")

    def update_window(self, ctx: ClusterContext) -> PhaseResult:
        if self._load(ctx):
            self._store(ctx)
        return PhaseResult(detail=f"window now ends {format_utc(ctx.end)}")

    def swap_node(self, ctx: ClusterContext, old: str, new: str) -> PhaseResult:
        self._store(ctx)
        return PhaseResult(detail=f"{old} replaced by {new}")

    def teardown(self, ctx: ClusterContext) -> bool:
        self._pause("teardown")
        self._forget(ctx.cluster_id)
        return True

    def status(self, ctx: ClusterContext) -> BackendStatus:
        state = self._load(ctx)
        if not state:
            return BackendStatus(exists=False)
        return BackendStatus(
            exists=True,
            nodes=tuple(state.get("nodes", ())),
            start=datetime.fromisoformat(state["start"].replace("Z", "+00:00")),
            end=datetime.fromisoformat(state["end"].replace("Z", "+00:00")),
            detail=state.get("phase", ""),
        )

    def reconcile(self, wanted: list[ClusterContext], *, fix: bool,
                  tenants: Collection[str] | None = None, live: Callable[[int], bool] | None = None,
                  guard: RepairGuard | None = None) -> list[Drift]:
        drifts: list[Drift] = []
        built = [ctx for ctx in wanted if ctx.status in ("ready", "degraded")]
        wanted_ids = {ctx.cluster_id for ctx in wanted}
        # One cluster per reservation: an entry naming a wanted reservation under another cluster id is a stray.
        wanted_reservations = {ctx.reservation_id for ctx in wanted}
        index = {int(member) for member in _redis().smembers(_index())}
        for cluster_id in sorted(index - wanted_ids):
            raw = _redis().get(_key(cluster_id))
            reservation_id = json.loads(raw).get("reservation") if raw else None
            if (live is not None and isinstance(reservation_id, int) and reservation_id not in wanted_reservations
                    and live(reservation_id)):
                continue  # provisioned after `wanted` was read: not an orphan
            if raw:
                drifts.append(Drift("orphan", f"cluster-{cluster_id}", "simulated cluster no longer wanted", fix))
            if fix:
                self._forget(cluster_id)
        for ctx in built:
            status = self.status(ctx)
            if not status.exists:
                drifts.append(repaired_drift("missing", f"cluster-{ctx.cluster_id}", "simulated cluster missing",
                                             fix=fix, repair=lambda ctx=ctx: self._store(ctx, phase="verified"),
                                             ctx=ctx, guard=guard))
            elif set(status.nodes) != set(ctx.nodes) or status.end != ctx.end:
                drifts.append(repaired_drift("mismatch", f"cluster-{ctx.cluster_id}",
                                             f"nodes/end differ: {asdict(status)}", fix=fix,
                                             repair=lambda ctx=ctx: self._store(ctx), ctx=ctx, guard=guard))
        return drifts
