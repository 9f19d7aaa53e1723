"""How scontrol's failures are classified: a controller or munge outage reads as "Slurm unavailable"."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioning.backends.base import BackendError, ClusterContext
from provisioning.backends.slurm import SlurmBackend
from provisioning.backends.slurm_client import SlurmClient, SlurmError, SlurmUnavailable

START = datetime(2031, 5, 1, 8, 0, tzinfo=UTC)
CTX = ClusterContext(cluster_id=1, reservation_id=7, tenant_slug="alpha", pool_name="h100", gpu_model="H100",
                     gpus_per_node=8, nodes=("gpu-1",), start=START, end=START + timedelta(hours=4),
                     orchestrator="slurm", orchestrator_version="22.05", cuda_version="12.4")


def failing_scontrol(tmp_path: Path, message: str) -> SlurmClient:
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 1\n")
    script.chmod(0o755)
    return SlurmClient(scontrol=str(script), timeout=10.0)


@pytest.mark.parametrize("message", [
    # munged is down (or its key differs): every RPC to slurmctld fails authentication.
    "slurm_load_reservations error: Protocol authentication error",
    # slurmctld dropped the connection mid-RPC (restarting, overloaded).
    "slurm_load_reservations error: Zero Bytes were transmitted or received",
    "slurm_load_reservations error: Unable to contact slurm controller (connect failure)",
    "slurm_load_reservations error: Socket timed out on send/recv operation",
    # munged down or its key different: what scontrol 22.05 prints when the RPC layer or the auth plugin
    # is all that saw it (slurm_errno.c's SLURM_UNEXPECTED_MSG_ERROR and ESLURM_AUTH_* texts).
    "slurm_load_reservations error: Unexpected message received",
    "scontrol: error: Munge encode failed: Failed to access \"/run/munge/munge.socket.2\": No such file or directory",
    "scontrol: error: Munge decode failed: Invalid credential",
    "scontrol: error: authentication: Invalid authentication credential",
    "slurm_load_reservations error: Authentication credential expired",
])
def test_controller_and_munge_outages_are_slurm_unavailable(tmp_path, message):
    """"Protocol authentication error" and "Zero Bytes were transmitted or received" are transient outages
    of munged / slurmctld, like "Unable to contact slurm controller", but were classified as a plain
    SlurmError: operators read "Slurm: ..." as if Slurm had refused the request itself."""
    client = failing_scontrol(tmp_path, message)
    with pytest.raises(SlurmUnavailable) as excinfo:
        client.show_reservation("alpha-7")
    assert excinfo.value.message == message
    with pytest.raises(BackendError) as excinfo:
        SlurmBackend(client=client).allocate_nodes(CTX)
    assert str(excinfo.value) == f"Slurm unavailable: {message}"
    assert excinfo.value.transient


def test_a_refusal_stays_a_plain_slurm_error(tmp_path):
    message = "Error creating the reservation: Requested node configuration is not available"
    with pytest.raises(SlurmError) as excinfo:
        failing_scontrol(tmp_path, message).show_reservation("alpha-7")
    assert type(excinfo.value) is SlurmError
