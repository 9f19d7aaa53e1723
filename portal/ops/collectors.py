"""Collectors that read PostgreSQL and the Celery broker when /metrics is scraped.

Each section runs in its own savepoint with a statement timeout, so a slow or failing query
costs one section (reported by ``portal_metrics_source_up``), never the whole scrape. The sections
share one budget (SCRAPE_BUDGET_S, below Prometheus' scrape_timeout): however slow the database,
the scrape answers in time, with the sections it had no time left for reported down.

Families of apps that may not be installed or migrated yet (provisioning, health, notifications)
are looked up with ``apps.get_model`` and only emitted when their table exists, so this module
never imports upward in the dependency order (DESIGN §2) and keeps working while those apps grow.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Model
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from portal.core.broker import queue_lengths

__all__ = ["PortalCollector", "DEFAULT_QUEUES", "UTILIZATION_WINDOWS", "FAMILIES"]

logger = logging.getLogger(__name__)

DEFAULT_QUEUES = ("default", "provisioning", "health", "fleet", "notifications")
# name -> (offset of the window's start from now, length)
UTILIZATION_WINDOWS = {
    "last_24h": (timedelta(hours=-24), timedelta(hours=24)),
    "next_7d": (timedelta(0), timedelta(days=7)),
}
GPU_STATES = ("reserved", "idle", "failed", "unavailable")
# Up to 6 h: running_acceptance_tests can wait one check's timeout of the acceptance level (4 h for
# "full", PORTAL_HEALTH_TIMEOUT_FULL) and a retry.
PHASE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 10800, 14400, 21600)
# The virtual-cluster phases whose durations are provisioning work (DESIGN §5), plus teardown. Not
# "pending": a cluster is pending from the booking until provisioning starts (PORTAL_PROVISION_LEAD_MINUTES
# before the window), so its duration is the booking's lead time, days or weeks, not work.
PROVISIONING_PHASES = (
    "allocating_nodes", "configuring_network", "attaching_storage", "installing_drivers",
    "running_acceptance_tests", "tearing_down",
)
# Repair records in one of these states are no longer open (health.choices.OPEN_REPAIR_STATES is
# the authority when that app is installed).
CLOSED_REPAIR_STATES = frozenset({"rejoined", "failed", "closed", "cancelled"})
STATEMENT_TIMEOUT_MS = 5000
# The whole scrape's time: every section's statement timeout (and Redis read) is cut to what is left
# of it, and a section that finds it spent is reported down unread. Six slow sections at
# STATEMENT_TIMEOUT_MS each would otherwise run past Prometheus' scrape_timeout (10 s,
# deploy/prometheus.yml), losing the whole scrape, and hold a web worker towards gunicorn's timeout.
SCRAPE_BUDGET_S = 8.0
MIN_SECTION_MS = 50  # less than this left: the section is skipped, not started

# Every family /metrics can expose: name -> (type, when). "always": every scrape; otherwise the
# app whose tables must exist (provisioning, notifications) or the source that must answer.
# Dashboards may only query these (tests/ops/test_deploy.py checks it).
FAMILIES = {
    "portal_booking_requests": ("counter", "always"),
    "portal_booking_duration_seconds": ("histogram", "always"),
    "portal_domain_events": ("counter", "redis, after the first event"),
    "portal_http_requests": ("counter", "after the first request"),
    "portal_http_request_duration_seconds": ("histogram", "after the first request"),
    "portal_metrics_source_up": ("gauge", "always"),
    "portal_metrics_collect_duration_seconds": ("gauge", "always"),
    "portal_celery_queue_length": ("gauge", "broker"),
    "portal_pool_gpus_per_node": ("gauge", "always"),
    "portal_nodes": ("gauge", "always"),
    "portal_gpus": ("gauge", "always"),
    "portal_pool_booked_nodes_average": ("gauge", "always"),
    "portal_pool_available_nodes_average": ("gauge", "always"),
    "portal_pool_utilization_ratio": ("gauge", "always"),
    "portal_reservations": ("gauge", "always"),
    "portal_usage_gpu_seconds": ("gauge", "always"),
    "portal_virtual_clusters": ("gauge", "provisioning"),
    "portal_virtual_cluster_failures_last_hour": ("gauge", "provisioning"),
    "portal_provisioning_phase_duration_seconds": ("histogram", "provisioning"),
    "portal_node_drains_unfinished": ("gauge", "provisioning"),
    "portal_node_drain_oldest_age_seconds": ("gauge", "provisioning"),
    "portal_health_checks": ("gauge", "provisioning"),
    "portal_node_health": ("gauge", "provisioning"),
    "portal_health_agents_not_answering": ("gauge", "provisioning"),
    "portal_repairs_open": ("gauge", "provisioning"),
    "portal_notification_deliveries": ("gauge", "notifications"),
    "portal_notification_deliveries_last_hour": ("gauge", "notifications"),
    "portal_notification_failures_last_hour": ("gauge", "notifications"),
    "portal_notification_deliveries_retrying_over_an_hour": ("gauge", "notifications"),
    "portal_outbox_events": ("gauge", "always"),
    "portal_outbox_oldest_age_seconds": ("gauge", "always"),
}


def _setting(name: str, default):
    return getattr(settings, name, default)


def _optional_model(app_label: str, *names: str) -> type[Model] | None:
    for name in names:
        try:
            return apps.get_model(app_label, name)
        except LookupError:
            continue
    return None


def _field(model: type[Model], *names: str) -> str | None:
    concrete = {f.name: f for f in model._meta.concrete_fields}
    for name in names:
        if name in concrete:
            return concrete[name].column
    return None


def _q(identifier: str) -> str:
    return connection.ops.quote_name(identifier)


class _Section:
    """Run one group of queries; on failure report the source as down instead of failing the scrape."""

    def __init__(self, up: GaugeMetricFamily, took: GaugeMetricFamily, name: str, deadline: float) -> None:
        self.up, self.took, self.name, self.deadline = up, took, name, deadline

    def run(self, fn) -> list[Metric]:
        started = time.perf_counter()
        left_ms = int((self.deadline - time.monotonic()) * 1000)
        if left_ms < MIN_SECTION_MS:
            logger.warning("metrics section %s skipped: the scrape's %s s budget is spent", self.name,
                           SCRAPE_BUDGET_S)
            self.up.add_metric([self.name], 0)
            self.took.add_metric([self.name], 0.0)
            return []
        try:
            with transaction.atomic():
                with connection.cursor() as cur:
                    cur.execute(f"SET LOCAL statement_timeout = {min(STATEMENT_TIMEOUT_MS, left_ms)}")
                metrics = list(fn())
        except DatabaseError as exc:
            logger.warning("metrics section %s failed: %s", self.name, exc.__class__.__name__, exc_info=True)
            self.up.add_metric([self.name], 0)
            return []
        finally:
            self.took.add_metric([self.name], time.perf_counter() - started)
        self.up.add_metric([self.name], 1)
        return metrics


class PortalCollector:
    """Fleet, GPU, utilisation, reservation, provisioning, health, notification and queue families."""

    def describe(self) -> Iterable[Metric]:
        return []  # never query the database at registration time

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("portal_metrics_source_up", "1 when this section of the scrape could be read.",
                               labels=["source"])
        took = GaugeMetricFamily("portal_metrics_collect_duration_seconds",
                                 "Time spent reading this section of the scrape.", labels=["source"])
        deadline = time.monotonic() + SCRAPE_BUDGET_S
        yield from _queue_depths(up, took, deadline)
        yield from _event_counts(up, took, deadline)
        now = timezone.now()
        try:
            tables = set(connection.introspection.table_names())
        except DatabaseError as exc:
            logger.warning("metrics: database unreachable: %s", exc.__class__.__name__)
            up.add_metric(["database"], 0)
            yield up
            yield took
            return
        up.add_metric(["database"], 1)
        sections = [
            ("fleet", lambda: self._fleet(now)),
            ("reservations", self._reservations),
            ("usage", lambda: self._usage(now)),
            ("provisioning", lambda: self._provisioning(tables)),
            ("health", lambda: self._health(tables)),
            ("notifications", lambda: self._notifications(tables)),
            ("events", self._events),
        ]
        for name, fn in sections:
            yield from _Section(up, took, name, deadline).run(fn)
        yield up
        yield took

    # --- fleet ------------------------------------------------------------------------------

    def _fleet(self, now: datetime) -> Iterator[Metric]:
        from reservations.choices import NodeState
        from reservations.models import Allocation, Node, Pool

        pools = list(Pool.objects.order_by("name").values_list("id", "name", "gpu_model", "gpus_per_node"))
        names = {pid: name for pid, name, _, _ in pools}
        per_node = GaugeMetricFamily("portal_pool_gpus_per_node", "GPUs in each node of the pool.",
                                     labels=["pool", "gpu_model"])
        for _, name, model, gpus in pools:
            per_node.add_metric([name, model], gpus)
        yield per_node

        nodes = GaugeMetricFamily("portal_nodes", "Nodes by pool and state.", labels=["pool", "state"])
        counts: dict[tuple[int, str], int] = defaultdict(int)
        for pool_id, state, count in _rows(
            f"SELECT pool_id, state, count(*) FROM {_q(Node._meta.db_table)} GROUP BY 1, 2"  # noqa: S608
        ):
            counts[(pool_id, state)] = count
        for pid, name, _, _ in pools:
            for state in NodeState.values:
                nodes.add_metric([name, state], counts[(pid, state)])
        yield nodes

        node_t, alloc_t = _q(Node._meta.db_table), _q(Allocation._meta.db_table)
        # Every non-retired GPU is in exactly one state, in this order of precedence:
        # failed (node failed), reserved (a reservation holds the node now), unavailable
        # (draining, maintenance, or inside a maintenance window), idle (bookable, unused).
        gpus = GaugeMetricFamily("portal_gpus", "GPUs of non-retired nodes by pool and what they are doing now.",
                                 labels=["pool", "state"])
        gpu_counts: dict[tuple[int, str], int] = defaultdict(int)
        for pool_id, state, count in _rows(
            f"""
            WITH cur AS (
                SELECT node_id, bool_or(kind = 'reservation') AS reserved, bool_or(kind = 'maintenance') AS maint
                FROM {alloc_t} WHERE active AND period @> %(now)s::timestamptz GROUP BY node_id
            )
            SELECT n.pool_id,
                   CASE WHEN n.state = 'failed' THEN 'failed'
                        WHEN coalesce(cur.reserved, false) THEN 'reserved'
                        WHEN n.state <> 'available' OR coalesce(cur.maint, false) THEN 'unavailable'
                        ELSE 'idle' END,
                   count(*)
            FROM {node_t} n LEFT JOIN cur ON cur.node_id = n.id
            WHERE n.state <> 'retired'
            GROUP BY 1, 2
            """,  # noqa: S608
            {"now": now},
        ):
            gpu_counts[(pool_id, state)] = count
        for pid, name, _, per in pools:
            for state in GPU_STATES:
                gpus.add_metric([name, state], gpu_counts[(pid, state)] * per)
        yield gpus

        yield from self._utilization(now, pools, names, node_t, alloc_t)

    def _utilization(self, now, pools, names, node_t, alloc_t) -> Iterator[Metric]:
        """Booked node-hours ÷ available node-hours per pool, for each window.

        Available: nodes in service now (available or draining) over the whole window, less
        their maintenance windows. Booked: active reservation allocations on those nodes,
        clipped to the window. Both are exported as average node counts over the window
        (node-hours ÷ window hours), so they read as "nodes" on a dashboard.
        """
        booked = GaugeMetricFamily("portal_pool_booked_nodes_average",
                                   "Average number of in-service nodes held by reservations over the window.",
                                   labels=["pool", "window"])
        available = GaugeMetricFamily("portal_pool_available_nodes_average",
                                      "Average number of in-service nodes outside maintenance over the window.",
                                      labels=["pool", "window"])
        ratio = GaugeMetricFamily("portal_pool_utilization_ratio",
                                  "Booked node-hours divided by available node-hours over the window (0-1).",
                                  labels=["pool", "window"])
        in_service = dict(_rows(
            f"SELECT pool_id, count(*) FROM {node_t} WHERE state IN ('available', 'draining') GROUP BY 1"  # noqa: S608
        ))
        hours: dict[tuple[int, str, str], float] = defaultdict(float)
        for window, (offset, length) in UTILIZATION_WINDOWS.items():
            lo, hi = now + offset, now + offset + length
            for pool_id, kind, seconds in _rows(
                f"""
                SELECT n.pool_id, a.kind,
                       sum(date_part('epoch', least(upper(a.period), %(hi)s::timestamptz)
                                              - greatest(lower(a.period), %(lo)s::timestamptz)))
                FROM {alloc_t} a JOIN {node_t} n ON n.id = a.node_id
                WHERE a.active AND a.period && tstzrange(%(lo)s, %(hi)s) AND n.state IN ('available', 'draining')
                GROUP BY 1, 2
                """,  # noqa: S608
                {"lo": lo, "hi": hi},
            ):
                hours[(pool_id, window, kind)] = float(seconds or 0) / 3600
        for pid, name, _, _ in pools:
            for window, (_, length) in UTILIZATION_WINDOWS.items():
                window_h = length.total_seconds() / 3600
                avail_h = in_service.get(pid, 0) * window_h - hours[(pid, window, "maintenance")]
                booked_h = hours[(pid, window, "reservation")]
                booked.add_metric([name, window], booked_h / window_h)
                available.add_metric([name, window], max(avail_h, 0.0) / window_h)
                ratio.add_metric([name, window], booked_h / avail_h if avail_h > 0 else 0.0)
        yield booked
        yield available
        yield ratio

    # --- reservations -----------------------------------------------------------------------

    def _reservations(self) -> Iterator[Metric]:
        from reservations.choices import Billing, ReservationStatus
        from reservations.models import Pool, Reservation

        family = GaugeMetricFamily("portal_reservations", "Reservations by pool, status and billing.",
                                   labels=["pool", "status", "billing"])
        counts: dict[tuple[int, str, str], int] = defaultdict(int)
        for pool_id, status, billing, count in _rows(
            f"SELECT pool_id, status, billing, count(*) FROM {_q(Reservation._meta.db_table)} "  # noqa: S608
            "GROUP BY 1, 2, 3"
        ):
            counts[(pool_id, status, billing)] = count
        for pid, name in Pool.objects.order_by("name").values_list("id", "name"):
            for status in ReservationStatus.values:
                for billing in Billing.values:
                    family.add_metric([name, status, billing], counts[(pid, status, billing)])
        yield family

    # --- usage ------------------------------------------------------------------------------

    def _usage(self, now: datetime) -> Iterator[Metric]:
        """GPU-hours used so far this UTC calendar month per tenant, pool and billing, in GPU-seconds (Prometheus'
        base unit; a panel divides by 3600): the usage statement's
        "used" columns, from its own SQL (selectors.USAGE_SQL: each booking at the GPUs per node it was booked
        at), with the names joined in — one statement. Its cost is bounded by this month's allocations (read
        through the period index); its series by the tenant-pool pairs with a quota or a booking this month,
        x 2 billings. A month-to-date gauge: it falls back to 0 when a month begins."""
        from reservations.models import Pool
        from reservations.selectors import USAGE_SQL
        from reservations.usage import parse_month
        from tenants.models import Quota, Tenant

        month = parse_month(None, now=now)
        family = GaugeMetricFamily(
            "portal_usage_gpu_seconds",
            "GPU-seconds held so far this UTC calendar month, by tenant, pool and billing (the usage statement's "
            "GPU-hours x 3600).",
            labels=["tenant", "pool", "billing"])
        # Every tenant with a quota in a pool has its two series, at 0 before any booking (a panel reads 0,
        # not "No data"), and so has any other pair with hours this month.
        for slug, pool, committed, burst in _rows(
            f"""
            WITH u AS (
                SELECT tenant_id, pool_id, sum(committed_used * gpus_per_node) AS committed,
                       sum(burst_used * gpus_per_node) AS burst
                FROM ({USAGE_SQL}) AS usage (tenant_id, pool_id, gpus_per_node, on_demand_rate, first_start,
                                            committed_used, burst_used, committed_ahead, burst_ahead)
                GROUP BY tenant_id, pool_id
            ), pairs AS (
                SELECT tenant_id, pool_id FROM {_q(Quota._meta.db_table)} UNION SELECT tenant_id, pool_id FROM u
            )
            SELECT t.slug, p.name, coalesce(u.committed, 0), coalesce(u.burst, 0)
            FROM pairs JOIN {_q(Tenant._meta.db_table)} t ON t.id = pairs.tenant_id
            JOIN {_q(Pool._meta.db_table)} p ON p.id = pairs.pool_id
            LEFT JOIN u ON u.tenant_id = pairs.tenant_id AND u.pool_id = pairs.pool_id
            ORDER BY t.slug, p.name
            """,  # noqa: S608
            {"start": month.start, "end": month.end, "now": now, "tenants": None},
        ):
            family.add_metric([slug, pool, "committed"], float(committed) * 3600)
            family.add_metric([slug, pool, "burst"], float(burst) * 3600)
        yield family

    # --- apps that may not exist yet --------------------------------------------------------

    def _provisioning(self, tables: set[str]) -> Iterator[Metric]:
        cluster = _optional_model("provisioning", "VirtualCluster", "Cluster")
        if cluster is None or cluster._meta.db_table not in tables:
            return
        status = _field(cluster, "status", "phase", "state")
        if status:
            family = GaugeMetricFamily("portal_virtual_clusters", "Virtual clusters by status.", labels=["status"])
            # Every declared status appears, at 0 without clusters: a panel reads 0, not "No data".
            _add_counts(family, [(value,) for value in _choices(cluster, status)], (
                ((str(value),), count) for value, count in _rows(
                    f"SELECT {_q(status)}, count(*) FROM {_q(cluster._meta.db_table)} GROUP BY 1"  # noqa: S608
                )))
            yield family
            yield from self._recent_failures(cluster, tables)
        yield from self._phase_durations(cluster, tables)
        yield from self._unfinished_drains(tables)

    def _unfinished_drains(self, tables: set[str]) -> Iterator[Metric]:
        """Drains a backend could not finish yet (the tick drives them on): how many, and the oldest's age."""
        drain = _optional_model("provisioning", "NodeDrain")
        if drain is None or drain._meta.db_table not in tables:
            return
        (count, oldest), = _rows(
            f"SELECT count(*), coalesce(extract(epoch FROM now() - min(since)), 0) "  # noqa: S608
            f"FROM {_q(drain._meta.db_table)}")
        family = GaugeMetricFamily("portal_node_drains_unfinished",
                                   "Out-of-service nodes whose drain has not completed yet (tried again).", labels=[])
        family.add_metric([], count)
        yield family
        family = GaugeMetricFamily("portal_node_drain_oldest_age_seconds",
                                   "How long the oldest unfinished drain has been unfinished (0 when none).",
                                   labels=[])
        family.add_metric([], float(oldest))
        yield family

    def _recent_failures(self, cluster: type[Model], tables: set[str]) -> Iterator[Metric]:
        """Clusters that entered the failed phase in the last hour, from the transition log.

        A failed cluster leaves the failed state when its window ends (torn down): a delta() over
        portal_virtual_clusters{status="failed"} reads an old one torn down and a new failure as no change.
        """
        log = _transition_log(cluster, tables)
        if log is None:
            return
        model, _, phase, at = log
        (count,), = _rows(
            f"SELECT count(*) FROM {_q(model._meta.db_table)} "  # noqa: S608
            f"WHERE {_q(phase)} = 'failed' AND {_q(at)} > clock_timestamp() - interval '1 hour'"
        )
        family = GaugeMetricFamily("portal_virtual_cluster_failures_last_hour",
                                   "Virtual clusters that entered the failed state in the last hour.")
        family.add_metric([], count)
        yield family

    def _phase_durations(self, cluster: type[Model], tables: set[str]) -> Iterator[Metric]:
        """Histogram of how long clusters spent in each phase, from the recorded phase timestamps.

        Understands the two shapes a phased status can be recorded in: a transition log model
        (cluster FK + phase + timestamp, one row per phase entered) or one ``<phase>_at`` column
        per phase on the cluster. A phase's duration is the time until the next phase began.
        """
        log = _transition_log(cluster, tables)
        if log is not None:
            # Summed in the database: the log is never pruned, and a scrape reads a row per phase.
            stats = _phase_stats_from_log(*log)
        else:
            timelines = _timelines_from_columns(cluster)
            if timelines is None:
                return
            stats = _phase_stats(timelines)
        family = HistogramMetricFamily("portal_provisioning_phase_duration_seconds",
                                       "Time virtual clusters spent in each provisioning phase.", labels=["phase"])
        for phase in sorted(stats):
            counts, total, observed = stats[phase]
            buckets = [(str(float(b)), count) for b, count in zip(PHASE_BUCKETS, counts, strict=True)]
            buckets.append(("+Inf", observed))
            family.add_metric([phase], buckets, sum_value=total)
        yield family

    def _health(self, tables: set[str]) -> Iterator[Metric]:
        check = _optional_model("health", "HealthCheck") or _optional_model("provisioning", "HealthCheck")
        if check is not None and check._meta.db_table in tables:
            verdict, level = _field(check, "verdict"), _field(check, "level")
            node = _field(check, "node")
            if verdict:
                family = GaugeMetricFamily("portal_health_checks", "Recorded GPU health checks by level and verdict.",
                                           labels=["level", "verdict"])
                level_sql = _q(level) if level else "''"
                # Every level and verdict (and pending) appears, at 0 when no check has it.
                zeros = [(lvl, value) for lvl in (_choices(check, level) or [""])
                         for value in [*_choices(check, verdict), "pending"]]
                rows = _rows(
                    f"SELECT {level_sql}, {_q(verdict)}, count(*) FROM {_q(check._meta.db_table)} "  # noqa: S608
                    "GROUP BY 1, 2"
                )
                # A check without a verdict yet is queued or running.
                _add_counts(family, zeros,
                            (((str(lvl or ""), str(value or "pending")), count) for lvl, value, count in rows))
                yield family
            if verdict and node:
                yield from self._latest_verdicts(check, node, verdict)
                yield from self._silent_agents(check, node)
        repair = _optional_model("health", "Repair") or _optional_model("provisioning", "Repair", "NodeRepair")
        if repair is not None and repair._meta.db_table in tables:
            status = _field(repair, "status", "state", "phase")
            family = GaugeMetricFamily("portal_repairs_open", "Node repairs not yet closed.", labels=[])
            if status:
                (count,), = _rows(
                    f"SELECT count(*) FROM {_q(repair._meta.db_table)} "  # noqa: S608
                    f"WHERE {_q(status)} = ANY(%(open)s)",
                    {"open": _open_repair_states(repair, status)},
                )
            else:
                (count,), = _rows(f"SELECT count(*) FROM {_q(repair._meta.db_table)}")  # noqa: S608
            family.add_metric([], count)
            yield family

    def _latest_verdicts(self, check: type[Model], node: str, verdict: str) -> Iterator[Metric]:
        from reservations.models import Node, Pool

        order = _field(check, "finished_at", "completed_at", "created_at", "started_at") or "id"
        # Only checks that reached a verdict; the newest finished one per node wins. Retired nodes have
        # left the fleet (as in portal_gpus): a replaced node's last failure must not count forever.
        family = GaugeMetricFamily("portal_node_health",
                                   "Non-retired nodes by pool and the verdict of their latest health check.",
                                   labels=["pool", "verdict"])
        # Every pool and verdict appears, at 0 when no node's latest check has it.
        zeros = [(pool, value) for pool in Pool.objects.order_by("name").values_list("name", flat=True)
                 for value in _choices(check, verdict)]
        # One probe per node (LATERAL ... LIMIT 1; the health app's health_check_node_verdict index serves
        # it), not a DISTINCT ON sorting every check ever run on each scrape.
        rows = _rows(
            f"""
            SELECT p.name, latest.v, count(*)
            FROM {_q(Node._meta.db_table)} n
            JOIN {_q(Pool._meta.db_table)} p ON p.id = n.pool_id
            CROSS JOIN LATERAL (
                SELECT {_q(verdict)} AS v FROM {_q(check._meta.db_table)} c
                WHERE c.{_q(node)} = n.id AND c.{_q(verdict)} <> ''
                ORDER BY c.{_q(order)} DESC NULLS LAST, c.id DESC LIMIT 1
            ) latest
            WHERE n.state <> 'retired'
            GROUP BY 1, 2
            """  # noqa: S608
        )
        _add_counts(family, zeros, (((pool, str(value)), count) for pool, value, count in rows))
        yield family

    def _silent_agents(self, check: type[Model], node: str) -> Iterator[Metric]:
        """Non-retired nodes whose latest finished check was never picked up by an agent (it expired
        unanswered, or the sweep held it back because the node's queue still held the previous one): one
        database query, no broker call per node."""
        from reservations.models import Node

        status, started, finished = (_field(check, "status"), _field(check, "started_at"),
                                     _field(check, "finished_at"))
        if not (status and started and finished):
            return
        (count,), = _rows(
            f"""
            SELECT count(*) FROM (
                SELECT DISTINCT ON ({_q(node)}) {_q(node)} AS node_id, {_q(status)} AS s, {_q(started)} AS st
                FROM {_q(check._meta.db_table)} WHERE {_q(finished)} IS NOT NULL
                ORDER BY {_q(node)}, {_q(finished)} DESC, id DESC
            ) latest
            JOIN {_q(Node._meta.db_table)} n ON n.id = latest.node_id AND n.state <> 'retired'
            WHERE latest.s = 'error' AND latest.st IS NULL
            """  # noqa: S608
        )
        family = GaugeMetricFamily("portal_health_agents_not_answering",
                                   "Non-retired nodes whose health agent did not pick up their latest check.",
                                   labels=[])
        family.add_metric([], count)
        yield family

    def _notifications(self, tables: set[str]) -> Iterator[Metric]:
        delivery = _optional_model("notifications", "Delivery", "NotificationDelivery", "DeliveryLog",
                                   "WebhookDelivery", "Notification")
        if delivery is None or delivery._meta.db_table not in tables:
            return
        status = _field(delivery, "status", "state", "outcome")
        channel = _field(delivery, "channel_kind", "transport", "kind", "channel_type", "target_kind", "channel")
        if not status:
            return
        family = GaugeMetricFamily("portal_notification_deliveries",
                                   "Notification deliveries by channel kind and status (delivered, failed, pending…).",
                                   labels=["channel", "status"])
        channel_sql = _q(channel) if channel else "''"
        # Every channel kind and status appears, at 0 when no delivery has it.
        zeros = [(c, v) for c in (_choices(delivery, channel) or [""]) for v in _choices(delivery, status)]
        _add_counts(family, zeros, (((str(chan or ""), str(value or "")), count) for chan, value, count in _rows(
            f"SELECT {channel_sql}, {_q(status)}, count(*) FROM {_q(delivery._meta.db_table)} "  # noqa: S608
            "GROUP BY 1, 2"
        )))
        yield family
        created = _field(delivery, "created_at")
        if not created:
            return
        # New deliveries need a window of their own: a delta() over the gauge above reads a delivery
        # moving from pending to delivered as -1 pending, and the prune of old ones cancels new ones.
        recent = GaugeMetricFamily("portal_notification_deliveries_last_hour",
                                   "Deliveries created in the last hour, by channel kind and the status they have now.",
                                   labels=["channel", "status"])
        zeros = [(c, v) for c in _choices(delivery, channel) for v in _choices(delivery, status)]
        _add_counts(recent, zeros, (((str(chan or ""), str(value or "")), count) for chan, value, count in _rows(
            f"SELECT {channel_sql}, {_q(status)}, count(*) FROM {_q(delivery._meta.db_table)} "  # noqa: S608
            f"WHERE {_q(created)} > clock_timestamp() - interval '1 hour' GROUP BY 1, 2"
        )), ordered=True)
        yield recent
        updated = _field(delivery, "updated_at")
        if not updated:
            return
        table, channels = _q(delivery._meta.db_table), [(c,) for c in _choices(delivery, channel)]
        # A lead's test message ("Send test message") is the team's check of its own receiver, told on its page, and
        # given up within a minute: not a delivery lost or late, which is what the two alerts on these are about.
        event = _field(delivery, "event")
        not_a_test = f" AND {_q(event)} <> 'test'" if event else ""

        def by_channel(name: str, documentation: str, where: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["channel"])
            rows = _rows(f"SELECT {channel_sql}, count(*) FROM {table} WHERE {where}{not_a_test} GROUP BY 1")  # noqa: S608
            _add_counts(family, channels, (((str(chan or ""),), count) for chan, count in rows), ordered=True)
            return family

        # Failed in the last hour, whenever created: a message retried for a day (PORTAL_NOTIFY_RETRY_HOURS) fails
        # a day after it was made, out of the window above.
        yield by_channel("portal_notification_failures_last_hour",
                         "Deliveries that failed in the last hour (refused for good, or out of retries), "
                         "by channel kind (test messages left out).",
                         f"{_q(status)} = 'failed' AND {_q(updated)} > clock_timestamp() - interval '1 hour'")
        # Still trying an hour after it was made: a receiver that is down now (retries go on for a day, so the
        # failure above would tell an operator a day late).
        yield by_channel("portal_notification_deliveries_retrying_over_an_hour",
                         "Deliveries not yet delivered, failed or skipped, made over an hour ago, by channel kind "
                         "(test messages left out).",
                         f"{_q(status)} IN ('pending', 'sending', 'retrying')"
                         f" AND {_q(created)} < clock_timestamp() - interval '1 hour'")

    # --- domain events ----------------------------------------------------------------------

    def _events(self) -> Iterator[Metric]:
        from portal.core.events import OUTBOX_MAX_ATTEMPTS

        # Stuck events are counted apart and kept out of the age: one of them must not pin the
        # backlog gauge. clock_timestamp(), not now(): the scrape may run inside a transaction.
        pending, stuck, oldest = _rows(
            "SELECT count(*) FILTER (WHERE attempts < %(max)s), count(*) FILTER (WHERE attempts >= %(max)s),"
            " coalesce(extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE attempts < %(max)s)), 0)"
            " FROM core_outboxevent",
            {"max": OUTBOX_MAX_ATTEMPTS},
        )[0]
        family = GaugeMetricFamily(
            "portal_outbox_events",
            "Domain events waiting for their background subscribers (stuck: claimed too often, left for an operator).",
            labels=["state"])
        family.add_metric(["pending"], pending)
        family.add_metric(["stuck"], stuck)
        yield family
        yield GaugeMetricFamily("portal_outbox_oldest_age_seconds",
                                "Age of the oldest domain event waiting in the outbox, stuck ones aside (0 when none).",
                                value=float(oldest))


def _add_counts(family: GaugeMetricFamily, zeros: Iterable[tuple[str, ...]],
                counted: Iterable[tuple[tuple[str, ...], int]], *, ordered: bool = False) -> None:
    """Add each label tuple of zeros at 0, then each counted one with its count over it: a known status
    reads 0 on a panel, never "No data". ordered sorts the series by their labels."""
    counts = dict.fromkeys(zeros, 0)
    counts.update(counted)
    for labels, count in (sorted(counts.items()) if ordered else counts.items()):
        family.add_metric(list(labels), count)


def _choices(model: type[Model], column: str | None) -> list[str]:
    """The values a column's field declares (its choices), so each appears at 0 too; none without any."""
    field = next((f for f in model._meta.concrete_fields if f.column == column), None)
    return [str(value) for value, _ in (field.choices or [])] if field is not None else []


def _open_repair_states(repair: type[Model], column: str) -> list[str]:
    try:
        from importlib import import_module

        states = import_module(f"{repair._meta.app_config.name}.choices").OPEN_REPAIR_STATES
        return [str(s) for s in states]
    except (ImportError, AttributeError):
        field = next(f for f in repair._meta.concrete_fields if f.column == column)
        return [value for value, _ in field.choices or [] if value not in CLOSED_REPAIR_STATES]


def _transition_log(cluster: type[Model], tables: set[str]) -> tuple[type[Model], str, str, str] | None:
    """The cluster's transition log model (cluster FK + phase + timestamp) and those three columns."""
    for model in apps.get_app_config(cluster._meta.app_label).get_models():
        if model is cluster or model._meta.db_table not in tables:
            continue
        fk = next((f for f in model._meta.concrete_fields
                   if f.is_relation and f.related_model is cluster), None)
        phase = _field(model, "phase", "to_phase")
        at = _field(model, "at", "entered_at", "timestamp")
        if fk is None or phase is None or at is None:
            continue
        return model, fk.column, phase, at
    return None


# phase -> (observations at or under each of PHASE_BUCKETS, sum of the durations, observations)
PhaseStats = dict[str, tuple[list[int], float, int]]


def _phase_stats_from_log(model: type[Model], fk: str, phase: str, at: str) -> PhaseStats:
    """Each provisioning phase's histogram from the transition log, summed by PostgreSQL: a phase
    lasted until the cluster's next transition (by time, then id)."""
    pk = model._meta.pk.column
    buckets = ", ".join(f"count(*) FILTER (WHERE d <= {float(b)})" for b in PHASE_BUCKETS)
    rows = _rows(
        f"""
        SELECT phase, {buckets}, coalesce(sum(d), 0), count(*) FROM (
            SELECT phase, greatest(extract(epoch FROM next_at - at), 0) AS d FROM (
                SELECT {_q(phase)} AS phase, {_q(at)} AS at,
                       lead({_q(at)}) OVER (PARTITION BY {_q(fk)} ORDER BY {_q(at)}, {_q(pk)}) AS next_at
                FROM {_q(model._meta.db_table)} WHERE {_q(at)} IS NOT NULL
            ) timeline
            WHERE next_at IS NOT NULL AND phase = ANY(%(phases)s)
        ) durations
        GROUP BY phase
        """,  # noqa: S608
        {"phases": list(PROVISIONING_PHASES)},
    )
    n = len(PHASE_BUCKETS)
    return {str(row[0]): (list(row[1:n + 1]), float(row[n + 1]), int(row[n + 2])) for row in rows}


def _phase_stats(timelines: list[list[tuple[str, datetime]]]) -> PhaseStats:
    observations: dict[str, list[float]] = defaultdict(list)
    for entries in timelines:
        entries = sorted((at, phase) for phase, at in entries if at is not None)
        for (at, phase), (next_at, _) in zip(entries, entries[1:], strict=False):
            if phase in PROVISIONING_PHASES:
                observations[phase].append(max(0.0, (next_at - at).total_seconds()))
    return {phase: ([sum(1 for v in values if v <= b) for b in PHASE_BUCKETS], sum(values), len(values))
            for phase, values in observations.items()}


def _timelines_from_columns(cluster: type[Model]) -> list[list[tuple[str, datetime]]] | None:
    columns = [f for f in cluster._meta.concrete_fields
               if f.get_internal_type() == "DateTimeField" and f.name.endswith("_at")
               and f.name not in ("created_at", "updated_at", "deleted_at")]
    if len(columns) < 2:
        return None
    names = [f.name[: -len("_at")] for f in columns]
    select = ", ".join(_q(f.column) for f in columns)
    return [list(zip(names, row, strict=True))
            for row in _rows(f"SELECT {select} FROM {_q(cluster._meta.db_table)}")]  # noqa: S608


def _rows(sql: str, params: dict | None = None) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params or {})
        return cur.fetchall()


def _read_redis(source: str, url: str, read: Callable[[Any], Any], up: GaugeMetricFamily,
                took: GaugeMetricFamily, deadline: float) -> Any:
    """read(client) on the Redis at url, within the readyz timeout (and what is left of the scrape's
    budget); source's up (1/0) and time are recorded. None when Redis could not be read (logged, up 0)."""
    import redis

    started = time.perf_counter()
    timeout = min(float(_setting("PORTAL_READYZ_TIMEOUT", 2.0)), max(deadline - time.monotonic(), 0.05))
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            result = read(client)
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        logger.warning("metrics: %s unreachable: %s", source, exc.__class__.__name__)
        up.add_metric([source], 0)
        return None
    finally:
        took.add_metric([source], time.perf_counter() - started)
    up.add_metric([source], 1)
    return result


def _queue_depths(up: GaugeMetricFamily, took: GaugeMetricFamily, deadline: float) -> Iterator[Metric]:
    """Celery queue depths: LLEN of each queue's Redis lists on the broker (all priority levels)."""
    queues = list(_setting("PORTAL_CELERY_QUEUES", DEFAULT_QUEUES))

    lengths = _read_redis("broker", _setting("CELERY_BROKER_URL", None) or _setting("REDIS_URL", ""),
                          lambda client: queue_lengths(client, queues), up, took, deadline)
    if lengths is None:
        return
    family = GaugeMetricFamily("portal_celery_queue_length", "Messages waiting in each Celery queue.",
                               labels=["queue"])
    for queue in queues:
        family.add_metric([queue], lengths[queue])
    yield family


def _event_counts(up: GaugeMetricFamily, took: GaugeMetricFamily, deadline: float) -> Iterator[Metric]:
    """Domain events by name, as every process (web, Celery workers) counted them in Redis."""
    from .metrics import domain_events_key

    counts = _read_redis("redis", _setting("REDIS_URL", ""), lambda client: client.hgetall(domain_events_key()),
                         up, took, deadline)
    if not counts:
        return  # unreachable, or no event yet: the family appears with the first one
    family = CounterMetricFamily("portal_domain_events", "Domain events emitted, by name (every process).",
                                 labels=["event"])
    for event, count in sorted(counts.items()):
        family.add_metric([event.decode("utf-8", "replace")], int(count))
    yield family
