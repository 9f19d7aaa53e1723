"""Node drain and resume on a real slurmctld."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from provisioning.backends.slurm_client import NodeNotFound, SlurmClient
from tests.slurm.conftest import NODES

pytestmark = pytest.mark.slurm


def test_nodes_start_idle_in_the_gpu_partition(slurm: SlurmClient) -> None:
    node = slurm.show_node("h100-sxm-001")

    assert node.base_state == "IDLE"
    assert not node.drained
    assert node.partitions == ("gpu",)


def test_drain_then_resume(slurm: SlurmClient, scontrol) -> None:
    reason = "health: gpu 3 xid=79 fell off the bus"

    drained = slurm.drain_node("h100-sxm-007", reason)

    assert drained == slurm.show_node("h100-sxm-007")
    assert "DRAIN" in drained.state.split("+")
    assert drained.reason == reason
    raw = scontrol("show", "node", "h100-sxm-007")
    assert "DRAIN" in raw
    assert f"Reason={reason} [" in raw

    resumed = slurm.resume_node("h100-sxm-007")

    assert resumed == slurm.show_node("h100-sxm-007")
    assert resumed.base_state == "IDLE"
    assert not resumed.drained
    assert resumed.reason is None
    assert "DRAIN" not in scontrol("show", "node", "h100-sxm-007")


def test_drain_keeps_reservations(slurm: SlurmClient) -> None:
    start = datetime(2030, 6, 1, tzinfo=UTC)
    slurm.create_reservation("research-80", ["h100-sxm-008"], start, start + timedelta(days=1), accounts=["research"])

    slurm.drain_node("h100-sxm-008", "maintenance")

    assert slurm.show_node("h100-sxm-008").drained
    assert slurm.show_reservation("research-80").nodes == ("h100-sxm-008",)


def test_unknown_node(slurm: SlurmClient) -> None:
    with pytest.raises(NodeNotFound, match="not found"):
        slurm.show_node("h100-sxm-999")
    with pytest.raises(NodeNotFound):
        slurm.drain_node("h100-sxm-999", "test")


def test_show_nodes_reads_every_node_at_once_as_show_node_does(slurm: SlurmClient) -> None:
    reason = "operator: gpu node 7 State=IDLE Users=x xid=79 fell off"
    slurm.drain_node("h100-sxm-003", reason)

    nodes = slurm.show_nodes()

    assert sorted(nodes) == NODES
    assert nodes == {node: slurm.show_node(node) for node in NODES}
    assert nodes["h100-sxm-003"].reason == reason and nodes["h100-sxm-003"].drained
    assert nodes["h100-sxm-003"].state == "IDLE+DRAIN+NOT_RESPONDING"
    assert [n.name for n in nodes.values() if n.drained] == ["h100-sxm-003"]
