"""The Slurm backend against a real slurmctld: every check reads Slurm's own state back."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from datetime import UTC, timedelta

import pytest
from django.core.management import call_command

from portal.core.exceptions import DomainError
from provisioning import services
from provisioning.backends.base import BackendError
from provisioning.backends.slurm import SlurmBackend
from provisioning.models import NodeDrain, VirtualCluster
from reservations.choices import HOLDING_STATUSES, NodeState
from reservations.models import Allocation, Node, Reservation
from reservations.services import node_update, reservation_cancel, reservation_update
from tests.conftest import make_world

from .conftest import book, now_slot, scontrol

pytestmark = [pytest.mark.slurm, pytest.mark.django_db]


def booked(world, who, start, **kwargs) -> Reservation:
    """Book, create the cluster (what the confirmed event does) and sync the booking to Slurm."""
    reservation = book(world, who, start, **kwargs)
    services.cluster_create_for_reservation(reservation_id=reservation.pk)
    assert services.reservation_sync(reservation_id=reservation.pk) == "booked"
    return reservation


def hosts(reservation) -> list[str]:
    return sorted(Allocation.objects.filter(reservation=reservation, active=True)
                  .values_list("node__hostname", flat=True))


def slurm_time(dt) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


@pytest.fixture
def fleet(db, slurm_backend):
    return make_world(nodes=6, max_nodes=6, burst_nodes=0)


def test_booking_extension_and_cancel_show_up_in_scontrol(fleet, t0, prov_slurm, slurm_backend):
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=2)
    name = f"alpha-{reservation.pk}"
    raw = scontrol(prov_slurm, "show", "reservation", name, "--oneliner")
    assert f"ReservationName={name} " in raw
    assert f"StartTime={slurm_time(t0)} " in raw and f"EndTime={slurm_time(t0 + timedelta(hours=2))} " in raw
    assert "Accounts=alpha " in raw
    assert sorted(slurm_backend.show_reservation(name).nodes) == hosts(reservation)

    reservation_update(actor=fleet.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=5))
    assert services.reservation_sync(reservation_id=reservation.pk) == "booked"
    assert f"EndTime={slurm_time(t0 + timedelta(hours=5))} " in scontrol(prov_slurm, "show", "reservation", name)

    reservation_cancel(actor=fleet.users["alpha-lead"], reservation=reservation)
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert name not in slurm_backend.show_reservations()
    assert name not in scontrol(prov_slurm, "show", "reservation")


def test_provisioning_on_slurm_reaches_ready(fleet, t0, slurm_backend):
    reservation = booked(fleet, "beta-lead", t0, hours=2, nodes=3)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert cluster.backend == "slurm"
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    cluster.refresh_from_db()
    assert cluster.connection["slurm_reservation"] == f"beta-{reservation.pk}"
    assert "sbatch --reservation=beta-" in cluster.connection["submit_hint"]
    assert cluster.transitions.get(phase="allocating_nodes").detail == \
        f"Slurm reservation beta-{reservation.pk} unchanged"  # booked at confirm time already
    assert "on 3 nodes (INACTIVE)" in cluster.transitions.get(phase="running_acceptance_tests").detail
    # The end: teardown deletes it.
    services.lifecycle_tick(now=t0 + timedelta(hours=2))
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert not slurm_backend.show_reservations()


def test_a_failed_node_is_drained_and_swapped_out_of_the_slurm_reservation(fleet, prov_slurm, slurm_backend):
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    name = f"alpha-{reservation.pk}"
    assert slurm_backend.show_reservation(name).active
    bad = Node.objects.get(hostname=hosts(reservation)[0])

    before = set(hosts(reservation))
    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.FAILED, reason="XID 79 fell off the bus")
    assert services.node_sync(node_id=bad.pk) == {"replaced": 1}
    [spare] = set(hosts(reservation)) - before
    # What our node.replaced subscriber enqueues:
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=bad.hostname, spare=spare) == \
        "replaced"
    raw = scontrol(prov_slurm, "show", "node", bad.hostname)
    assert "DRAIN" in raw and "Reason=portal: failed: XID 79 fell off the bus" in raw
    now_hosts = hosts(reservation)
    assert bad.hostname not in now_hosts
    assert sorted(slurm_backend.show_reservation(name).nodes) == now_hosts
    cluster.refresh_from_db()
    assert cluster.status == "ready"

    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.AVAILABLE, reason="")
    services.node_sync(node_id=bad.pk)
    assert not slurm_backend.show_node(bad.hostname).drained


def test_slurm_never_answers_overlap_for_what_the_portal_allocated(fleet, t0, slurm_backend, caplog):
    """Random bookings, moves, extensions and cancels, synced in a scrambled order.

    A stale Slurm reservation (moved or cancelled in the portal, not yet synced) can stand
    where a newer booking goes; the sync converges the stale one first instead of failing.
    """
    caplog.set_level("INFO", logger="provisioning.services")
    rng = random.Random(20260301)
    who = ["alpha-lead", "beta-lead"]
    pending: set[int] = set()
    outcomes: list[str] = []

    def sync_some(count: int) -> None:
        # Newest first: a new booking reaches Slurm before the older change that freed its nodes.
        for rid in sorted(pending, reverse=True)[:count]:
            outcomes.append(services.reservation_sync(reservation_id=rid))  # raises on a lasting overlap
            pending.discard(rid)

    for _step in range(45):
        op = rng.choice(["book", "book", "move", "extend", "cancel"])
        live = list(Reservation.objects.filter(status__in=HOLDING_STATUSES))
        try:
            if op == "book" or not live:
                start = t0 + timedelta(hours=rng.randrange(0, 4))
                reservation = book(fleet, rng.choice(who), start, hours=rng.randrange(1, 4),
                                   nodes=rng.randrange(1, 4))
                services.cluster_create_for_reservation(reservation_id=reservation.pk)
            else:
                reservation = rng.choice(live)
                actor = fleet.users[f"{reservation.tenant.slug}-lead"]
                if op == "cancel":
                    reservation_cancel(actor=actor, reservation=reservation)
                elif op == "move":
                    shift = timedelta(hours=rng.choice([-2, -1, 1, 2]))
                    reservation_update(actor=actor, reservation=reservation, start=reservation.start + shift,
                                       end=reservation.end + shift)
                else:
                    reservation_update(actor=actor, reservation=reservation,
                                       end=reservation.end + timedelta(hours=rng.choice([-1, 1, 2])))
        except DomainError:
            continue  # refused by the portal (capacity, quota, past): nothing changed
        pending.add(reservation.pk)
        if rng.random() < 0.3:
            sync_some(rng.randrange(1, 4))
    sync_some(len(pending))

    assert "booked" in outcomes and "released" in outcomes
    repairs = caplog.text.count("is in the way of")
    print(f"{len(outcomes)} syncs, {repairs} stale bookings converged first")
    assert repairs >= 1  # the scrambled order did put stale bookings in the way
    in_slurm = slurm_backend.show_reservations()
    holding = Reservation.objects.filter(status__in=HOLDING_STATUSES)
    assert set(in_slurm) == {f"{r.tenant.slug}-{r.pk}" for r in holding}
    for reservation in holding:
        res = in_slurm[f"{reservation.tenant.slug}-{reservation.pk}"]
        assert sorted(res.nodes) == hosts(reservation)
        assert (res.start, res.end) == (reservation.start, reservation.end)


def test_reconcile_finds_and_repairs_drift_both_ways(fleet, t0, slurm_backend, capsys):
    kept = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    lost = booked(fleet, "beta-lead", t0, hours=2, nodes=1)
    kept_name, lost_name = f"alpha-{kept.pk}", f"beta-{lost.pk}"
    free = sorted(set(n.hostname for n in fleet.nodes) - set(hosts(kept)) - set(hosts(lost)))
    # Drift made by hand in Slurm:
    slurm_backend.delete_reservation(lost_name)                               # a booking Slurm lost
    slurm_backend.update_reservation(kept_name, end=t0 + timedelta(hours=9))  # one it holds differently
    slurm_backend.create_reservation("alpha-99999", [free[0]], t0, t0 + timedelta(hours=1), accounts=["alpha"])
    slurm_backend.create_reservation("maint-window", [free[1]], t0, t0 + timedelta(hours=1), users=["root"])
    Node.objects.filter(hostname=free[2]).update(state=NodeState.FAILED)     # failed in the portal only
    slurm_backend.drain_node(free[3], "portal: stale drain")                # drained by us, now fine

    with pytest.raises(SystemExit) as exit_info:
        call_command("reconcile")
    assert exit_info.value.code == 1
    report = capsys.readouterr().out
    for expected in (f"slurm: missing {lost_name}", f"slurm: mismatch {kept_name}", "slurm: orphan alpha-99999",
                     f"slurm: node {free[2]}", f"slurm: node {free[3]}", "5 drifts, 0 repaired"):
        assert expected in report, report
    assert "maint-window" not in report  # an operator's reservation is none of our business

    call_command("reconcile", "--fix")
    assert "5 drifts, 5 repaired" in capsys.readouterr().out
    in_slurm = slurm_backend.show_reservations()
    assert set(in_slurm) == {kept_name, lost_name, "maint-window"}
    assert in_slurm[kept_name].end == t0 + timedelta(hours=2)
    assert sorted(in_slurm[lost_name].nodes) == hosts(lost)
    assert slurm_backend.show_node(free[2]).drained and not slurm_backend.show_node(free[3]).drained
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out


def test_a_multi_line_drain_reason_still_drains_the_node_and_moves_its_booking(fleet, slurm_backend):
    """Slurm takes one line of reason; an agent's or a staff member's line breaks used to crash the sync
    (ValueError), leaving the node undrained in Slurm and the booking on it (found in a backend review)."""
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=2)
    host = hosts(reservation)[0]
    bad = Node.objects.get(hostname=host)
    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.FAILED, reason="XID 79 on GPU 3\nRMA\topened")
    assert services.node_sync(node_id=bad.pk) == {"replaced": 1}
    info = slurm_backend.show_node(host)
    assert info.drained and "XID 79 on GPU 3 RMA opened" in info.reason


def test_reconcile_leaves_an_operators_own_reservation_alone(fleet, t0, slurm_backend):
    """Named like ours (<word>-<number> for account <word>) but <word> is no tenant: the operator's."""
    slurm_backend.create_reservation("maint-2026", ["h100-006"], t0, t0 + timedelta(hours=4), accounts=["maint"])
    drifts = services.reconcile(fix=True, backend_name="slurm")
    assert "maint-2026" in slurm_backend.show_reservations(), drifts
    assert not [d for d in drifts if d["name"] == "maint-2026"]


def test_reconcile_fix_reports_a_refused_repair_and_goes_on(fleet, t0, slurm_backend, capsys):
    """One repair Slurm refuses (an operator's reservation now stands where a lost booking goes) aborted the
    whole run as 'backend unreachable': the orphan already deleted went unreported and the node drift after
    it was never looked at."""
    lost = booked(fleet, "beta-lead", t0, hours=2, nodes=1)
    lost_name = f"beta-{lost.pk}"
    [host] = hosts(lost)
    free = sorted({n.hostname for n in fleet.nodes} - {host})
    slurm_backend.delete_reservation(lost_name)
    slurm_backend.create_reservation("maint-window", [host], t0, t0 + timedelta(hours=1), users=["root"])
    slurm_backend.create_reservation("alpha-99999", [free[0]], t0, t0 + timedelta(hours=1), accounts=["alpha"])
    Node.objects.filter(hostname=free[1]).update(state=NodeState.FAILED)

    with pytest.raises(SystemExit) as exit_info:
        call_command("reconcile", "--fix")
    assert exit_info.value.code == 1
    report = capsys.readouterr().out
    assert f"slurm: missing {lost_name}: Slurm has no reservation for this booking; repair failed: Slurm: " in report
    assert "overlaps with another reservation" in report
    assert "slurm: orphan alpha-99999" in report and f"slurm: node {free[1]}" in report
    assert "3 drifts, 2 repaired" in report, report
    assert set(slurm_backend.show_reservations()) == {"maint-window"}
    assert slurm_backend.show_node(free[1]).drained


def test_reconcile_fix_with_a_controller_that_stops_answering_reports_instead_of_crashing(
        fleet, t0, slurm_backend, prov_slurm, settings, tmp_path, capsys):
    """slurmctld answered the reads and then went away: the orphan's delete raised a bare SlurmUnavailable
    (not a BackendError), and `reconcile --fix` died with a traceback."""
    kept = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    free = sorted({n.hostname for n in fleet.nodes} - set(hosts(kept)))
    slurm_backend.create_reservation("alpha-99999", [free[0]], t0, t0 + timedelta(hours=1), accounts=["alpha"])
    wrapper = tmp_path / "scontrol"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" delete "*|*" update "*|*" create "*)\n'
        '  echo "slurm_delete_reservation error: Unable to contact slurm controller (connect failure)" >&2\n'
        "  exit 1;;\n"
        "esac\n"
        'exec scontrol "$@"\n')
    wrapper.chmod(0o755)
    settings.PORTAL_SCONTROL = str(wrapper)

    with pytest.raises(SystemExit):
        call_command("reconcile", "--fix")
    report = capsys.readouterr().out
    assert "slurm: orphan alpha-99999: " in report
    assert "repair failed: Slurm: slurm_delete_reservation error: Unable to contact slurm controller" in report
    assert "1 drift, 0 repaired" in report, report
    assert "alpha-99999" in slurm_backend.show_reservations()


def test_reconcile_finds_a_slurm_reservation_moved_or_given_to_another_account(fleet, t0, slurm_backend, capsys):
    """Only the node set and the end were compared: a reservation whose start Slurm holds later than the
    booking (the tenant's first hours unusable), or held for another account (the tenant's jobs refused),
    was 'no drift' for ever."""
    moved = booked(fleet, "alpha-lead", t0, hours=3, nodes=1)
    taken = booked(fleet, "beta-lead", t0, hours=3, nodes=1)
    moved_name, taken_name = f"alpha-{moved.pk}", f"beta-{taken.pk}"
    slurm_backend.update_reservation(moved_name, start=t0 + timedelta(hours=1), end=t0 + timedelta(hours=3))
    slurm_backend.update_reservation(taken_name, accounts=["alpha"])
    booked(fleet, "alpha-lead", now_slot(fleet), hours=2, nodes=1)  # began before Slurm's start: no drift

    with pytest.raises(SystemExit):
        call_command("reconcile")
    report = capsys.readouterr().out
    assert f"slurm: mismatch {moved_name}" in report and f"slurm: mismatch {taken_name}" in report, report
    assert "2 drifts, 0 repaired" in report

    call_command("reconcile", "--fix")
    assert "2 drifts, 2 repaired" in capsys.readouterr().out
    in_slurm = slurm_backend.show_reservations()
    assert (in_slurm[moved_name].start, in_slurm[moved_name].end) == (t0, t0 + timedelta(hours=3))
    assert in_slurm[taken_name].accounts == {"beta"}
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out


def test_reconcile_reports_a_node_slurm_drained_itself_while_the_portal_books_it(fleet, slurm_backend, capsys):
    """Slurm (or an operator, or a node health check) drained a node the portal holds available: the portal
    keeps booking it and the tenant's jobs never start there, yet reconcile said nothing (it only looked at
    drains with the portal's reason). It is reported, and left alone: not the portal's drain to resume."""
    host = fleet.nodes[0].hostname
    slurm_backend.drain_node(host, "Kill task failed")

    with pytest.raises(SystemExit):
        call_command("reconcile", "--fix")
    report = capsys.readouterr().out
    assert f"slurm: node {host}: portal says available, Slurm drained it (Kill task failed)" in report, report
    assert "1 drift, 0 repaired" in report
    assert slurm_backend.show_node(host).drained


def test_reconcile_fix_never_deletes_a_booking_made_while_it_runs(fleet, t0, slurm_backend, monkeypatch):
    """reconcile reads the live bookings, then Slurm: one booked (and synced) in between is in Slurm but not in
    what was read first, and --fix deleted it as an orphan. It is asked about again before it is called one."""
    from provisioning.backends.slurm_client import SlurmClient

    stale = booked(fleet, "beta-lead", t0, hours=2, nodes=1)
    reservation_cancel(actor=fleet.users["beta-lead"], reservation=stale)
    orphan = f"beta-{stale.pk}"  # a cancelled booking's reservation whose delete was lost: a real orphan
    if orphan not in slurm_backend.show_reservations():
        slurm_backend.create_reservation(orphan, hosts(stale) or [fleet.nodes[0].hostname], t0 + timedelta(hours=20),
                                         t0 + timedelta(hours=21), accounts=["beta"])
    real = SlurmClient.show_reservations
    made: list[Reservation] = []

    def booked_meanwhile(self):
        if not made:
            made.append(None)  # once: booking syncs to Slurm, which reads the reservations too
            made[0] = booked(fleet, "alpha-lead", t0 + timedelta(hours=5), hours=2, nodes=1)
        return real(self)

    monkeypatch.setattr(SlurmClient, "show_reservations", booked_meanwhile)
    drifts = services.reconcile(fix=True, backend_name="slurm")
    late = made[0]
    in_slurm = real(slurm_backend)
    assert f"alpha-{late.pk}" in in_slurm, drifts
    assert not [d for d in drifts if d["name"] == f"alpha-{late.pk}"]
    assert orphan not in in_slurm  # the real orphan still goes
    assert [d["kind"] for d in drifts if d["name"] == orphan] == ["orphan"]


def test_a_booking_left_with_no_nodes_lets_go_of_its_slurm_reservation_and_is_no_alert(fleet, slurm_backend, capsys):
    """Every node of a booking failed with no spare free. Its Slurm reservation stayed on the failed node
    (whose jobs Slurm would start for the tenant again once the node is resumed, while the portal gives it
    to others), and reconcile reported it every run as drift whose repair failed ("a reservation needs at
    least one node"): exit 1, an alert for nothing anyone can fix. Slurm has no empty reservation: a
    booking that holds no node has none, which is no drift; one left behind is removed by --fix."""
    start = now_slot(fleet)
    reservation = booked(fleet, "alpha-lead", start, hours=3, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    name = f"alpha-{reservation.pk}"
    [host] = hosts(reservation)
    booked(fleet, "beta-lead", start, hours=3, nodes=5)  # no spare free
    bad = Node.objects.get(hostname=host)
    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.FAILED, reason="XID 79")
    assert services.node_sync(node_id=bad.pk) == {"degraded": 1}
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed=host, spare=None) == "degraded"
    assert name not in slurm_backend.show_reservations()
    call_command("reconcile")  # exit 0: no SystemExit
    assert "0 drifts" in capsys.readouterr().out

    # One left behind (its sync was lost) is no "repair failed" for ever: --fix lets go of it.
    slurm_backend.create_reservation(name, [host], start, reservation.period.upper, accounts=["alpha"])
    with pytest.raises(SystemExit):
        call_command("reconcile")
    assert f"slurm: mismatch {name}: the booking holds no nodes (failed, no spare free); Slurm holds {host}" in \
        capsys.readouterr().out
    call_command("reconcile", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert name not in slurm_backend.show_reservations()
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out


def test_reconcile_finds_and_repairs_a_partition_changed_by_hand(fleet, t0, prov_slurm, slurm_backend, capsys):
    """Reconcile compared the reservations only: the partition the tenants' jobs run in, set DOWN or stripped
    of a booked node by hand (its jobs pend in the reservation for ever), was no drift."""
    from .conftest import SLURM_NODES

    held = booked(fleet, "alpha-lead", t0, hours=2, nodes=2)
    first, second = hosts(held)
    try:
        kept = [n for n in SLURM_NODES if n != second]
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(kept)}", "State=DOWN")
        with pytest.raises(SystemExit):
            call_command("reconcile")
        report = capsys.readouterr().out
        assert f"slurm: mismatch partition gpu: lacks booked node {second}: " in report, report
        assert "slurm: mismatch partition gpu: is DOWN: no tenant job starts" in report
        assert "2 drifts, 0 repaired" in report

        call_command("reconcile", "--fix")
        assert "2 drifts, 2 repaired" in capsys.readouterr().out
        raw = scontrol(prov_slurm, "show", "partition", "gpu", "--oneliner")
        assert "State=UP " in raw and "TotalNodes=6 " in raw, raw
        call_command("reconcile")
        assert "0 drifts" in capsys.readouterr().out
    finally:
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(SLURM_NODES)}", "State=UP")


def test_reconcile_names_the_booked_nodes_a_partition_lacks_in_the_plural(fleet, t0, prov_slurm, slurm_backend,
                                                                          capsys):
    """The report said "lacks booked node(s)" whatever the count."""
    from .conftest import SLURM_NODES

    held = booked(fleet, "alpha-lead", t0, hours=2, nodes=2)
    booked_hosts = hosts(held)
    try:
        kept = [n for n in SLURM_NODES if n not in booked_hosts]
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(kept)}")
        with pytest.raises(SystemExit):
            call_command("reconcile")
        report = capsys.readouterr().out
        assert f"slurm: mismatch partition gpu: lacks booked nodes {','.join(booked_hosts)}: " in report, report
    finally:
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(SLURM_NODES)}", "State=UP")


def test_reconcile_finds_a_reservation_moved_to_another_partition(fleet, t0, prov_slurm, slurm_backend, settings,
                                                                   capsys):
    from .conftest import SLURM_NODES

    settings.PORTAL_SLURM_PARTITION = "gpu"
    held = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{held.pk}"
    assert slurm_backend.show_reservation(name).partition == "gpu"
    try:
        assert scontrol(prov_slurm, "create", "PartitionName=side", f"Nodes={','.join(SLURM_NODES)}") == ""
        scontrol(prov_slurm, "update", f"ReservationName={name}", "PartitionName=side")
        assert slurm_backend.show_reservation(name).partition == "side"
        with pytest.raises(SystemExit):
            call_command("reconcile")
        assert f"slurm: mismatch {name}: " in capsys.readouterr().out
        call_command("reconcile", "--fix")
        assert "1 drift, 1 repaired" in capsys.readouterr().out
        assert slurm_backend.show_reservation(name).partition == "gpu"
    finally:
        scontrol(prov_slurm, "delete", "PartitionName=side")


def test_a_node_swap_that_arrives_after_the_cluster_failed_books_nothing_again(fleet, slurm_backend, settings):
    """A node of a booking being provisioned failed (moved to a spare); its swap task waits while the
    provisioning run holds the cluster, and that run failed for good: the reservation failed, its nodes went
    back to others and the cleanup deleted its Slurm reservation. The swap then ran on the failed cluster and
    booked the window in Slurm again (on the nodes the failed booking had released), where it stayed,
    blocking those nodes for other accounts, until its end or a reconcile --fix."""
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=2)
    name = f"alpha-{reservation.pk}"
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    before = set(hosts(reservation))
    bad = Node.objects.get(hostname=sorted(before)[0])
    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.FAILED, reason="XID 79")
    assert services.node_sync(node_id=bad.pk) == {"replaced": 1}
    [spare] = set(hosts(reservation)) - before

    settings.PORTAL_PROVISIONING_FAULTS = "installing_drivers=fatal"
    assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    assert name not in slurm_backend.show_reservations()  # the cleanup let go of it

    services.cluster_nodes_changed(reservation_id=reservation.pk, failed=bad.hostname, spare=spare)
    assert name not in slurm_backend.show_reservations()


def test_reconcile_fix_that_gives_slurm_a_refused_window_makes_the_degraded_cluster_whole(
        fleet, slurm_backend, captured_events, monkeypatch, capsys, django_capture_on_commit_callbacks):
    """A running cluster degraded because Slurm refused its booking's new end says "reconcile --fix once the cause
    is cleared". That fix did put the new end into Slurm, but the cluster stayed degraded (and the alert on
    degraded clusters firing) until the booking ended: only a sync that Slurm took made it whole again. The
    repair is such a sync: the cluster is ready again, and the team hears it is back to normal."""
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    name = f"alpha-{reservation.pk}"
    old_end = reservation.period.upper
    new_end = old_end + timedelta(hours=2)
    reservation_update(actor=fleet.users["alpha-lead"], reservation=reservation, end=new_end)

    def refuse(self, ctx):
        raise BackendError("Slurm: Requested reservation is invalid (held by maint-7)", transient=False)

    monkeypatch.setattr(SlurmBackend, "update_window", refuse)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "refused"
    monkeypatch.undo()
    cluster.refresh_from_db()
    assert cluster.status == "degraded" and "reconcile --fix" in cluster.status_reason
    assert slurm_backend.show_reservation(name).end == old_end

    with django_capture_on_commit_callbacks(execute=True):
        call_command("reconcile", "--fix")
    assert f"slurm: mismatch {name}" in capsys.readouterr().out
    assert slurm_backend.show_reservation(name).end == new_end
    cluster.refresh_from_db()
    assert cluster.status == "ready" and cluster.status_reason == "the backend holds the window again"
    recovered = [payload for event, payload in captured_events if event == "cluster.ready" and payload.get("recovered")]
    assert len(recovered) == 1 and recovered[0]["cluster_id"] == cluster.pk

    # Reconciling again finds nothing and changes nothing.
    transitions = cluster.transitions.count()
    call_command("reconcile", "--fix")
    assert "0 drifts" in capsys.readouterr().out
    assert cluster.transitions.count() == transitions


def test_reconcile_fix_leaves_a_cluster_degraded_for_a_lost_node_degraded(fleet, slurm_backend):
    """The repair gives Slurm the booking's window; a cluster short of a node stays degraded all the same."""
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    services._degrade(cluster.pk, "alpha node failed and no spare node is free (1 missing)", hosts(reservation)[0])
    slurm_backend.update_reservation(f"alpha-{reservation.pk}", end=reservation.period.upper + timedelta(hours=4))
    call_command("reconcile", "--fix")
    cluster.refresh_from_db()
    assert cluster.status == "degraded"


def test_a_node_named_so_slurm_cannot_have_it_neither_crashes_its_sync_nor_reconcile(fleet, t0, slurm_backend,
                                                                                     capsys):
    """The admin takes any hostname ("gpu node 7", a typo with a space); Slurm has no node by such a name. The
    client refuses it before running scontrol (ValueError), and the backend let that escape where it looks nodes
    up: the failed node's sync crashed before its bookings were moved, and reconcile died with a traceback
    instead of reporting, for every backend. Such a node is one Slurm does not know, as a Kubernetes node is."""
    held = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    odd = Node.objects.create(hostname="gpu node 7", pool=fleet.pool, state=NodeState.FAILED)
    assert services.node_sync(node_id=odd.pk) == {}
    call_command("reconcile")  # exit 0: no SystemExit, no traceback
    assert "0 drifts" in capsys.readouterr().out

    # Booked on it (written straight to the database, as the admin could): reported and its repair refused,
    # the run goes on instead of dying with a traceback.
    Allocation.objects.filter(reservation=held).update(node=odd)
    Node.objects.filter(pk=odd.pk).update(state=NodeState.AVAILABLE)
    with pytest.raises(SystemExit):
        call_command("reconcile", "--fix")
    report = capsys.readouterr().out
    assert "slurm: mismatch partition gpu: lacks booked node gpu node 7" in report, report
    assert "repair failed: Slurm does not know node gpu node 7" in report, report


def test_a_booking_on_a_node_slurm_does_not_know_names_that_node(fleet, t0, slurm_backend, caplog):
    """Slurm answers "Invalid node name specified" and names no node: the refusal said "Slurm does not know a
    node" and left the operator to find which of the booking's nodes (here one of six) by hand."""
    Node.objects.filter(hostname="h100-004").update(hostname="h100-042")
    reservation = book(fleet, "alpha-lead", t0, hours=2, nodes=6)
    services.cluster_create_for_reservation(reservation_id=reservation.pk)

    with caplog.at_level("ERROR", logger="provisioning"):
        assert services.reservation_sync(reservation_id=reservation.pk) == "refused"
    assert "Slurm does not know node h100-042: Error creating the reservation: Invalid node name specified" \
        in caplog.text, caplog.text
    assert f"alpha-{reservation.pk}" not in slurm_backend.show_reservations()


def test_partition_repair_adds_the_booked_nodes_slurm_knows_and_names_those_it_does_not(
        fleet, t0, prov_slurm, slurm_backend, capsys):
    """The repair put every lacking node into one `update PartitionName=… Nodes=…`: one booked node Slurm does
    not know (renamed in the portal, not yet in slurm.conf) made Slurm refuse it whole ("Invalid node name
    specified", naming none), so the known node taken out by hand stayed out of the partition too."""
    from .conftest import SLURM_NODES

    first = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    second = booked(fleet, "beta-lead", t0, hours=2, nodes=1)
    [known] = hosts(first)
    [renamed] = hosts(second)
    Node.objects.filter(hostname=renamed).update(hostname="h100-042")
    try:
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(n for n in SLURM_NODES if n != known)}")
        with pytest.raises(SystemExit):
            call_command("reconcile", "--fix")
        report = capsys.readouterr().out
        assert (f"slurm: mismatch partition gpu: lacks booked nodes {','.join(sorted([known, 'h100-042']))}: the "
                "tenants' jobs never run there; repair failed: Slurm does not know node h100-042") in report, report
        assert known in slurm_backend.show_partitions()["gpu"].nodes
    finally:
        scontrol(prov_slurm, "update", "PartitionName=gpu", f"Nodes={','.join(SLURM_NODES)}", "State=UP")


def test_a_partition_slurm_does_not_have_refuses_the_booking_once_and_says_so(fleet, t0, slurm_backend, settings,
                                                                              caplog):
    """PORTAL_SLURM_PARTITION naming a partition Slurm lacks (a typo, a partition removed) made every booking's
    sync fail as if the controller were down ("Invalid partition name specified", transient): each was retried
    with backoff until its retries ran out, for a setting no retry changes."""
    settings.PORTAL_SLURM_PARTITION = "gpu-typo"
    reservation = book(fleet, "alpha-lead", t0, hours=2, nodes=1)
    services.cluster_create_for_reservation(reservation_id=reservation.pk)

    with caplog.at_level("ERROR", logger="provisioning"):
        assert services.reservation_sync(reservation_id=reservation.pk) == "refused"
    assert "Slurm has no partition gpu-typo (PORTAL_SLURM_PARTITION): " in caplog.text, caplog.text
    assert f"alpha-{reservation.pk}" not in slurm_backend.show_reservations()


def test_reconcile_nodes_reads_every_node_with_one_scontrol_call(fleet, prov_slurm, slurm_backend):
    """reconcile_nodes ran one `scontrol show node` per portal node: a 1,000-node fleet cost 1,000 subprocesses and
    1,000 RPCs to slurmctld on every reconcile. It reads them all at once, and finds the same drifts."""
    backend = SlurmBackend(client=prov_slurm.client())
    calls = []
    run = backend.client._run

    def counting(args):
        calls.append(tuple(args))
        return run(args)

    backend.client._run = counting
    fleet_hosts = sorted(n.hostname for n in fleet.nodes)
    slurm_backend.drain_node(fleet_hosts[0], "portal: stale drain Users=x State=IDLE")
    slurm_backend.drain_node(fleet_hosts[1], "Kill task failed State=DOWN")
    states = {host: "available" for host in fleet_hosts} | {fleet_hosts[2]: "failed", fleet_hosts[3]: "maintenance",
                                                            "h100-999": "available", "gpu node 7": "failed"}

    drifts = backend.reconcile_nodes(states, fix=False)

    assert len(calls) == 1, calls
    assert [(d.name, d.detail) for d in drifts] == [
        (fleet_hosts[0], "portal says available, Slurm drained it for us"),
        (fleet_hosts[1], "portal says available, Slurm drained it (Kill task failed State=DOWN): set the node's "
                         "state in the portal or resume it in Slurm"),
        (fleet_hosts[2], "portal says failed, Slurm says IDLE+NOT_RESPONDING"),
        (fleet_hosts[3], "portal says maintenance, Slurm says IDLE+NOT_RESPONDING"),
    ]
    calls.clear()
    assert backend.reconcile_nodes({fleet_hosts[2]: "failed"}, fix=False)[0].name == fleet_hosts[2]
    assert len(calls) == 1, calls


def test_reconcile_reports_users_an_operator_added_to_a_portal_reservation_before_removing_them(
        fleet, t0, slurm_backend, capsys):
    """The portal owns its <tenant>-<id> reservations (Accounts=<tenant>, no Users=). Users= added by hand let those
    users run in the tenant's window; reconcile said nothing of it, and the next sync of the booking (an extension,
    a node swap) removed them silently. Reconcile reports it as a mismatch, and only --fix removes them."""
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{reservation.pk}"
    slurm_backend.update_reservation(name, users=["root"])
    assert slurm_backend.show_reservation(name).users == {"root"}

    with pytest.raises(SystemExit) as exit_info:
        call_command("reconcile")
    assert exit_info.value.code == 1
    report = capsys.readouterr().out
    assert f"slurm: mismatch {name}: " in report and "for alpha and users root" in report, report
    assert "1 drift, 0 repaired" in report, report
    assert slurm_backend.show_reservation(name).users == {"root"}  # reported, not touched

    call_command("reconcile", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    repaired = slurm_backend.show_reservation(name)
    assert (repaired.users, repaired.accounts) == (frozenset(), {"alpha"})
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out


def sbatch(cluster, *args: str) -> str:
    """Submit a job as a tenant would (sbatch --reservation=… --account=…); return its id."""
    env = {**os.environ, **cluster.env, "LC_ALL": "C"}
    proc = subprocess.run(["sbatch", "--parsable", *args, "--wrap=sleep 600"], env=env, capture_output=True,
                          text=True, timeout=30, check=True)
    return proc.stdout.strip().split(";")[0]


@pytest.mark.parametrize("how", ["cancel", "end"])
def test_a_booking_with_the_teams_jobs_queued_in_its_reservation_is_torn_down(fleet, t0, prov_slurm, slurm_backend,
                                                                                how):
    """Slurm refuses to delete a reservation any job names ("Requested reservation is in use"), even a job that
    only waits for the window: a team that queued work and then cancelled its booking (or left jobs queued at
    its end) had its teardown fail on every try and its nodes put in maintenance. The team's jobs go with it."""
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=2)
    name = f"alpha-{reservation.pk}"
    jobs = [sbatch(prov_slurm, f"--reservation={name}", "--account=alpha", "-N1") for _ in range(2)]
    cluster = VirtualCluster.objects.get(reservation=reservation)
    try:
        if how == "cancel":
            reservation_cancel(actor=fleet.users["alpha-lead"], reservation=reservation)
        else:
            services.lifecycle_tick(now=t0 - timedelta(minutes=10))
            assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
            services.lifecycle_tick(now=t0 + timedelta(hours=2))
        assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
        assert name not in slurm_backend.show_reservations()
        queue = scontrol(prov_slurm, "show", "job", *jobs[:1])
        assert "JobState=CANCELLED" in queue or "Invalid job id" in queue, queue
        assert not Node.objects.filter(state=NodeState.MAINTENANCE).exists()
        # A teardown run again (a worker that died after the delete) changes nothing and does not fail.
        assert slurm_backend.delete_reservation(name, missing_ok=True) is None
        assert SlurmBackend(client=slurm_backend).teardown(services.build_context(cluster.pk))
    finally:
        env = {**os.environ, **prov_slurm.env}
        subprocess.run(["scancel", *jobs], env=env, check=False, timeout=30)


def _delete_refused_while_a_job_ends(tmp_path, settings):
    """Point the backend at a wrapper around scontrol that answers a delete as Slurm does while a job in the
    reservation is still ending, for as long as the returned file exists (the test controller runs no slurmd)."""
    ending = tmp_path / "job-ending"
    ending.touch()
    wrapper = tmp_path / "scontrol"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ -e {ending} ] && [ "$1" = delete ]; then\n'
        '  echo " delete_reservation $2: Requested reservation is in use" >&2\n'
        "  exit 1\n"
        "fi\n"
        'exec scontrol "$@"\n')
    wrapper.chmod(0o755)
    settings.PORTAL_SCONTROL = str(wrapper)
    return ending


def test_a_teardown_whose_cancelled_jobs_are_still_ending_is_in_progress_not_failed(fleet, t0, prov_slurm,
                                                                                    slurm_backend, settings, tmp_path):
    """A running job cancelled at the end of its booking takes a moment to end (COMPLETING), and Slurm keeps
    refusing the delete until it has: the teardown is in progress and polled again, not an attempt that fails
    (five of them failed the teardown for good and put the nodes in maintenance). The test controller runs no
    slurmd, so no job runs: Slurm's refusal while one ends is written by a wrapper around scontrol."""
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{reservation.pk}"
    ending = _delete_refused_while_a_job_ends(tmp_path, settings)
    reservation_cancel(actor=fleet.users["alpha-lead"], reservation=reservation)
    cluster = VirtualCluster.objects.get(reservation=reservation)

    for _ in range(int(settings.PORTAL_PROVISIONING_MAX_ATTEMPTS) + 2):
        with pytest.raises(services.RetryLater, match="teardown in progress"):
            services.cluster_teardown(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "tearing_down" and cluster.attempts == 0
    assert not Node.objects.filter(state=NodeState.MAINTENANCE).exists()

    ending.unlink()  # the job has ended
    assert services.cluster_teardown(cluster_id=cluster.pk) == "deleted"
    assert name not in slurm_backend.show_reservations()


def test_a_cancelled_booking_whose_jobs_are_still_ending_is_released_once_they_have(fleet, t0, slurm_backend, settings,
                                                                                     tmp_path):
    """The booking's sync after a cancel (its cluster never started) took "still ending" as released: the
    reservation stayed in Slurm, holding the nodes the portal hands to the next booking. It is tried again."""
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{reservation.pk}"
    ending = _delete_refused_while_a_job_ends(tmp_path, settings)
    reservation_cancel(actor=fleet.users["alpha-lead"], reservation=reservation)

    with pytest.raises(services.RetryLater, match=f"jobs of {name} still ending"):
        services.reservation_sync(reservation_id=reservation.pk)
    assert name in slurm_backend.show_reservations()

    ending.unlink()
    assert services.reservation_sync(reservation_id=reservation.pk) == "released"
    assert name not in slurm_backend.show_reservations()


def test_a_live_booking_left_with_no_node_keeps_the_teams_jobs(fleet, t0, prov_slurm, slurm_backend):
    """A booking whose every node failed (no spare free) holds no Slurm reservation, but its removal cancelled
    the team's jobs in it (scancel --reservation, meant for a booking cancelled or at its end): the work the
    team queued, and any still running on the failed node, which the drain lets finish, were killed while
    the booking still ran and could get a spare back. The reservation stays while jobs name it (tried again,
    a transient error), and the jobs stay too."""
    import dataclasses

    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{reservation.pk}"
    job = sbatch(prov_slurm, f"--reservation={name}", "--account=alpha", "-N1")
    cluster = VirtualCluster.objects.get(reservation=reservation)
    try:
        ctx = dataclasses.replace(services.build_context(cluster.pk), nodes=())
        with pytest.raises(BackendError) as refused:
            SlurmBackend(client=slurm_backend).update_window(ctx)
        assert refused.value.transient and "jobs" in refused.value.message
        assert name in slurm_backend.show_reservations()
        assert "JobState=PENDING" in scontrol(prov_slurm, "show", "job", job)
    finally:
        subprocess.run(["scancel", job], env={**os.environ, **prov_slurm.env}, check=False, timeout=30)


def test_groups_an_operator_set_on_a_portal_reservation_are_reported_and_removed(fleet, t0, prov_slurm,
                                                                                 slurm_backend, capsys):
    """Groups= set by hand on a <tenant>-<id> reservation narrows who of the tenant's account may use it (Slurm
    wants the account and the group): the team's own jobs were refused ("Access denied to requested
    reservation") while reconcile reported nothing and --fix, or the booking's next sync, left it there."""
    reservation = booked(fleet, "alpha-lead", t0, hours=2, nodes=1)
    name = f"alpha-{reservation.pk}"
    assert "Reservation updated" in scontrol(prov_slurm, "update", f"ReservationName={name}", "Groups=nogroup")
    with pytest.raises(subprocess.CalledProcessError):
        sbatch(prov_slurm, f"--reservation={name}", "--account=alpha", "-N1")  # root is not in nogroup

    with pytest.raises(SystemExit):
        call_command("reconcile")
    report = capsys.readouterr().out
    assert f"slurm: mismatch {name}: " in report and "for alpha and groups nogroup" in report, report
    assert "Groups=nogroup " in scontrol(prov_slurm, "show", "reservation", name, "--oneliner")  # reported only

    call_command("reconcile", "--fix")
    assert "1 drift, 1 repaired" in capsys.readouterr().out
    assert "Groups=(null) " in scontrol(prov_slurm, "show", "reservation", name, "--oneliner")
    job = sbatch(prov_slurm, f"--reservation={name}", "--account=alpha", "-N1")
    subprocess.run(["scancel", job], env={**os.environ, **prov_slurm.env}, check=False, timeout=30)
    call_command("reconcile")
    assert "0 drifts" in capsys.readouterr().out
    # The booking's own sync (an extension, a swap) puts it back as well, and says so.
    scontrol(prov_slurm, "update", f"ReservationName={name}", "Groups=nogroup")
    assert services.reservation_sync(reservation_id=reservation.pk) == "booked"
    assert "Groups=(null) " in scontrol(prov_slurm, "show", "reservation", name, "--oneliner")


def test_a_failed_node_with_the_teams_jobs_still_running_is_a_drain_not_finished(fleet, prov_slurm, slurm_backend,
                                                                                  settings, tmp_path, capsys):
    """Slurm's DRAIN stops new jobs but lets the running ones finish (the node shows MIXED+DRAIN, ALLOCATED+DRAIN
    or +COMPLETING until they end). The backend took the drain as done at once, so the node counted as emptied
    (no NodeDrain, no PortalNodeDrainStuck) while the team's jobs still ran on it. Now the drain is unfinished
    until Slurm shows the node idle, and names the node for `squeue -w`.

    The test controller runs no slurmd, so no job can run: Slurm's answer for a node still running jobs is
    written by a wrapper around scontrol (the drain itself is real)."""
    reservation = booked(fleet, "alpha-lead", now_slot(fleet), hours=3, nodes=2)
    bad = Node.objects.get(hostname=hosts(reservation)[0])
    busy = tmp_path / "jobs-running"
    busy.touch()
    wrapper = tmp_path / "scontrol"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ -e {busy} ] && [ "$1" = show ] && [ "$2" = node ]; then\n'
        '  scontrol "$@" | sed "s/State=IDLE+DRAIN/State=MIXED+DRAIN/"\n'
        "  exit 0\n"
        "fi\n"
        'exec scontrol "$@"\n')
    wrapper.chmod(0o755)
    settings.PORTAL_SCONTROL = str(wrapper)

    node_update(actor=fleet.users["staff"], node=bad, state=NodeState.FAILED, reason="XID 79")
    for _ in range(2):  # a drain tried again while the jobs run is still unfinished (and drains nothing twice)
        with pytest.raises(services.RetryLater):
            services.node_sync(node_id=bad.pk)
        drain = NodeDrain.objects.get(node=bad)
        assert f"slurm: node {bad.hostname}: Slurm jobs still running on it (MIXED+DRAIN" in drain.last_error
        assert f"squeue -w {bad.hostname}" in drain.last_error
    assert "Reason=portal: failed: XID 79" in scontrol(prov_slurm, "show", "node", bad.hostname)
    assert bad.hostname not in hosts(reservation)  # the booking moved to a spare meanwhile
    with pytest.raises(SystemExit):
        call_command("reconcile")
    assert f"slurm: node {bad.hostname}: portal says failed, Slurm jobs still running on it (MIXED+DRAIN" \
        in capsys.readouterr().out

    busy.unlink()  # the jobs ended
    services.node_sync(node_id=bad.pk)
    assert not NodeDrain.objects.filter(node=bad).exists()
    with contextlib.suppress(SystemExit):  # the booking's swap, not synced here, is drift of its own
        call_command("reconcile")
    assert f"node {bad.hostname}" not in capsys.readouterr().out
