"""The Slurm backend while slurmctld hangs, is down or comes back: every call is bounded, a retry converges."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioning.backends.base import BackendError, ClusterContext
from provisioning.backends.slurm import SlurmBackend
from provisioning.slurm_testing import SlurmTestCluster

pytestmark = pytest.mark.slurm

START = datetime(2031, 5, 1, 8, 0, tzinfo=UTC)


def context(nodes: tuple[str, ...]) -> ClusterContext:
    return ClusterContext(cluster_id=1, reservation_id=7, tenant_slug="alpha", pool_name="h100", gpu_model="H100",
                          gpus_per_node=8, nodes=nodes, start=START, end=START + timedelta(hours=4),
                          orchestrator="slurm", orchestrator_version="22.05", cuda_version="12.4")


def test_a_hung_controller_is_a_bounded_transient_error_and_the_retry_converges(tmp_path: Path) -> None:
    with SlurmTestCluster(tmp_path, ["cpu-1", "cpu-2"], partition="debug") as cluster:
        backend = SlurmBackend(client=cluster.client(timeout=2.0))
        ctx = context(("cpu-1", "cpu-2"))
        os.kill(cluster._slurmctld.pid, signal.SIGSTOP)  # hangs: accepts, never answers
        try:
            began = time.monotonic()
            with pytest.raises(BackendError, match="did not answer within 2s") as excinfo:
                backend.allocate_nodes(ctx)
            assert excinfo.value.transient
            assert time.monotonic() - began < 10  # one call's timeout, not scontrol's own retries
            with pytest.raises(BackendError, match="did not answer"):
                backend.teardown(ctx)
        finally:
            os.kill(cluster._slurmctld.pid, signal.SIGCONT)

        # The retry after the controller is back creates it once; the next one changes nothing.
        assert backend.allocate_nodes(ctx).detail == "Slurm reservation alpha-7 created"
        assert backend.allocate_nodes(ctx).detail == "Slurm reservation alpha-7 unchanged"
        # Half-applied by an earlier attempt (a node and the end missing): converged, not "already exists".
        backend.client.update_reservation("alpha-7", nodes=["cpu-1"], end=START + timedelta(hours=1))
        assert backend.allocate_nodes(ctx).detail == "Slurm reservation alpha-7 updated"
        assert backend.status(ctx).nodes == ("cpu-1", "cpu-2")

        # Teardown is idempotent: again, and after an operator deleted it by hand.
        assert backend.teardown(ctx) and backend.teardown(ctx)
        assert not backend.status(ctx).exists


def test_a_stopped_controller_is_reported_unavailable(tmp_path: Path) -> None:
    with SlurmTestCluster(tmp_path, ["cpu-1"], partition="debug") as cluster:
        backend = SlurmBackend(client=cluster.client(timeout=20.0))
        cluster.stop()
        with pytest.raises(BackendError, match="Slurm unavailable: .*Unable to contact slurm controller") as excinfo:
            backend.allocate_nodes(context(("cpu-1",)))
        assert excinfo.value.transient
