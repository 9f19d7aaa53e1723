"""A drain the backend cannot finish yet (a pod's disruption budget, Slurm jobs still ending) is tried again with
growing waits, driven on by the lifecycle tick once the task's retries are spent, and shown to operators."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from provisioning import services
from provisioning.backends.faults import parse_faults
from provisioning.models import NodeDrain
from reservations.choices import NodeState
from reservations.services import node_update


@pytest.fixture
def slow_drain(settings, world):
    settings.PORTAL_PROVISIONING_FAULTS = "drain=incomplete:100"
    settings.PORTAL_PROVISIONING_RETRY_BACKOFF_SECONDS = "15"
    settings.PORTAL_PROVISIONING_RETRY_BACKOFF_MAX_SECONDS = "600"
    from django.core.cache import cache

    cache.delete_many([f"prov-fault:drain:{node.hostname}" for node in world.nodes])
    return settings


def test_the_drain_fault_parses_and_typos_are_refused():
    assert parse_faults("drain=incomplete:3")["drain"].action == "incomplete"
    with pytest.raises(ValueError):
        parse_faults("drain=incomplet")


def _sent(monkeypatch) -> list[tuple]:
    sent: list[tuple] = []
    monkeypatch.setattr(services, "_send", lambda name, *args, **kw: sent.append((name, *args)))
    return sent


def test_an_unfinished_drain_waits_longer_each_time_and_the_tick_drives_it_on(
        world, slow_drain, monkeypatch, django_capture_on_commit_callbacks):
    """The task retried 12 times every 7.5–15 s and gave up after 3 minutes at most: the tenant's work stayed on
    the out-of-service node until staff ran reconcile by hand."""
    node = world.nodes[0]
    node_update(actor=None, node=node, state=NodeState.FAILED, reason="XID 79")
    waits = []
    for _ in range(8):
        with pytest.raises(services.RetryLater) as caught:
            services.node_sync(node_id=node.pk)
        waits.append(caught.value.countdown)
    assert waits[5] > 15 * 2 ** 4 * 0.5 - 1  # it grows: the sixth wait is minutes, not seconds
    assert max(waits) <= 600  # capped, well inside the broker's visibility timeout
    drain = NodeDrain.objects.get(node=node)
    assert drain.attempts == 8 and "not finished" in drain.last_error

    # The task's retries are spent: the tick finds the drain due and sends it again, once.
    sent = _sent(monkeypatch)
    later = drain.next_attempt_at + timedelta(minutes=5)
    with django_capture_on_commit_callbacks(execute=True):
        services.lifecycle_tick(now=later)
    with django_capture_on_commit_callbacks(execute=True):
        services.lifecycle_tick(now=later + timedelta(minutes=1))
    assert sent.count(("node_changed", node.pk)) == 1

    # The budget allows it at last: the drain completes and is forgotten; the tick sends nothing more.
    slow_drain.PORTAL_PROVISIONING_FAULTS = ""
    services.node_sync(node_id=node.pk)
    assert not NodeDrain.objects.filter(node=node).exists()
    with django_capture_on_commit_callbacks(execute=True):
        services.lifecycle_tick(now=later + timedelta(hours=1))
    assert sent.count(("node_changed", node.pk)) == 1


def test_a_node_back_in_service_forgets_its_unfinished_drain(world, slow_drain):
    node = world.nodes[1]
    node_update(actor=None, node=node, state=NodeState.FAILED, reason="XID 79")
    with pytest.raises(services.RetryLater):
        services.node_sync(node_id=node.pk)
    node_update(actor=None, node=node, state=NodeState.AVAILABLE, reason="")
    services.node_sync(node_id=node.pk)
    assert not NodeDrain.objects.filter(node=node).exists()


def test_a_stuck_drain_is_in_the_metrics(world, slow_drain, client, settings):
    node = world.nodes[2]
    node_update(actor=None, node=node, state=NodeState.FAILED, reason="XID 79")
    with pytest.raises(services.RetryLater):
        services.node_sync(node_id=node.pk)
    NodeDrain.objects.filter(node=node).update(since=timezone.now() - timedelta(minutes=40))
    from portal.ops.collectors import PortalCollector

    text = "\n".join(f"{s.name} {s.value}" for fam in PortalCollector().collect() for s in fam.samples)
    assert "portal_node_drains_unfinished 1" in text.splitlines(), text
    age = next(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("portal_node_drain_oldest_age_seconds "))
    assert age >= 39 * 60  # the database clock reads the transaction start
