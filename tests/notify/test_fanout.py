"""Domain events become one delivery per (event, channel): translated, scoped to the tenant, idempotent."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from notifications import selectors, services
from notifications.choices import DeliveryStatus
from notifications.models import Channel, Delivery, QuotaAlertState
from notifications.slack import Event
from portal.core.timefmt import format_utc
from reservations import services as booking
from reservations.models import Node, Reservation
from tenants.services import quota_update

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


def test_confirmed_booking_becomes_one_slack_delivery_with_block_kit(world, t0, book, slack_for):
    channel = slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, nodes=2, name="llm-pretrain")

    created = services.event_fanout(event="reservation.confirmed",
                                    payload={"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id})

    assert [d.channel_id for d in created] == [channel.pk]
    delivery = created[0]
    assert delivery.status == DeliveryStatus.PENDING and delivery.event == Event.RESERVATION_CONFIRMED
    body = json.loads(delivery.body)
    assert body["text"].startswith("Reservation confirmed: llm-pretrain (Team Alpha)")
    assert body["blocks"][0]["type"] == "header"
    links = json.dumps(body["blocks"])
    assert f"https://portal.example.com/reservations/{reservation.pk}/" in links
    assert delivery.payload["nodes"] and delivery.payload["actor"] == "alpha-lead"
    assert delivery.tenant_id == world.tenants["alpha"].pk


def test_a_name_with_formatting_marks_is_fenced_in_slack_and_plain_in_the_delivery_log(world, t0, book, slack_for):
    """Slack reads *x* as bold, so the message fences the marks; the delivery log's summary (the pages, the
    admin's search) shows the name as typed, with no invisible characters in it."""
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, name="llm_pretrain *now*")
    [delivery] = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    assert "*now*" not in json.loads(delivery.body)["text"]
    assert delivery.summary.startswith("Reservation confirmed: llm_pretrain *now* (Team Alpha)")
    assert "\u200b" not in delivery.summary
    assert Delivery.objects.filter(summary__contains="llm_pretrain").count() == 1


def test_the_same_event_twice_adds_nothing(world, t0, book, slack_for, webhook_for):
    slack_for("alpha", SLACK_URL)
    webhook_for("alpha", "https://ci.alpha.example/hook")
    reservation = book("alpha", t0)
    payload = {"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id}

    first = services.event_fanout(event="reservation.confirmed", payload=payload)
    second = services.event_fanout(event="reservation.confirmed", payload=payload)

    assert len(first) == 2 and second == []
    assert Delivery.objects.filter(event=Event.RESERVATION_CONFIRMED).count() == 2
    assert len({d.key for d in Delivery.objects.all()}) == 2


def test_other_tenants_channels_never_hear_of_it(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    beta = slack_for("beta", "https://hooks.slack.com/services/T1/B1/beta-secret")
    reservation = book("alpha", t0)
    services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    assert not Delivery.objects.filter(channel=beta).exists()
    assert "alpha" not in json.dumps(list(Delivery.objects.filter(tenant=world.tenants["beta"]).values()))


def test_only_subscribed_events_are_sent(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL, events=[Event.RESERVATION_CANCELLED])
    reservation = book("alpha", t0)
    assert services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk}) == []
    booking.reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)
    created = services.event_fanout(event="reservation.cancelled", payload={"reservation_id": reservation.pk})
    assert [d.event for d in created] == [Event.RESERVATION_CANCELLED]
    assert "was cancelled by alpha-lead" in json.loads(created[0].body)["blocks"][1]["text"]["text"]


def test_each_change_is_its_own_message_with_old_and_new(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, hours=2)
    booking.reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=4))
    first = services.event_fanout(event="reservation.changed", payload={"reservation_id": reservation.pk})
    booking.reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=3))
    second = services.event_fanout(event="reservation.changed", payload={"reservation_id": reservation.pk})
    assert len(first) == len(second) == 1 and first[0].key != second[0].key
    assert second[0].payload["previous_end"] == first[0].payload["end"]
    assert "~" in json.dumps(json.loads(second[0].body)["blocks"])  # "~old~ → new"


@pytest.mark.parametrize("event", ["reservation.provisioning", "cluster.exploded", "weird", "node.state_changed"])
def test_unknown_or_uninteresting_events_are_ignored(world, slack_for, event):
    slack_for("alpha", SLACK_URL)
    payload = {"node_id": world.nodes[0].pk, "old": "available", "new": "draining"}
    assert services.event_fanout(event=event, payload=payload) == []
    assert not Delivery.objects.exists()


def test_malformed_payloads_are_ignored(world, slack_for):
    slack_for("alpha", SLACK_URL)
    for payload in ({}, {"reservation_id": "x"}, {"reservation_id": 999999}, {"reservation_id": None}):
        assert services.event_fanout(event="reservation.confirmed", payload=payload) == []


def test_failed_node_tells_the_tenant_running_on_it_and_the_platform(world, settings, slack_for, notify_settings):
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    alpha = slack_for("alpha", SLACK_URL)
    beta = slack_for("beta", "https://hooks.slack.com/services/T1/B1/beta-secret")
    now = timezone.now()
    start = now.replace(minute=0, second=0, microsecond=0)
    reservation = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                             pool=world.pool, node_count=1, start=start,
                                             end=start + timedelta(hours=3))
    node = Node.objects.get(allocations__reservation=reservation)
    booking.node_update(actor=world.users["staff"], node=node, state="failed", reason="XID 79")

    created = services.event_fanout(event="node.state_changed",
                                    payload={"node_id": node.pk, "old": "available", "new": "failed"})

    by_channel = {d.channel_id: d for d in created}
    platform = Channel.objects.get(tenant__isnull=True)
    assert set(by_channel) == {alpha.pk, platform.pk}  # beta holds nothing on that node
    assert beta.pk not in by_channel
    assert by_channel[alpha.pk].payload["node"] == node.hostname
    assert by_channel[platform.pk].tenant_id is None and by_channel[platform.pk].payload["tenant"] == "alpha"
    # The same failure announced again (say, as node.failed by the health checks) is not sent twice.
    again = services.event_fanout(event="node.failed", payload={"node_id": node.pk})
    assert again == []


def test_a_node_reason_stored_with_processes_reaches_the_tenants_without_them(world, settings, slack_for,
                                                                              notify_settings):
    """Health failure reasons used to name the processes on the node ("pids [...]", an XID line's "pid=…,
    name=…"): another team's work. A node notice falling back to the node's stored reason told the teams
    booked on it those processes; now they read the reason without them, and the platform channel as stored."""
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    alpha = slack_for("alpha", SLACK_URL)
    start = timezone.now().replace(minute=0, second=0, microsecond=0)
    reservation = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                             pool=world.pool, node_count=1, start=start,
                                             end=start + timedelta(hours=3))
    node = Node.objects.get(allocations__reservation=reservation)
    stored = ("check #41 failed: GPU 0: 1 stray compute process(es): pids [4242]; "
              "XID 79 pid=48213, name=train.py, GPU has fallen off the bus")
    booking.node_update(actor=world.users["staff"], node=node, state="failed", reason=stored)

    created = services.event_fanout(event="node.state_changed",
                                    payload={"node_id": node.pk, "old": "available", "new": "failed"})

    by_channel = {d.channel_id: d for d in created}
    platform = Channel.objects.get(tenant__isnull=True)
    told = json.dumps(by_channel[alpha.pk].payload) + by_channel[alpha.pk].body
    assert "4242" not in told and "48213" not in told and "train.py" not in told, told
    assert "GPU has fallen off the bus" in by_channel[alpha.pk].payload["reason"]
    assert by_channel[platform.pk].payload["reason"] == stored


def test_no_channel_is_told_a_secret_an_error_text_carries(world, t0, book, slack_for, webhook_for, settings,
                                                             notify_settings):
    """Error texts (a node's reason from a tool's output, a check's failures) go to Slack and webhooks through
    portal.core.redact.without_secrets, the platform channel too: a Slack channel is no place for a token."""
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    slack_for("alpha", SLACK_URL)
    webhook_for("alpha", "https://ci.alpha.example/hook")
    reservation = book("alpha", t0)
    secret = "https://ops:hunter2@bmc.internal/redfish token=ab12cd34ef56"
    created = services.event_fanout(event="health_check.failed", payload={
        "reservation_id": reservation.pk, "node": reservation.allocations.first().node.hostname,
        "verdict": "fail", "reason": f"dcgmi diag: {secret}", "failures": [f"GPU 0: {secret}"],
        "health_check_id": 12})
    assert len(created) == 3  # the team's Slack and webhook, the platform's Slack
    for delivery in created:
        told = json.dumps(delivery.payload) + delivery.body + delivery.summary
        assert "hunter2" not in told and "ab12cd34ef56" not in told, told
        assert "bmc.internal/redfish" in delivery.payload["reason"]
        assert "[redacted]" in delivery.payload["failures"][0]


def test_replaced_node_and_degraded_reservation_are_translated(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0)
    replaced = services.event_fanout(event="node.replaced", payload={
        "reservation_id": reservation.pk, "tenant_id": reservation.tenant_id, "failed": "h100-001",
        "spare": "h100-004", "reason": "ECC"})
    degraded = services.event_fanout(event="reservation.degraded", payload={
        "reservation_id": reservation.pk, "tenant_id": reservation.tenant_id, "node": "h100-001",
        "missing_nodes": 1, "reason": "no spare"})
    assert [d.event for d in replaced] == [Event.NODE_REPLACED]
    assert "h100-004" in replaced[0].summary
    assert [d.event for d in degraded] == [Event.CLUSTER_DEGRADED]
    assert "1 node missing. no spare" in str(degraded[0].payload)  # was "1 node(s) missing."


def test_cluster_and_health_events_from_other_apps(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0)
    ready = services.event_fanout(event="cluster.ready", payload={
        "reservation_id": reservation.pk, "cluster_id": 7, "access": "ssh alpha@login"})
    health = services.event_fanout(event="health_check.failed", payload={
        "reservation_id": reservation.pk, "node": world.nodes[0].hostname, "level": "quick", "verdict": "fail",
        "failures": ["GPU 3: XID 79"], "health_check_id": 11})
    assert [d.event for d in ready] == [Event.CLUSTER_READY]
    assert "/clusters/7/" in ready[0].body
    assert [d.event for d in health] == [Event.HEALTH_CHECK_FAILED]
    assert "GPU 3: XID 79" in health[0].body


def test_quota_alert_once_per_crossing_of_80_percent(world, t0, book, slack_for, django_capture_on_commit_callbacks):
    slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    first = book("alpha", t0, nodes=3)  # 60 %: nothing
    assert services.quota_threshold_check(tenant_id=first.tenant_id, pool_id=first.pool_id) == []
    second = book("alpha", t0, nodes=1)  # 80 %: alert
    created = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": second.pk})
    alerts = [d for d in created if d.event == Event.QUOTA_THRESHOLD]
    assert len(alerts) == 1 and alerts[0].payload["used_nodes"] == 4 and alerts[0].payload["percent"] == 80
    assert "80 %" in alerts[0].summary
    # Still above: re-checking after another change sends nothing new.
    assert services.quota_threshold_check(tenant_id=first.tenant_id, pool_id=first.pool_id) == []
    # Falls below, then crosses again: a second alert.
    booking.reservation_cancel(actor=world.users["alpha-lead"], reservation=second)
    assert services.quota_threshold_check(tenant_id=first.tenant_id, pool_id=first.pool_id) == []
    third = book("alpha", t0 + timedelta(hours=1), nodes=1)
    again = services.quota_threshold_check(tenant_id=third.tenant_id, pool_id=third.pool_id)
    assert len(again) == 1 and again[0].key != alerts[0].key
    assert QuotaAlertState.objects.get(quota=quota).crossings == 2


def test_reminders_are_due_once_and_keyed_like_the_lifecycle_ticks(world, slack_for, notify_settings):
    slack_for("alpha", SLACK_URL)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    soon = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                      pool=world.pool, node_count=1, start=hour, end=hour + timedelta(hours=30))
    # Pretend it was booked yesterday: the "starts in 1 h" moment came after the booking.
    type(soon).objects.filter(pk=soon.pk).update(created_at=now - timedelta(days=1))

    due = selectors.reminders_due(now=now)
    assert ("reservation.starting_soon", soon.pk, 1) in due
    created = services.reminders_emit(now=now)
    assert [d.event for d in created] == [Event.RESERVATION_STARTING_1H]
    # The beat runs every minute, and the lifecycle tick may announce the same reminder.
    assert services.reminders_emit(now=now) == []
    assert services.event_fanout(event="reservation.starting_soon",
                                 payload={"reservation_id": soon.pk, "tenant_id": soon.tenant_id, "hours": 1}) == []
    # 29 h later: "ends in 24 h" is not due yet at 30-24=6 h after start... but is at end - 23 h.
    later = soon.period.upper - timedelta(hours=23)
    assert ("reservation.ending_soon", soon.pk, 24) in selectors.reminders_due(now=later)
    assert ("reservation.ending_soon", soon.pk, 1) in selectors.reminders_due(now=soon.period.upper -
                                                                                 timedelta(minutes=30))
    assert not selectors.reminders_due(now=soon.period.upper + timedelta(minutes=1))


def test_a_booking_made_within_the_hour_gets_no_start_reminder(world, slack_for):
    slack_for("alpha", SLACK_URL)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                               node_count=1, start=hour, end=hour + timedelta(hours=2))
    assert selectors.reminders_due(now=now) == []


def test_subscriber_queues_nothing_when_nobody_listens(world, t0, book, notify_settings):
    reservation = book("alpha", t0)
    assert not selectors.anyone_listening("reservation.confirmed",
                                          {"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id})
    assert not selectors.anyone_listening("node.state_changed", {"node_id": world.nodes[0].pk})


# --- the payloads the provisioning and health apps actually emit -------------------------


def test_lifecycle_tick_reminders_without_hours(world, slack_for):
    slack_for("alpha", SLACK_URL)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    r = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                   node_count=1, start=hour, end=hour + timedelta(hours=2))

    def tick(event, boundary):
        return services.event_fanout(event=f"reservation.{event}", payload={
            "reservation_id": r.pk, "tenant_id": r.tenant_id, "cluster_id": 3, boundary: getattr(
                r.period, "lower" if boundary == "start" else "upper").isoformat()})

    assert [d.event for d in tick("starting_soon", "start")] == [Event.RESERVATION_STARTING_1H]
    # Our own sweep names the same reminders the same way: nothing twice.
    assert services.event_fanout(event="reservation.starting_soon",
                                 payload={"reservation_id": r.pk, "hours": 1}) == []
    # The end is 2-3 h off (a tick with PORTAL_REMIND_BEFORE_END_MINUTES=180): neither "in about 1 hour" nor
    # "in about 24 hours" is true, so nothing is told now — and the right reminder is not used up.
    assert tick("ending_soon", "end") == []
    Reservation.objects.filter(pk=r.pk).update(period=DateTimeTZRange(now - timedelta(hours=1), hour, "[)"))
    r.refresh_from_db()
    assert [d.event for d in tick("ending_soon", "end")] == [Event.RESERVATION_ENDING_1H]


def test_lifecycle_tick_reminder_a_day_ahead_is_the_24_hour_one(world, slack_for):
    slack_for("alpha", SLACK_URL)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    r = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                   node_count=1, start=hour, end=hour + timedelta(hours=24))
    (notice,) = services.event_fanout(event="reservation.ending_soon", payload={
        "reservation_id": r.pk, "tenant_id": r.tenant_id, "cluster_id": 3, "end": r.period.upper.isoformat()})
    assert notice.event == Event.RESERVATION_ENDING_24H and "in about 24 hours" in notice.body


def test_health_checks_failure_payload(world, t0, book, slack_for, settings):
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    slack_for("alpha", SLACK_URL)
    node = world.nodes[0]
    payload = {
        "check_id": 41, "node_id": node.pk, "node": node.hostname, "level": "quick", "trigger": "schedule",
        "verdict": "fail", "recommended_action": "drain",
        "problems": [{"gpu": 3, "check": "xid", "status": "fail", "action": "drain", "message": "XID 79"}],
        "tenant_ids": [world.tenants["alpha"].pk], "reservation_id": None,
    }
    created = services.event_fanout(event="health_check.failed", payload=payload)
    by_tenant = {d.tenant_id: d for d in created}
    assert set(by_tenant) == {world.tenants["alpha"].pk, None}
    assert "GPU 3: xid fail — XID 79 (drain)" in by_tenant[None].body
    failed = services.event_fanout(event="node.failed", payload={
        "node_id": node.pk, "node": node.hostname, "state": "draining", "reason": "check #41 failed",
        "check_id": 41, "repair_id": 5, "tenant_ids": [world.tenants["alpha"].pk], "outcomes": []})
    assert {d.event for d in failed} == {Event.NODE_FAILED} and len(failed) == 2
    # The repair declaring the node failed later is the same failure.
    assert services.event_fanout(event="node.failed", payload={"node_id": node.pk, "repair_id": 5}) == []


def test_degraded_cluster_and_reservation_for_one_node_are_one_message(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    r = book("alpha", t0)
    first = services.event_fanout(event="reservation.degraded", payload={
        "reservation_id": r.pk, "tenant_id": r.tenant_id, "node": "h100-001", "missing_nodes": 1, "reason": "x"})
    second = services.event_fanout(event="cluster.degraded", payload={
        "cluster_id": 9, "reservation_id": r.pk, "tenant_id": r.tenant_id, "status": "degraded",
        "node": "h100-001", "reason": "h100-001 is failed; no spare node is free"})
    assert len(first) == 1 and second == []


def test_a_late_fan_out_tells_each_event_as_it_was(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, hours=2)
    booking.reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=5))
    booking.reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)
    # All three fan-outs run only now (a busy queue): each still describes its own moment.
    (confirmed,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    (changed,) = services.event_fanout(event="reservation.changed", payload={"reservation_id": reservation.pk})
    (cancelled,) = services.event_fanout(event="reservation.cancelled", payload={"reservation_id": reservation.pk})
    assert (confirmed.payload["end"], confirmed.payload["status"]) == (
        (t0 + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ"), "confirmed")
    assert changed.payload["status"] == "confirmed" and changed.payload["previous_end"] == confirmed.payload["end"]
    assert changed.payload["end"] == (t0 + timedelta(hours=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert cancelled.payload["status"] == "cancelled"


def test_no_ends_in_24_hours_for_an_end_moved_after_that_moment(world, slack_for, notify_settings):
    # A day-long run, hours from its end: its "ends in 24 h" went out yesterday. The lead extends it by an
    # hour. The new end is still within the 24 h window the sweep looks at, but "ends in about 24 hours"
    # for an end 2-3 h away is false (and the change was just announced): only "ends in 1 h" follows.
    from reservations.models import Allocation, Reservation

    slack_for("alpha", SLACK_URL)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    r = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                   node_count=1, start=hour + timedelta(hours=1), end=hour + timedelta(hours=26))
    # Move it a day back: it started 23 h ago, ends at hour + 2 h, and was booked three days ago.
    shifted = DateTimeTZRange(hour - timedelta(hours=23), hour + timedelta(hours=2), "[)")
    Reservation.objects.filter(pk=r.pk).update(period=shifted, status="active",
                                               created_at=now - timedelta(days=3))
    Allocation.objects.filter(reservation=r).update(period=shifted)
    first = services.reminders_emit(now=now)
    assert [(d.event, d.payload["end"]) for d in first] == [(Event.RESERVATION_ENDING_24H, format_utc(shifted.upper))]

    r.refresh_from_db()
    booking.reservation_update(actor=world.users["alpha-lead"], reservation=r, end=hour + timedelta(hours=3))

    assert services.reminders_emit(now=now) == []
    assert services.event_fanout(event="reservation.ending_soon",
                                 payload={"reservation_id": r.pk, "tenant_id": r.tenant_id, "hours": 24}) == []
    # The new end's own "ends in 1 h" moment comes after the change: that one is sent.
    last_hour = services.reminders_emit(now=hour + timedelta(hours=2, minutes=30))
    assert [d.event for d in last_hour] == [Event.RESERVATION_ENDING_1H]


def test_no_starts_in_1_hour_for_a_start_moved_within_the_hour(world, slack_for, notify_settings):
    # Booked yesterday for hour + 3 h, moved now to hour + 1 h: as for a booking made within the hour, the
    # "starts in 1 h" moment had passed when the start was set; the "changed" message told the team.
    from reservations.models import Reservation

    slack_for("alpha", SLACK_URL)
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    r = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                   node_count=1, start=hour + timedelta(hours=3), end=hour + timedelta(hours=5))
    Reservation.objects.filter(pk=r.pk).update(created_at=now - timedelta(days=1))
    r.refresh_from_db()
    booking.reservation_update(actor=world.users["alpha-lead"], reservation=r, start=hour + timedelta(hours=1))

    assert services.reminders_emit(now=now) == []


def test_cluster_ready_tells_the_team_how_to_connect(world, t0, book, slack_for, webhook_for, settings):
    # The provisioning app announces cluster.ready with ids only; the message must still say how to get in.
    from provisioning import services as provisioning
    from provisioning.choices import ClusterStatus
    from provisioning.models import VirtualCluster

    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    settings.PORTAL_SIMULATED_PHASE_SECONDS = "0"
    slack_for("alpha", SLACK_URL, events=[Event.CLUSTER_READY])
    webhook_for("alpha", "https://ci.example.com/hooks/portal", events=[Event.CLUSTER_READY])
    reservation = book("alpha", t0)
    provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert provisioning.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    cluster.refresh_from_db()

    created = services.event_fanout(event="cluster.ready", payload={  # as provisioning emits it
        "cluster_id": cluster.pk, "reservation_id": reservation.pk, "tenant_id": reservation.tenant_id,
        "status": "ready"})

    by_kind = {d.kind: d for d in created}
    login = f"ssh {cluster.connection['ssh_user']}@{cluster.connection['login_host']}"
    slack_text = json.dumps(json.loads(by_kind["slack"].body)["blocks"])
    assert "*Access*" in slack_text and login in slack_text
    assert cluster.connection["slurm_reservation"] in slack_text
    data = json.loads(by_kind["webhook"].body)["data"]
    assert data["connection"] == cluster.connection and data["access"].startswith(login)


def test_a_platform_channel_subscribed_to_reminders_gets_them_for_tenants_without_channels(world, notify_settings):
    """Staff may tick a reminder on the platform channel (PORTAL_PLATFORM_SLACK_EVENTS, or the admin): the reminder
    sweep must then find every booking's reminder, not only those of tenants with a channel of their own."""
    notify_settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    notify_settings.PORTAL_PLATFORM_SLACK_EVENTS = [Event.RESERVATION_STARTING_1H]
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    soon = booking.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"],
                                      pool=world.pool, node_count=1, start=hour, end=hour + timedelta(hours=2))
    type(soon).objects.filter(pk=soon.pk).update(created_at=now - timedelta(days=1))
    assert not Channel.objects.filter(tenant=world.tenants["beta"]).exists()

    created = services.reminders_emit(now=now)

    assert [(d.event, d.tenant_id, d.channel.is_platform) for d in created] == [
        (Event.RESERVATION_STARTING_1H, None, True)]


def test_a_tenants_channel_reads_platform_staff_not_the_staff_account(world, t0, slack_for):
    """What platform staff did for a tenant (booked, changed, cancelled, sent a test message) reached the
    tenant's Slack and webhooks naming the staff account; the tenant reads "platform staff" (the audit
    rows keep the account)."""
    from django.contrib.auth import get_user_model

    channel = slack_for("alpha", SLACK_URL)
    ops = get_user_model().objects.create_user(username="ops-jane", password="pw-Long-enough-1", is_staff=True)
    reservation = booking.reservation_create(actor=ops, tenant=world.tenants["alpha"], pool=world.pool,
                                             node_count=1, start=t0, end=t0 + timedelta(hours=2), name="run")
    booking.reservation_update(actor=ops, reservation=reservation, end=t0 + timedelta(hours=3))
    deliveries = []
    for event in ("reservation.confirmed", "reservation.changed"):
        deliveries += services.event_fanout(event=event, payload={"reservation_id": reservation.pk})
    booking.reservation_cancel(actor=ops, reservation=reservation)
    deliveries += services.event_fanout(event="reservation.cancelled", payload={"reservation_id": reservation.pk})
    deliveries.append(services.channel_send_test(actor=ops, channel=channel))
    assert len(deliveries) == 4
    for delivery in deliveries:
        assert delivery.payload["actor"] == "platform staff", (delivery.event, delivery.payload)
        assert "ops-jane" not in delivery.body and "ops-jane" not in json.dumps(delivery.payload)
    # A teammate is still named.
    mine = book_as(world, "alpha-member", t0 + timedelta(days=1))
    (confirmed,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": mine.pk})
    assert confirmed.payload["actor"] == "alpha-member"


def book_as(world, who: str, start):
    return booking.reservation_create(actor=world.users[who], tenant=world.tenants[who.split("-")[0]],
                                      pool=world.pool, node_count=1, start=start, end=start + timedelta(hours=2))
