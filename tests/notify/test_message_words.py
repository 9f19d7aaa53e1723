"""What a team reads of a notice: counts in words, no other team's processes."""

from __future__ import annotations

import json

import pytest

from notifications import selectors, services
from notifications.models import Delivery, QuotaAlertState
from notifications.slack import Event

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("peak", "words"), [(1, "1 node booked"), (3, "3 nodes booked")])
def test_a_quota_alert_skipped_below_the_threshold_counts_in_words(world, peak, words):
    quota = world.tenants["alpha"].quotas.get()
    QuotaAlertState.objects.create(quota=quota, above=False, crossings=1, last_peak=peak)
    delivery = Delivery(event=Event.QUOTA_THRESHOLD, key=f"{Event.QUOTA_THRESHOLD}:q{quota.pk}:n1|c1")

    reason = selectors.quota_alert_obsolete(delivery)

    assert reason == f"quota_below_threshold: {words} at the last check"  # was "1 node(s) booked"


SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"
PLATFORM_URL = "https://hooks.slack.com/services/T9/B9/platform"
PROCESS_PROBLEMS = [
    {"gpu": 0, "check": "processes", "status": "fail", "message": "1 stray compute process: pids [4242]"},
    {"gpu": 1, "check": "xid", "status": "fail", "action": "drain",
     "message": "XID 79 pid=48213, name=train.py, GPU has fallen off the bus"},
]


def _told(delivery) -> str:
    return json.dumps(delivery.payload) + delivery.body


@pytest.mark.parametrize("booked", [False, True], ids=["named-tenant", "reservation"])
def test_a_health_check_failure_reaches_the_tenants_without_the_processes_it_names(
        world, t0, book, slack_for, settings, booked):
    """A failed check's problem messages can name processes on the node (an agent's "pids [...]", an XID
    line's "pid=…, name=…"): another team's work (portal.core.redact). The node's reason was told without
    them, but the check's failures went to the tenant's channel as the agent wrote them; the platform
    channel still reads them as stored."""
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = PLATFORM_URL
    slack_for("alpha", SLACK_URL)
    node = world.nodes[0]
    payload = {"check_id": 41, "node_id": node.pk, "node": node.hostname, "level": "quick", "verdict": "fail",
               "problems": PROCESS_PROBLEMS, "tenant_ids": [world.tenants["alpha"].pk], "reservation_id": None}
    if booked:
        payload["reservation_id"] = book("alpha", t0).pk
        payload["reason"] = "check #41: pids [4242]"

    created = services.event_fanout(event="health_check.failed", payload=payload)

    by_tenant = {d.tenant_id: d for d in created}
    assert set(by_tenant) == {world.tenants["alpha"].pk, None}
    told = _told(by_tenant[world.tenants["alpha"].pk])
    assert "4242" not in told and "48213" not in told and "train.py" not in told, told
    assert "GPU has fallen off the bus" in told and "stray compute process" in told
    staff = _told(by_tenant[None])
    assert "pids [4242]" in staff and "pid=48213, name=train.py" in staff


STORED_REASON = ("health check #41 (quick) failed: GPU 0: 1 stray compute process: pids [4242]; "
                 "XID 79 pid=48213, name=train.py, GPU has fallen off the bus")


@pytest.mark.parametrize("event", ["reservation.degraded", "node.replaced"])
def test_a_moved_booking_is_told_why_without_the_processes_the_reason_names(world, t0, book, slack_for, settings,
                                                                           event):
    """A node taken out of service by a failed check moves its bookings (a spare, or one node short) with the
    check's summary as the reason; a summary stored by an older agent names processes, possibly of the team
    before. The teams' notices told it as stored; now without them, and the platform channel as stored."""
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = PLATFORM_URL
    services.platform_channel_update(actor=world.users["staff"], channel=services.platform_channel_ensure(),
                                     events=[Event.CLUSTER_DEGRADED, Event.NODE_REPLACED])
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0)
    payload = {"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id, "reason": STORED_REASON,
               "node": "h100-001", "missing_nodes": 1, "failed": "h100-001", "spare": "h100-004"}

    created = services.event_fanout(event=event, payload=payload)

    by_tenant = {d.tenant_id: d for d in created}
    assert set(by_tenant) == {world.tenants["alpha"].pk, None}
    told = _told(by_tenant[world.tenants["alpha"].pk])
    assert "4242" not in told and "48213" not in told and "train.py" not in told, told
    assert "GPU has fallen off the bus" in told
    assert "pids [4242]" in _told(by_tenant[None]) and "name=train.py" in _told(by_tenant[None])
