"""Fixtures for tests against a real slurmctld (started once per session, no slurmd)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from provisioning.backends.slurm_client import SlurmClient
from provisioning.slurm_testing import SlurmTestCluster

NODES = [f"h100-sxm-{number:03d}" for number in range(1, 9)]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmTestCluster]:
    """Run one private munged + slurmctld for the whole session."""
    with SlurmTestCluster(tmp_path_factory.mktemp("slurm"), NODES, partition="gpu") as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_cluster: SlurmTestCluster) -> Iterator[SlurmClient]:
    """Give a client; afterwards delete every reservation and resume drained nodes."""
    client = slurm_cluster.client()
    yield client
    for name in client.show_reservations():
        client.delete_reservation(name)
    for node in NODES:
        if client.show_node(node).drained:
            client.resume_node(node)


@pytest.fixture(scope="session")
def scontrol(slurm_cluster: SlurmTestCluster):
    """Run raw scontrol against the cluster, so tests can check state without our parser."""

    def run(*args: str) -> str:
        env = {**slurm_cluster.env, "TZ": "UTC", "SLURM_TIME_FORMAT": "standard", "LC_ALL": "C"}
        proc = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=30, check=False)
        return proc.stdout + proc.stderr

    return run
