"""Slurm backend: the portal is the privileged broker that owns ``<tenant>-<id>`` reservations.

Through :class:`~provisioning.backends.slurm_client.SlurmClient` (``scontrol``):

- a booking becomes ``create reservation ReservationName=<tenant>-<id> Nodes=<hostlist>
  StartTime EndTime Accounts=<tenant>`` as soon as it is confirmed (so Slurm's own
  scheduler keeps the window free), an extension or shortening an ``update``, a cancel or
  teardown a ``delete``; every call goes through ``ensure_reservation``, which converges
  instead of failing when a task runs twice; the team's jobs left in a reservation being deleted
  at the booking's cancel or end, or as an orphan (running, or queued for its window), are cancelled, since
  Slurm deletes none that a job names (a live booking left with no node keeps its jobs and its reservation
  until they end);
- a failed node is drained (``update NodeName=… State=DRAIN Reason="portal: …"``) and a
  replacement node swapped into the reservation's node list; the drain is unfinished
  (``DrainIncomplete``) while jobs still run on the node, as Slurm lets them finish;
- ``reconcile`` compares Slurm's reservations with the database both ways; a portal reservation
  changed by hand (nodes, window, accounts, ``Users=`` or ``Groups=`` added, partition) is reported as a
  mismatch, and only ``--fix`` puts it back as the portal holds it.

The tenant's Slurm account is the ``Accounts=`` of its reservations. Creating the account
in slurmdbd (``sacctmgr``) is not done here: the clusters this was written against run
without slurmdbd, where ``Accounts=`` is not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from datetime import UTC, datetime

from portal.core.words import count_of

from ..conf import setting, setting_float
from .base import (
    BackendConflict,
    BackendError,
    BackendStatus,
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
from .slurm_client import (
    NodeInfo,
    NodeNotFound,
    Partition,
    PartitionNotFound,
    ReservationAlreadyStarted,
    ReservationBusy,
    ReservationOverlap,
    SlurmClient,
    SlurmError,
    SlurmUnavailable,
    reservation_name,
    same_start,
)

__all__ = ["SlurmBackend", "DRAIN_REASON_PREFIX"]

# Nodes the portal drained carry this reason prefix; only those are resumed automatically.
DRAIN_REASON_PREFIX = "portal:"
_PORTAL_NAME = re.compile(r"^(?P<slug>[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)-(?P<id>[0-9]+)$")


def parse_reservation_name(name: str) -> tuple[str, int] | None:
    """Return (tenant slug, reservation id) for a name of the portal's form, else None."""
    match = _PORTAL_NAME.match(name)
    return (match["slug"], int(match["id"])) if match else None


class SlurmBackend(ProvisioningBackend):
    name = "slurm"
    holds_bookings = True

    def __init__(self, client: SlurmClient | None = None) -> None:
        self.client = client or SlurmClient(
            setting("PORTAL_SLURM_CONF", None),
            scontrol=setting("PORTAL_SCONTROL", "scontrol"),
            timeout=setting_float("PORTAL_SLURM_TIMEOUT", 30.0),
        )
        self.partition = setting("PORTAL_SLURM_PARTITION", None) or None

    # --- helpers ---

    @staticmethod
    def reservation_name(ctx: ClusterContext) -> str:
        return reservation_name(ctx.tenant_slug, ctx.reservation_id)

    def _connection(self, ctx: ClusterContext) -> dict[str, str]:
        return {
            "login_host": setting("PORTAL_LOGIN_HOST", "login.gpu-portal.internal"),
            "ssh_user": ctx.tenant_slug,
            "slurm_account": ctx.tenant_slug,
            "slurm_reservation": self.reservation_name(ctx),
            "submit_hint": f"sbatch --reservation={self.reservation_name(ctx)} --account={ctx.tenant_slug} job.sh",
        }

    def _ensure(self, ctx: ClusterContext) -> PhaseResult:
        name = self.reservation_name(ctx)
        try:
            result = self.client.ensure_reservation(
                name, ctx.nodes, ctx.start, ctx.end, accounts=[ctx.tenant_slug], partition=self.partition
            )
        except ReservationOverlap as exc:
            raise BackendConflict(f"Slurm: {exc.message}", conflicting=self._overlapping(ctx, exclude=name))
        except ReservationAlreadyStarted as exc:
            raise BackendError(f"Slurm: {exc.message}", transient=False)
        except SlurmUnavailable as exc:
            raise BackendError(f"Slurm unavailable: {exc.message}")
        except NodeNotFound as exc:
            raise BackendError(f"Slurm does not know {self._unknown_nodes(ctx.nodes)}: {exc.message}",
                               transient=False)
        except PartitionNotFound as exc:
            # A setting (or a partition removed by hand) that no retry changes; reconcile reports it too.
            raise BackendError(f"Slurm has no partition {self.partition} (PORTAL_SLURM_PARTITION): {exc.message}",
                               transient=False)
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        except ValueError as exc:
            raise BackendError(f"Slurm request refused: {exc}", transient=False)
        return PhaseResult(
            connection=self._connection(ctx),
            backend_state={"slurm_reservation": name},
            detail=f"Slurm reservation {name} {result.action.value}",
        )

    def _hold(self, ctx: ClusterContext) -> PhaseResult:
        """_ensure the booking's reservation; a booking left with no node (each failed, no spare free) has none.

        Slurm has no empty reservation, and one left on the failed nodes would start the tenant's jobs
        there again once they are resumed, while the portal hands them to others. The booking gets a
        reservation again when it gets nodes (an edit that re-allocates it).
        """
        if ctx.nodes:
            return self._ensure(ctx)
        name = self.reservation_name(ctx)
        try:
            self.client.delete_reservation(name, missing_ok=True)
        except ReservationBusy:
            # The booking still runs (it may get a spare back): the team's jobs in it are theirs, not cancelled as
            # at its cancel or end; a running one on the drained node finishes. Tried again until none is left.
            raise BackendError(f"Slurm: jobs of the team still name {name}: it is removed once they have ended")
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        return PhaseResult(connection=self._connection(ctx),
                           detail=f"booking holds no nodes: Slurm reservation {name} removed")

    def _unknown_nodes(self, hostnames: Collection[str]) -> str:
        """Name the nodes Slurm does not know: its "Invalid node name specified" names none."""
        try:
            known = self._show_nodes(hostnames)
            unknown = [hostname for hostname in sorted(hostnames) if hostname not in known]
        except BackendError:
            unknown = []  # the controller stopped answering: the refusal is still reported
        if not unknown:
            return "a node"
        return f"{'node' if len(unknown) == 1 else 'nodes'} {','.join(unknown)}"

    def _overlapping(self, ctx: ClusterContext, *, exclude: str) -> list[str]:
        """Name the Slurm reservations that hold any of ctx's nodes during its window."""
        try:
            existing = self.client.show_reservations()
        except SlurmError:
            return []
        nodes = set(ctx.nodes)
        names = []
        for name, res in existing.items():
            if name == exclude or not nodes.intersection(res.nodes):
                continue
            if res.start is not None and res.start >= ctx.end:
                continue
            if res.end is not None and res.end <= max(ctx.start, datetime.now(UTC)):
                continue
            names.append(name)
        return names

    # --- booking ---

    def book(self, ctx: ClusterContext) -> PhaseResult:
        return self._hold(ctx)

    def release_booking(self, ctx: ClusterContext) -> None:
        self._delete(self.reservation_name(ctx))  # jobs still ending: a transient error, the sync is tried again

    # --- provisioning phases ---

    def allocate_nodes(self, ctx: ClusterContext) -> PhaseResult:
        return self._ensure(ctx)

    def configure_network(self, ctx: ClusterContext) -> PhaseResult:
        return PhaseResult(connection=self._connection(ctx),
                           detail=f"Slurm account {ctx.tenant_slug}; VLAN {ctx.vlan_id} {ctx.cidr}")

    def attach_storage(self, ctx: ClusterContext) -> PhaseResult:
        return PhaseResult(connection={"shared_storage": f"/shared/{ctx.volume_name}"},
                           detail=f"{ctx.shared_storage_gib} GiB volume {ctx.volume_name}")

    def install_drivers(self, ctx: ClusterContext) -> PhaseResult:
        mig = f", MIG {ctx.mig_profile}" if ctx.mig_profile else ""
        return PhaseResult(detail=f"CUDA {ctx.cuda_version}{mig} (node image)")

    def verify(self, ctx: ClusterContext) -> PhaseResult:
        name = self.reservation_name(ctx)
        try:
            res = self.client.show_reservation(name)
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        if res is None:
            raise BackendError(f"Slurm reservation {name} is missing")
        if set(res.nodes) != set(ctx.nodes):
            raise BackendError(f"Slurm reservation {name} holds {','.join(res.nodes)}, expected {','.join(ctx.nodes)}")
        return PhaseResult(detail=f"Slurm reservation {name} on {count_of(len(res.nodes), 'node')} ({res.state})")

    # --- changes ---

    def update_window(self, ctx: ClusterContext) -> PhaseResult:
        return self._hold(ctx)

    def swap_node(self, ctx: ClusterContext, old: str, new: str) -> PhaseResult:
        result = self._ensure(ctx)
        result.detail = f"{old} replaced by {new} in {self.reservation_name(ctx)}"
        return result

    def teardown(self, ctx: ClusterContext) -> bool:
        """Delete the booking's reservation; False (in progress) while its cancelled jobs are still ending."""
        return self._delete_cancelling_jobs(self.reservation_name(ctx))

    def status(self, ctx: ClusterContext) -> BackendStatus:
        try:
            res = self.client.show_reservation(self.reservation_name(ctx))
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        if res is None:
            return BackendStatus(exists=False)
        return BackendStatus(exists=True, nodes=res.nodes, start=res.start, end=res.end, detail=res.state)

    def drain_node(self, hostname: str, reason: str) -> None:
        # Slurm takes one line of text: a reason with line breaks or tabs (an agent's multi-line
        # message, a staff note) is folded onto one line, not refused (the node must still drain).
        line = " ".join("".join(c if ord(c) >= 32 and ord(c) != 127 else " " for c in reason).split()) or "-"
        info = self._show_node(hostname)
        if info is None:
            return
        if not info.drained:
            try:
                info = self.client.drain_node(hostname, f"{DRAIN_REASON_PREFIX} {line}"[:200])
            except NodeNotFound:
                return
            except SlurmError as exc:
                raise BackendError(f"Slurm: {exc.message}")
        if info.busy:
            # DRAIN stops new jobs only: the running ones (the team's, still on the failed node) finish first.
            # Unfinished until they end; the caller tries again (NodeDrain, PortalNodeDrainStuck).
            raise DrainIncomplete(f"node {hostname}: Slurm jobs still running on it ({info.state}); "
                                  f"see squeue -w {hostname}")

    def resume_node(self, hostname: str) -> None:
        info = self._show_node(hostname)
        if info is None or not (info.drained and (info.reason or "").startswith(DRAIN_REASON_PREFIX)):
            return
        try:
            self.client.resume_node(hostname)
        except NodeNotFound:
            return
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")

    def _show_nodes(self, hostnames: Collection[str]) -> dict[str, NodeInfo]:
        """Slurm's view of those of ``hostnames`` it knows, by name and in name order, read with one scontrol call
        (not one per node: a 1,000-node fleet was 1,000 subprocesses and RPCs to slurmctld per reconcile)."""
        try:
            nodes = self.client.show_nodes()
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        return {hostname: nodes[hostname] for hostname in sorted(hostnames) if hostname in nodes}

    def _show_node(self, hostname: str) -> NodeInfo | None:
        """Slurm's view of a node; None for one Slurm does not know, or cannot know: a hostname no Slurm node
        can have (the admin takes any, "gpu node 7") is refused by the client before scontrol runs."""
        try:
            return self.client.show_node(hostname)
        except (NodeNotFound, ValueError):
            return None
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")

    # --- drift ---

    def _delete(self, name: str) -> None:
        if not self._delete_cancelling_jobs(name):
            raise BackendError(f"Slurm: jobs of {name} still ending after their cancel: the reservation stays "
                               "until they have")

    def _delete_cancelling_jobs(self, name: str) -> bool:
        """Delete the reservation; jobs the team left in it (running, or queued for the window) are cancelled.

        Slurm refuses to delete a reservation any job names, even one only waiting for its window: a booking
        cancelled or at its end goes with the team's jobs, which could never run once it is gone. False while
        jobs are still ending after their cancel (the next try deletes it); True once it is gone.
        """
        try:
            try:
                self.client.delete_reservation(name, missing_ok=True)
            except ReservationBusy:
                self.client.cancel_reservation_jobs(name)
                self.client.delete_reservation(name, missing_ok=True)
        except ReservationBusy:
            return False
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        return True

    def reconcile(self, wanted: list[ClusterContext], *, fix: bool,
                  tenants: Collection[str] | None = None, live: Callable[[int], bool] | None = None,
                  guard: RepairGuard | None = None) -> list[Drift]:
        drifts: list[Drift] = []
        try:
            existing = self.client.show_reservations()
            partitions = self.client.show_partitions()
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")
        now = datetime.now(UTC)
        by_name = {self.reservation_name(ctx): ctx for ctx in wanted}
        # Slurm → portal: our reservations the database no longer wants.
        for name, res in sorted(existing.items()):
            parsed = parse_reservation_name(name)
            # Ours only if named <slug>-<id>, held for that very account, and the slug a tenant's: a
            # reservation an operator made by hand ("maint-2026" for account maint) is reported by
            # nobody and never deleted.
            if name in by_name or parsed is None or res.accounts != {parsed[0]}:
                continue
            if tenants is not None and parsed[0] not in tenants:
                continue
            if live is not None and live(parsed[1]):
                continue  # booked after `wanted` was read, and synced already: not an orphan
            drifts.append(repaired_drift(
                "orphan", name, f"Slurm reservation on {','.join(res.nodes)} has no live booking",
                fix=fix, repair=lambda name=name: self._delete(name)))
        # Portal → Slurm: bookings Slurm lacks or holds differently.
        for name, ctx in sorted(by_name.items()):
            if ctx.end <= now:
                continue  # Slurm purges ended reservations itself
            res = existing.get(name)
            if not ctx.nodes:
                if res is None:
                    continue  # holds no node, so no reservation: right as it is
                kind, detail = "mismatch", (f"the booking holds no nodes (failed, no spare free); Slurm holds "
                                            f"{','.join(res.nodes)}")
            elif res is None:
                kind, detail = "missing", "Slurm has no reservation for this booking"
            elif (set(res.nodes) != set(ctx.nodes) or res.end != ctx.end.astimezone(UTC).replace(microsecond=0)
                  or not same_start(res, ctx.start, now) or res.accounts != {ctx.tenant_slug}
                  # The portal names no Users=: users added by hand run in the tenant's window, and the next
                  # _ensure removes them, so they are drift to report (and --fix removes them), not to keep.
                  or res.users
                  # Groups= by hand: only those groups' members of the tenant's account may use it any more.
                  or res.groups
                  or (self.partition is not None and res.partition != self.partition)):
                where = f" in partition {res.partition}" if self.partition is not None else ""
                users = f" and users {','.join(sorted(res.users))}" if res.users else ""
                users += f" and groups {','.join(sorted(res.groups))}" if res.groups else ""
                kind, detail = "mismatch", (f"Slurm holds {','.join(res.nodes)} from {res.start} until {res.end} "
                                            f"for {','.join(sorted(res.accounts)) or 'no account'}{users}{where}")
            else:
                continue
            drifts.append(repaired_drift(kind, name, detail, fix=fix, repair=lambda ctx=ctx: self._hold(ctx),
                                         ctx=ctx, guard=guard))
        return drifts + self._reconcile_partition(partitions, wanted, now, fix=fix)

    def _reconcile_partition(self, partitions: dict[str, Partition], wanted: list[ClusterContext], now: datetime,
                             *, fix: bool) -> list[Drift]:
        """The partition the tenants' jobs run in (PORTAL_SLURM_PARTITION, else Slurm's default) must be UP and
        hold every node booked: a node taken out of it or a partition set DOWN by hand leaves the tenants'
        jobs pending in their reservations for ever."""
        name = self.partition or next((p.name for p in partitions.values() if p.default), None)
        if name is None:
            return []  # no partition named and no default: jobs name their own, nothing to compare
        partition = partitions.get(name)
        if partition is None:
            return [Drift("missing", f"partition {name}", "Slurm has no such partition: the tenants' jobs are "
                          "refused (set PORTAL_SLURM_PARTITION or create it)")]
        drifts = []
        lacking = sorted({node for ctx in wanted if ctx.end > now for node in ctx.nodes} - set(partition.nodes))
        if lacking:
            drifts.append(repaired_drift(
                "mismatch", f"partition {name}", f"lacks booked {'node' if len(lacking) == 1 else 'nodes'} "
                f"{','.join(lacking)}: the tenants' jobs never run there", fix=fix,
                repair=lambda: self._add_to_partition(partition, lacking)))
        if partition.state != "UP":
            drifts.append(repaired_drift(
                "mismatch", f"partition {name}", f"is {partition.state}: no tenant job starts", fix=fix,
                repair=lambda: self._update_partition(name, state="UP")))
        return drifts

    def _add_to_partition(self, partition: Partition, lacking: list[str]) -> None:
        """Put the lacking booked nodes Slurm knows into the partition; name those it does not know.

        Slurm refuses a node list with one unknown name whole, without naming it: one booked node Slurm lacks
        must not keep the others out of the partition."""
        in_slurm = self._show_nodes(lacking)
        known = [hostname for hostname in lacking if hostname in in_slurm]
        if known:
            self._update_partition(partition.name, nodes=[*partition.nodes, *known])
        if unknown := [hostname for hostname in lacking if hostname not in known]:
            raise BackendError(f"Slurm does not know {'node' if len(unknown) == 1 else 'nodes'} "
                               f"{','.join(unknown)}", transient=False)

    def _update_partition(self, name: str, **changes: object) -> None:
        try:
            self.client.update_partition(name, **changes)  # type: ignore[arg-type]
        except SlurmError as exc:
            raise BackendError(f"Slurm: {exc.message}")

    def reconcile_nodes(self, states: dict[str, str], *, fix: bool,
                        guard: NodeRepairGuard | None = None) -> list[Drift]:
        """Drain in Slurm what the portal took out of service; resume what it put back."""
        # Read every node before changing any: a controller that stops answering half-way
        # leaves a report, not repairs nobody was told about.
        infos = self._show_nodes(states)
        drifts: list[Drift] = []
        for hostname, info in infos.items():
            state = states[hostname]
            out_of_service = state in ("failed", "draining", "maintenance", "retired")
            if out_of_service and not info.drained:
                drifts.append(repaired_drift(
                    "node", hostname, f"portal says {state}, Slurm says {info.state}", fix=fix,
                    repair=guarded_node_repair(guard, hostname, state, lambda hostname=hostname, state=state:
                                               self.drain_node(hostname, f"node is {state} in the portal"))))
            elif out_of_service and info.busy:
                # Drained, but the jobs that ran there go on until they end (or staff cancel them): nothing to
                # repair, the node is not empty yet (the node's own sync tries its drain again meanwhile).
                drifts.append(Drift("node", hostname, f"portal says {state}, Slurm jobs still running on it "
                                    f"({info.state}): see squeue -w {hostname}"))
            elif (not out_of_service and info.drained
                  and (info.reason or "").startswith(DRAIN_REASON_PREFIX)):
                drifts.append(repaired_drift(
                    "node", hostname, f"portal says {state}, Slurm drained it for us", fix=fix,
                    repair=guarded_node_repair(guard, hostname, state,
                                               lambda hostname=hostname: self.resume_node(hostname))))
            elif not out_of_service and info.drained:
                # Drained by Slurm itself or an operator: the portal still books it, and jobs will not
                # start there. Not ours to resume: reported until someone decides.
                drifts.append(Drift("node", hostname, f"portal says {state}, Slurm drained it "
                                    f"({info.reason or 'no reason'}): set the node's state in the portal "
                                    "or resume it in Slurm"))
        return drifts
