"""`manage.py reconcile --fix` beside the lifecycle's own workers, on the real database (found in a review of
the provisioning side; each test failed on the code before its fix)."""


import pytest

from provisioning import services
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from tests.provisioning.conftest import book, now_slot

pytestmark = pytest.mark.django_db


def _ready_cluster(world, who="alpha-lead"):
    reservation = book(world, who, now_slot(world), hours=4, nodes=1)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    return reservation, cluster


def test_simulated_reconcile_leaves_a_cluster_built_after_its_snapshot_alone(world):
    """The simulated backend ignored `live` (its own list of ready clusters shadowed the argument): a cluster
    provisioned after reconcile read `wanted` was deleted as an orphan, under a running booking."""
    reservation, cluster = _ready_cluster(world)
    backend = SimulatedBackend()
    asked = []
    drifts = backend.reconcile([], fix=True, live=lambda rid: asked.append(rid) or rid == reservation.pk)
    assert reservation.pk in asked
    assert [d for d in drifts if d.name == f"cluster-{cluster.pk}"] == []
    assert backend.status(services.build_context(cluster.pk)).exists
