"""`manage.py reconcile --fix` beside the lifecycle's own workers, on the real database (found in a review of
the provisioning side; each test failed on the code before its fix)."""



import pytest

from provisioning import services
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from tests.provisioning.conftest import book, now_slot, tenant_tears_down_during

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


@pytest.mark.django_db(transaction=True)
def test_reconcile_fix_never_rebuilds_a_cluster_a_teardown_removes_meanwhile(world):
    """reconcile --fix read the clusters it wants, then repaired them in the backend without the cluster's lock:
    a teardown that ran in between (the tenant's button, a cancel, the window's end) removed the cluster, and
    reconcile built it again as "missing" — the tenant's cluster stood in the backend after its row said
    deleted. Now each repair of a cluster runs under the cluster's lock, and only while the cluster is still
    as reconcile read it: this one is left to its teardown."""
    reservation, cluster = _ready_cluster(world)
    with tenant_tears_down_during(SimulatedBackend, "reconcile", actor=world.users["alpha-lead"],
                                  cluster=cluster) as seen:
        drifts = services.reconcile(fix=True, backend_name="simulated")
    assert seen["teardown"] == ClusterStatus.DELETED
    [drift] = [d for d in drifts if d["name"] == f"cluster-{cluster.pk}"]
    assert not drift["repaired"] and "is being torn down or no longer wanted" in drift["detail"]
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.DELETED
    assert not SimulatedBackend().status(services.build_context(cluster.pk)).exists
    # The next run finds nothing to say about it.
    assert [d for d in services.reconcile(fix=True, backend_name="simulated")
            if d["name"] == f"cluster-{cluster.pk}"] == []


@pytest.mark.django_db(transaction=True)
def test_reconcile_fix_waits_for_no_teardown_and_none_runs_beside_its_repair(world):
    """The other order: the teardown starts while reconcile repairs the cluster (under its lock): it finds the
    cluster busy, and its retry removes what the repair built."""
    reservation, cluster = _ready_cluster(world)
    SimulatedBackend()._forget(cluster.pk)  # lost: reconcile rebuilds it
    with tenant_tears_down_during(SimulatedBackend, "_store", actor=world.users["alpha-lead"],
                                  cluster=cluster) as seen:
        drifts = services.reconcile(fix=True, backend_name="simulated")
    assert seen["teardown"] == "busy"
    assert [(d["kind"], d["repaired"]) for d in drifts if d["name"] == f"cluster-{cluster.pk}"] == [("missing", True)]
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED  # its task's next try
    assert not SimulatedBackend().status(services.build_context(cluster.pk)).exists


@pytest.mark.django_db(transaction=True)
def test_reconcile_fix_leaves_a_cluster_a_running_task_holds_to_it(world):
    """A cluster whose lock a running task holds (provisioning, a teardown, a swap) is not repaired by
    reconcile --fix beside it: it is reported, left to that task, and repaired by a later run."""
    from provisioning.constants import LOCK_CLUSTER
    from tests.provisioning.test_review_races import held_elsewhere

    reservation, cluster = _ready_cluster(world)
    backend = SimulatedBackend()
    backend._forget(cluster.pk)  # half-built, as a task in flight leaves it
    with held_elsewhere(LOCK_CLUSTER, cluster.pk):
        drifts = services.reconcile(fix=True, backend_name="simulated")
    [drift] = [d for d in drifts if d["name"] == f"cluster-{cluster.pk}"]
    assert not drift["repaired"] and "left alone: a task holds cluster" in drift["detail"]
    assert not backend.status(services.build_context(cluster.pk)).exists  # nothing built beside the task
    drifts = services.reconcile(fix=True, backend_name="simulated")  # once the task let go
    assert [(d["kind"], d["repaired"]) for d in drifts if d["name"] == f"cluster-{cluster.pk}"] == [("missing", True)]
    assert backend.status(services.build_context(cluster.pk)).exists
