"""/metrics after a scripted scenario: book, burst, refuse, cancel, fail a node, a maintenance
window, queued Celery messages — then scrape with the test client, check every family's values,
and lint the exposition with the real `promtool check metrics`."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import redis
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.test import Client
from django.utils import timezone

from portal.core.exceptions import DomainError
from portal.core.instrument import timed_booking
from portal.ops import metrics
from reservations import services
from reservations.models import Allocation, Reservation
from reservations.timeutil import slot_floor
from tests.conftest import make_world, now_clear_of_the_hour

from .conftest import promtool_check, scrape

pytestmark = pytest.mark.django_db

GPUS = 8


def book(world, who, *, nodes, start, hours, on_commit):
    tenant = world.tenants[who.split("-")[0]]
    try:
        with on_commit(execute=True), timed_booking():
            return services.reservation_create(actor=world.users[who], tenant=tenant, pool=world.pool,
                                               node_count=nodes, start=start, end=start + timedelta(hours=hours))
    except DomainError as exc:
        return exc.code


def counter(name, **labels):
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def scenario(ops, settings, redis_server, django_capture_on_commit_callbacks):
    settings.CELERY_BROKER_URL = redis_server.url
    world = make_world(nodes=6, max_nodes=3, burst_nodes=1)
    before = {o: counter("portal_booking_requests_total", outcome=o) for o in metrics.BOOKING_OUTCOMES}
    # Domain events are counted in Redis (by every process): the values before come from a scrape.
    first = scrape(Client())
    events_before = first.value("portal_domain_events_total", event="reservation.confirmed") or 0.0
    cancelled_before = first.value("portal_domain_events_total", event="reservation.cancelled") or 0.0
    now = now_clear_of_the_hour()
    slot = slot_floor(now, 60)
    tomorrow = slot + timedelta(days=1)
    cc = django_capture_on_commit_callbacks
    # alpha: 2 nodes now (committed), then 2 more now (peak 4 > 3 guaranteed: burst).
    r1 = book(world, "alpha-lead", nodes=2, start=slot, hours=3, on_commit=cc)
    r2 = book(world, "alpha-lead", nodes=2, start=slot, hours=3, on_commit=cc)
    # beta: 2 nodes tomorrow for 10 h; then 5 tomorrow: not enough free nodes.
    r3 = book(world, "beta-lead", nodes=2, start=tomorrow, hours=10, on_commit=cc)
    refused = book(world, "beta-lead", nodes=3, start=tomorrow, hours=2, on_commit=cc)  # 2 + 3 > 3 + 1
    full = book(world, "alpha-lead", nodes=1, start=tomorrow, hours=2, on_commit=cc)  # fine, 1 node
    invalid = book(world, "beta-lead", nodes=1, start=tomorrow + timedelta(minutes=7), hours=1, on_commit=cc)
    capacity = book(world, "beta-member", nodes=3, start=slot, hours=1, on_commit=cc)  # 4 of 6 nodes are busy
    assert isinstance(r1, Reservation) and r1.billing == "committed"
    assert isinstance(r2, Reservation) and r2.billing == "burst"
    assert isinstance(r3, Reservation) and isinstance(full, Reservation)
    assert (refused, invalid) == ("quota_exceeded", "invalid")
    with cc(execute=True):
        services.reservation_cancel(actor=world.users["alpha-lead"], reservation=full)
    # A past, completed booking (12 node-hours in the last 24 h), written directly: services refuse the past.
    past = Reservation.objects.create(
        tenant=world.tenants["beta"], pool=world.pool, node_count=2, status="completed",
        period=DateTimeTZRange(slot - timedelta(hours=10), slot - timedelta(hours=4), "[)"),
    )
    for allocation in r1.allocations.all():  # nodes that stay in service
        Allocation.objects.create(reservation=past, node=allocation.node, period=past.period)
    free_now = [n for n in world.nodes if not Allocation.objects.filter(node=n, active=True,
                                                                       period__contains=now).exists()]
    # One of the two idle nodes fails; the other gets a maintenance window right now.
    with cc(execute=True):
        services.node_update(actor=world.users["staff"], node=free_now[0], state="failed", reason="XID 79")
    services.maintenance_window_create(actor=world.users["staff"], node=free_now[1], start=slot,
                                       end=slot + timedelta(hours=2))
    assert capacity == "capacity_unavailable"
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.rpush("health", *[b"m"] * 3)
    client.rpush("notifications\x06\x163", b"m")  # a priority-3 message counts for its queue too
    yield {"world": world, "before": before, "events_before": events_before,
           "cancelled_before": cancelled_before, "now": now, "slot": slot, "capacity": capacity,
           "failed": free_now[0], "maintained": free_now[1], "r3": r3}
    client.flushdb()
    client.close()


def test_metric_families_after_a_scripted_scenario(scenario):
    s = scrape(Client())
    pool = "h100"
    # Nodes by pool and state (every state present, zeros included).
    assert s.value("portal_nodes", pool=pool, state="available") == 5
    assert s.value("portal_nodes", pool=pool, state="failed") == 1
    assert s.value("portal_nodes", pool=pool, state="retired") == 0
    assert s.value("portal_pool_gpus_per_node", pool=pool, gpu_model="H100-SXM") == GPUS
    # GPUs now: 4 nodes reserved (r1 + r2), 1 failed, 1 in a maintenance window, 0 idle.
    assert s.value("portal_gpus", pool=pool, state="reserved") == 4 * GPUS
    assert s.value("portal_gpus", pool=pool, state="failed") == 1 * GPUS
    assert s.value("portal_gpus", pool=pool, state="unavailable") == 1 * GPUS
    assert s.value("portal_gpus", pool=pool, state="idle") == 0
    # Reservations by status and billing.
    assert s.value("portal_reservations", pool=pool, status="confirmed", billing="committed") == 2  # r1, r3
    assert s.value("portal_reservations", pool=pool, status="confirmed", billing="burst") == 1  # r2
    assert s.value("portal_reservations", pool=pool, status="cancelled", billing="committed") == 1
    assert s.value("portal_reservations", pool=pool, status="completed", billing="committed") == 1
    assert s.value("portal_reservations", pool=pool, status="active", billing="burst") == 0

    # Utilisation. In service: 5 nodes (the failed one is out); the maintenance window removes
    # its overlap; booked hours are clipped to each window.
    now, slot = scenario["now"], scenario["slot"]
    elapsed = (now - slot).total_seconds() / 3600  # of the current slot, at booking time
    maint_end = slot + timedelta(hours=2)
    last_booked = 12 + 4 * elapsed  # the past booking + r1/r2 since the slot began
    last_avail = 5 * 24 - elapsed
    # r1, r2 until they end + r3 tomorrow on those of its nodes still in service (not the failed one).
    r3_in_service = scenario["r3"].allocations.exclude(node=scenario["failed"]).count()
    next_booked = 4 * (3 - elapsed) + r3_in_service * 10
    next_avail = 5 * 168 - (maint_end - now).total_seconds() / 3600
    tol = 0.05  # the scrape happens a moment after `now`
    assert s.value("portal_pool_booked_nodes_average", pool=pool, window="last_24h") == pytest.approx(
        last_booked / 24, abs=tol)
    assert s.value("portal_pool_available_nodes_average", pool=pool, window="last_24h") == pytest.approx(
        last_avail / 24, abs=tol)
    assert s.value("portal_pool_utilization_ratio", pool=pool, window="last_24h") == pytest.approx(
        last_booked / last_avail, abs=0.01)
    assert s.value("portal_pool_utilization_ratio", pool=pool, window="next_7d") == pytest.approx(
        next_booked / next_avail, abs=0.001)
    assert 0 < s.value("portal_pool_utilization_ratio", pool=pool, window="next_7d") < 1

    # Booking outcomes and latency (process counters: compare with the values before the scenario).
    before = scenario["before"]
    created = s.value("portal_booking_requests_total", outcome="created") - before["created"]
    assert created == 4
    assert s.value("portal_booking_requests_total", outcome="quota_exceeded") - before["quota_exceeded"] == 1
    assert s.value("portal_booking_requests_total", outcome="invalid") - before["invalid"] == 1
    assert s.value("portal_booking_requests_total", outcome="capacity_unavailable") - before[
        "capacity_unavailable"] == 1
    assert s.value("portal_booking_duration_seconds_count", outcome="created") >= created
    assert s.value("portal_booking_duration_seconds_bucket", outcome="created", le="+Inf") == s.value(
        "portal_booking_duration_seconds_count", outcome="created")
    assert s.value("portal_booking_duration_seconds_sum", outcome="created") > 0
    # Domain events counted by the "*" subscriber, after commit.
    assert s.value("portal_domain_events_total", event="reservation.confirmed") - scenario["events_before"] == 4
    assert s.value("portal_domain_events_total", event="reservation.cancelled") - scenario[
        "cancelled_before"] == 1
    assert s.value("portal_domain_events_total", event="node.state_changed") >= 1

    # Celery queue depths straight from the broker (all priority lists of a queue summed).
    assert s.value("portal_celery_queue_length", queue="health") == 3
    assert s.value("portal_celery_queue_length", queue="notifications") == 1
    assert s.value("portal_celery_queue_length", queue="default") == 0
    assert s.value("portal_celery_queue_length", queue="provisioning") == 0
    # Every section could be read.
    for source in ("database", "broker", "fleet", "reservations", "provisioning", "health", "notifications"):
        assert s.value("portal_metrics_source_up", source=source) == 1, source

    # Prometheus' own parser and linter accept the exposition as it is.
    result = promtool_check(s.text)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


def test_http_requests_are_counted_by_url_name(ops):
    client = Client()
    before = counter("portal_http_requests_total", method="GET", view="ops-healthz", status="200")
    for _ in range(3):
        client.get("/healthz")
    client.get("/no-such-page")
    s = scrape(client)
    assert s.value("portal_http_requests_total", method="GET", view="ops-healthz", status="200") == before + 3
    assert s.value("portal_http_requests_total", method="GET", view="unmatched", status="404") >= 1
    # Scrapes themselves are not counted, so they cannot dominate the request rate.
    assert not [k for k in s.samples if k[0] == "portal_http_requests_total" and ("view", "ops-metrics") in k[1]]


def test_openmetrics_when_the_scraper_asks_for_it(ops):
    response = Client().get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


def test_a_dead_broker_costs_one_section_not_the_scrape(ops, settings):
    from .servers import free_port

    settings.CELERY_BROKER_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.PORTAL_READYZ_TIMEOUT = 0.5
    s = scrape(Client())
    assert s.value("portal_metrics_source_up", source="broker") == 0
    assert s.value("portal_metrics_source_up", source="database") == 1
    assert "portal_celery_queue_length" not in s.families


@pytest.mark.parametrize(
    ("token", "networks", "remote", "auth", "expected"),
    [
        ("", ["127.0.0.0/8"], "127.0.0.1", None, 200),
        ("", ["127.0.0.0/8"], "192.0.2.10", None, 403),
        ("", ["10.0.0.0/8", "::1/128"], "10.1.2.3", None, 200),
        ("s3cret-token", [], "127.0.0.1", None, 401),
        ("s3cret-token", [], "192.0.2.10", "Bearer s3cret-token", 200),
        ("s3cret-token", [], "192.0.2.10", "Bearer wrong", 401),
        ("s3cret-token", ["127.0.0.0/8"], "127.0.0.1", "Bearer wrong", 401),
        ("", [], "127.0.0.1", "Bearer anything", 403),  # no token configured: a header grants nothing
    ],
)
def test_metrics_access_by_token_or_network(ops, settings, token, networks, remote, auth, expected):
    settings.PORTAL_METRICS_TOKEN = token
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = networks
    headers = {"REMOTE_ADDR": remote, "HTTP_X_FORWARDED_FOR": "127.0.0.1"}  # a forged header changes nothing
    if auth:
        headers["HTTP_AUTHORIZATION"] = auth
    response = Client().get("/metrics", **headers)
    assert response.status_code == expected
    if expected == 401:
        assert response["WWW-Authenticate"].startswith("Bearer")
    if expected != 200:
        assert b"portal_" not in response.content


@pytest.mark.parametrize(("networks", "remote", "expected"), [
    (["127.0.0.0/8"], "::ffff:127.0.0.1", 200),
    (["10.0.0.0/8"], "::ffff:10.1.2.3", 200),
    (["10.0.0.0/8"], "::ffff:192.0.2.10", 403),
    (["::ffff:10.0.0.0/104"], "::ffff:10.1.2.3", 200),  # a mapped network listed as a workaround still works
])
def test_metrics_networks_match_an_ipv4_peer_on_a_dual_stack_socket(ops, settings, networks, remote, expected):
    """gunicorn bound to [::] (GUNICORN_BIND) sees an IPv4 scraper as ::ffff:a.b.c.d: the IPv4 network
    listed for it never matched (an IPv6 address is in no IPv4 network), so Prometheus got 403."""
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = networks
    assert Client().get("/metrics", REMOTE_ADDR=remote).status_code == expected


def test_observe_booking_maps_unknown_outcomes_to_error():
    before = counter("portal_booking_requests_total", outcome="error")
    metrics.observe_booking("something-new", 0.01)
    metrics.observe_booking("created", -1)  # clock skew never produces a negative observation
    assert counter("portal_booking_requests_total", outcome="error") == before + 1
    assert counter("portal_booking_requests_total", outcome="something-new") == 0


def test_every_known_status_is_a_series_at_zero_before_any_row(ops):
    """Families with a status or verdict label expose every value the models declare, at 0, so a
    panel or an alert on e.g. failed clusters reads 0 instead of "No data"."""
    from notifications.choices import ChannelKind, DeliveryStatus
    from provisioning.choices import ClusterStatus
    from provisioning.health.choices import CheckLevel, Verdict

    make_world(nodes=2)
    s = scrape(Client())
    for status in ClusterStatus.values:
        assert s.value("portal_virtual_clusters", status=status) == 0, status
    for level in CheckLevel.values:
        for verdict in [*Verdict.values, "pending"]:
            assert s.value("portal_health_checks", level=level, verdict=verdict) == 0, (level, verdict)
    for verdict in Verdict.values:
        assert s.value("portal_node_health", pool="h100", verdict=verdict) == 0, verdict
    for kind in ChannelKind.values:
        for status in DeliveryStatus.values:
            assert s.value("portal_notification_deliveries", channel=kind, status=status) == 0, (kind, status)
    result = promtool_check(s.text)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def other_app_rows(world) -> None:
    """Clusters with phase transitions, health checks, repairs and deliveries, written as fixtures."""
    from datetime import UTC

    from django.apps import apps

    VirtualCluster = apps.get_model("provisioning", "VirtualCluster")
    ClusterTransition = apps.get_model("provisioning", "ClusterTransition")
    HealthCheck = apps.get_model("health", "HealthCheck")
    Repair = apps.get_model("health", "Repair")
    Delivery = apps.get_model("notifications", "Delivery")

    slot = slot_floor(timezone.now(), 60) + timedelta(days=2)
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    phases = [("pending", 0), ("allocating_nodes", 4), ("configuring_network", 34), ("attaching_storage", 94),
              ("installing_drivers", 154), ("running_acceptance_tests", 754), ("ready", 1054)]
    for i in range(2):
        r = Reservation.objects.create(tenant=world.tenants["alpha"], pool=world.pool, node_count=1,
                                       period=DateTimeTZRange(slot + timedelta(hours=i), slot + timedelta(hours=i + 1),
                                                              "[)"))
        cluster = VirtualCluster.objects.create(
            reservation=r, tenant=r.tenant, backend="simulated", orchestrator="slurm", orchestrator_version="24.05",
            cuda_version="12.8", default_memory_per_gpu_gib=80, shared_storage_gib=100,
            status="ready" if i == 0 else "installing_drivers")
        for phase, seconds in phases[: len(phases) if i == 0 else 5]:
            ClusterTransition.objects.create(cluster=cluster, phase=phase, at=t0 + timedelta(seconds=seconds))
    node_a, node_b, node_c = world.nodes[:3]
    HealthCheck.objects.create(node=node_a, level="quick", trigger="schedule", status="done", verdict="pass",
                               finished_at=t0)
    HealthCheck.objects.create(node=node_a, level="quick", trigger="schedule", status="done", verdict="fail",
                               finished_at=t0 + timedelta(hours=1))
    HealthCheck.objects.create(node=node_b, level="medium", trigger="acceptance", status="done", verdict="warn",
                               finished_at=t0)
    HealthCheck.objects.create(node=node_c, level="quick", trigger="schedule", status="queued")
    Repair.objects.create(node=node_a, state="accepted", reason="XID 79")
    Repair.objects.create(node=node_b, state="rejoined", reason="ECC", closed_at=t0)
    for i, status in enumerate(["delivered", "delivered", "failed", "retrying"]):
        Delivery.objects.create(key=f"k{i}", kind="slack" if i < 3 else "webhook", event="reservation.confirmed",
                                message_id=f"m{i}", body="{}", status=status,
                                delivered_at=t0 if status == "delivered" else None)



def test_provisioning_health_and_notification_families_from_their_tables(ops):
    """The families of the other apps, read from their own tables (rows written directly as fixtures)."""
    other_app_rows(make_world(nodes=3))
    s = scrape(Client())
    assert s.value("portal_virtual_clusters", status="ready") == 1
    assert s.value("portal_virtual_clusters", status="installing_drivers") == 1
    # Durations per phase: time until the next phase began, over both clusters.
    assert s.value("portal_provisioning_phase_duration_seconds_count", phase="allocating_nodes") == 2
    assert s.value("portal_provisioning_phase_duration_seconds_sum", phase="allocating_nodes") == 60
    assert s.value("portal_provisioning_phase_duration_seconds_count", phase="installing_drivers") == 1
    assert s.value("portal_provisioning_phase_duration_seconds_sum", phase="installing_drivers") == 600
    assert s.value("portal_provisioning_phase_duration_seconds_bucket", phase="installing_drivers", le="300.0") == 0
    assert s.value("portal_provisioning_phase_duration_seconds_bucket", phase="installing_drivers", le="600.0") == 1
    assert s.value("portal_provisioning_phase_duration_seconds_count", phase="running_acceptance_tests") == 1
    assert s.value("portal_provisioning_phase_duration_seconds_count", phase="ready") is None  # not provisioning
    assert s.value("portal_health_checks", level="quick", verdict="pass") == 1
    assert s.value("portal_health_checks", level="quick", verdict="fail") == 1
    assert s.value("portal_health_checks", level="quick", verdict="pending") == 1
    assert s.value("portal_node_health", pool="h100", verdict="fail") == 1  # node a: its latest check failed
    assert s.value("portal_node_health", pool="h100", verdict="warn") == 1
    assert s.value("portal_node_health", pool="h100", verdict="pass") == 0  # no node's latest: 0, not absent
    assert s.value("portal_node_health", pool="h100", verdict="unknown") == 0
    assert s.value("portal_repairs_open") == 1
    assert s.value("portal_notification_deliveries", channel="slack", status="delivered") == 2
    assert s.value("portal_notification_deliveries", channel="slack", status="failed") == 1
    assert s.value("portal_notification_deliveries", channel="webhook", status="retrying") == 1
    # Statuses without a row are there at 0.
    assert s.value("portal_virtual_clusters", status="failed") == 0
    assert s.value("portal_health_checks", level="full", verdict="fail") == 0
    assert s.value("portal_health_checks", level="medium", verdict="warn") == 1
    assert s.value("portal_notification_deliveries", channel="webhook", status="delivered") == 0
    result = promtool_check(s.text)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
