"""A node agent that stops reading its queue (dead, or a renamed or deleted node) must not make that queue grow
without limit on the broker (Redis runs with noeviction): each message to a node queue expires, the sweep sends
no new check while the previous one still waits there, and operators see the agent as not answering."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings

from provisioning.health import conf, services, tasks
from provisioning.health.models import HealthCheck


@pytest.fixture
def node_mode(settings, world):
    settings.PORTAL_HEALTH_AGENT_QUEUE = "node"
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    keys = [f"node.{node.hostname}" for node in world.nodes]
    client.delete(*keys)
    yield client
    client.delete(*keys)


def _sweep(capture) -> list[int]:
    with capture(execute=True):
        return services.health_sweep(level="quick")


def test_a_silent_agent_gets_no_second_check_and_is_reported_not_answering(
        world, node_mode, django_capture_on_commit_callbacks):
    """Every sweep left one more message in a dead agent's queue (one every 5 minutes, for ever)."""
    node = world.nodes[0]
    queue = f"node.{node.hostname}"
    first = _sweep(django_capture_on_commit_callbacks)
    assert node_mode.llen(queue) == 1
    services.health_checks_expire(now=services._now() + timedelta(hours=1))  # nobody picked it up

    second = _sweep(django_capture_on_commit_callbacks)
    assert node_mode.llen(queue) == 1  # the first still waits there: none sent beside it
    check = HealthCheck.objects.get(pk__in=second, node=node)
    assert (check.status, check.verdict) == ("error", "unknown") and check.handled_at is not None
    assert "not answering" in check.summary and queue in check.error
    assert set(first) & set(second) == set()

    from portal.ops.collectors import PortalCollector

    samples = {s.name: s.value for fam in PortalCollector().collect() for s in fam.samples}
    assert samples["portal_health_agents_not_answering"] == len(world.nodes)

    # The agent is back and empties its queue: the next sweep sends again.
    node_mode.delete(queue)
    third = _sweep(django_capture_on_commit_callbacks)
    assert node_mode.llen(queue) == 1
    assert HealthCheck.objects.get(pk__in=third, node=node).status == "queued"


def test_the_acknowledgement_of_a_report_expires(world, monkeypatch):
    """xids_accepted went to the node's queue with no expiry: a dead agent kept each one for ever."""
    sent = []
    monkeypatch.setattr(tasks.xids_accepted, "apply_async", lambda *a, **kw: sent.append(kw))
    [check] = services.health_checks_request(nodes=[world.nodes[0]], level="quick", trigger="staff")
    HealthCheck.objects.filter(pk=check.pk).update(status="done", verdict="pass", finished_at=services._now(),
                                                   handled_at=services._now())
    tasks.record_report(check.pk, {}, agent=world.nodes[0].hostname)
    [kwargs] = sent
    # Long enough to wait behind the longest check the agent may be running, and no longer.
    assert kwargs["queue"] == f"node.{world.nodes[0].hostname}"
    assert max(conf.level_timeout_s(level) for level in ("quick", "medium", "full")) <= kwargs["expires"] <= 86400


def test_a_node_and_its_agent_named_in_different_cases_meet_on_one_queue(world, node_mode, monkeypatch,
                                                                         django_capture_on_commit_callbacks):
    """Hostnames are one host ignoring case, broker queue names are not: node H100-001's checks went to
    node.H100-001 while its agent, started as h100-001 (its socket name), served node.h100-001; nobody read
    them and the node was reported not answering. Both ends name the queue in lower case."""
    from provisioning.health.worker import build_argv

    node = world.nodes[0]
    type(node).objects.filter(pk=node.pk).update(hostname=node.hostname.upper())
    node.refresh_from_db()
    agent = build_argv(["node", "--hostname", node.hostname.lower()])
    queue = agent[agent.index("-Q") + 1]
    # The agent named in capitals reads the lower-case queue first (and the one of its name as given, which
    # the portal sent to before the upgrade).
    assert build_argv(["node", "--hostname", node.hostname])[agent.index("-Q") + 1].split(",")[0] == queue
    node_mode.delete(queue, f"node.{node.hostname}")
    try:
        [check] = _sweep_one(node, django_capture_on_commit_callbacks)
        assert node_mode.llen(queue) == 1 and node_mode.llen(f"node.{node.hostname}") == 0
        assert check.agent_queue == queue
        # The acknowledgement of its report goes there too.
        sent = []
        monkeypatch.setattr(tasks.xids_accepted, "apply_async", lambda *a, **kw: sent.append(kw))
        HealthCheck.objects.filter(pk=check.pk).update(status="done", verdict="pass", finished_at=services._now(),
                                                       handled_at=services._now())
        tasks.record_report(check.pk, {}, agent=node.hostname)
        assert [kw["queue"] for kw in sent] == [queue]
    finally:
        node_mode.delete(queue, f"node.{node.hostname}")


def _sweep_one(node, capture) -> list[HealthCheck]:
    with capture(execute=True):
        ids = services.health_checks_request(nodes=[node], level="quick", trigger="staff")
    return list(HealthCheck.objects.filter(pk__in=[c.pk for c in ids]))
