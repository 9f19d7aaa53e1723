"""The test-cluster launcher itself: isolation, clean shutdown, clear failure."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioning.slurm_testing import SlurmBinariesMissing, SlurmTestCluster

pytestmark = pytest.mark.slurm


def test_missing_binaries_fail_with_install_hint(tmp_path: Path) -> None:
    empty_path = tmp_path / "bin"
    empty_path.mkdir()

    with pytest.raises(SlurmBinariesMissing, match=r"slurmctld, scontrol, munged not found.*install-slurm\.sh"):
        SlurmTestCluster(tmp_path / "cluster", ["n1"], path=str(empty_path)).start()


def test_second_cluster_is_private_and_stops_cleanly(tmp_path: Path, slurm_cluster: SlurmTestCluster) -> None:
    with SlurmTestCluster(tmp_path, ["cpu-1", "cpu-2"], partition="debug") as other:
        client = other.client()
        assert other.port != slurm_cluster.port
        assert client.show_node("cpu-1").partitions == ("debug",)
        assert client.show_reservations() == {}
        conf = other.slurm_conf.read_text()
        assert "/etc/" not in conf
        assert f"AuthInfo=socket={tmp_path}/munge/munge.socket" in conf
        pids = [other._slurmctld.pid, other._munged.pid]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)

    assert not client.ping()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The session cluster was not disturbed.
    assert slurm_cluster.client().ping()


def test_restart_in_the_same_directory_starts_from_empty_state(tmp_path: Path) -> None:
    start = datetime(2031, 1, 1, tzinfo=UTC)
    with SlurmTestCluster(tmp_path, ["cpu-1"]) as first:
        first.client().create_reservation("t-1", ["cpu-1"], start, start + timedelta(hours=1), accounts=["t"])
        assert "t-1" in first.client().show_reservations()

    with SlurmTestCluster(tmp_path, ["cpu-1"]) as second:
        assert second.client().show_reservations() == {}


def test_leftovers_of_a_crashed_run_in_the_same_directory_are_killed(tmp_path: Path) -> None:
    crashed = SlurmTestCluster(tmp_path, ["cpu-1"]).start()
    old_pids = [crashed._slurmctld.pid, crashed._munged.pid]
    try:
        # A new launcher in the same directory, as after a killed pytest run.
        with SlurmTestCluster(tmp_path, ["cpu-1"]) as fresh:
            assert fresh.client().ping()
            # Killed, and (as they are our children here) left as zombies until reaped.
            assert all(Path(f"/proc/{pid}/status").read_text().count("State:\tZ") for pid in old_pids)
    finally:
        crashed.stop()
    for pid in old_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_deep_work_directory_gets_a_short_munge_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with SlurmTestCluster(deep, ["cpu-1"]) as cluster:
        assert len(str(cluster.munge_socket)) < 100
        assert cluster.client().show_node("cpu-1").base_state == "IDLE"
        socket_dir = cluster.munge_socket.parent
    assert not socket_dir.exists()
