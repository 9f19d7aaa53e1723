"""The Notifications dashboard's "New deliveries per hour" panel counts the deliveries created in the
last hour. A delta() over the delivery-log gauge does not: a delivery moving from pending to
delivered reads as -1 pending, and the hourly prune of 90-day-old deliveries cancels new ones out."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.test import Client
from django.utils import timezone

from notifications.choices import DeliveryStatus
from notifications.models import Delivery

from .conftest import scrape

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


def panel_expr(title: str) -> str:
    board = json.loads((ROOT / "deploy/grafana/dashboards/notifications.json").read_text())
    return next(t["expr"] for p in board["panels"] if p["title"] == title for t in p["targets"])


def deliver(key: str, status: str, *, created_ago: timedelta) -> Delivery:
    delivery = Delivery.objects.create(key=key, kind="slack", event="reservation.confirmed", message_id=key,
                                       body="{}", status=status,
                                       delivered_at=timezone.now() if status == "delivered" else None)
    Delivery.objects.filter(pk=delivery.pk).update(created_at=timezone.now() - created_ago)
    return delivery


def series(s) -> list[str]:
    out = []
    for family in s.families.values():
        for sample in family.samples:
            if sample.name.startswith("portal_notification"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out.append((f"{sample.name}{{{labels}}}", sample.value))
    return out


def test_new_deliveries_per_hour_counts_the_deliveries_created_in_the_last_hour(ops, tmp_path):
    # An hour ago: an old delivered message (about to be pruned) and one still pending.
    old = deliver("old", "delivered", created_ago=timedelta(days=91))
    waiting = deliver("waiting", "pending", created_ago=timedelta(hours=2))
    before = dict(series(scrape(Client())))
    # During the hour: the pending one is delivered, the old one pruned, three new ones made.
    Delivery.objects.filter(pk=waiting.pk).update(status="delivered", delivered_at=timezone.now())
    old.delete()
    deliver("new-1", "delivered", created_ago=timedelta(minutes=50))
    deliver("new-2", "delivered", created_ago=timedelta(minutes=20))
    deliver("new-3", "failed", created_ago=timedelta(minutes=5))
    after = dict(series(scrape(Client())))
    # Prometheus saw the "before" values for the first half hour and the "after" values since.
    names = sorted(before.keys() | after.keys())
    input_series = [{"series": name, "values": " ".join(
        [f"{before[name]:g}" if name in before else "_"] * 30 + [f"{after[name]:g}" if name in after else "_"] * 31)}
        for name in names]
    expr = panel_expr("New deliveries per hour")
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": input_series,
        # Every status is there, at 0 when no new delivery has it (a panel without gaps).
        "promql_expr_test": [{"expr": expr, "eval_time": "60m", "exp_samples": [
            {"labels": f'{{status="{status}"}}', "value": {"delivered": 2, "failed": 1}.get(status, 0)}
            for status in DeliveryStatus.values
        ]}],
    }]}
    path = tmp_path / "panel_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    result = subprocess.run([shutil.which("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# --- the notification alerts' metrics are on the dashboard ---------------------------------------------------------


def notification_alert_metrics() -> dict[str, set[str]]:
    """The portal_notification_* metrics each alert of deploy/alerts.yml is raised on, by alert."""
    rules = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())
    out = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            names = set(re.findall(r"\bportal_notification_[a-zA-Z0-9_]+\b", rule.get("expr", "")))
            if "alert" in rule and names:
                out[rule["alert"]] = names
    return out


def test_every_notification_alerts_metric_has_a_panel_by_channel_on_the_dashboard():
    """An operator paged for PortalNotificationsFailing or PortalNotificationsRetrying opens the Notifications
    dashboard: it shows the metric the alert fired on, by channel kind, as the alert counts it."""
    alerts = notification_alert_metrics()
    assert {"PortalNotificationsFailing", "PortalNotificationsRetrying"} <= alerts.keys()
    board = json.loads((ROOT / "deploy/grafana/dashboards/notifications.json").read_text())
    shown = {name: [p["title"] for p in board["panels"] for t in p["targets"]
                    if re.search(rf"\b{name}\b", t["expr"]) and re.search(r"by \(channel\)", t["expr"])]
             for names in alerts.values() for name in names}
    missing = sorted(name for name, titles in shown.items() if not titles)
    assert not missing, f"no panel of the Notifications dashboard shows {missing} by channel"


def test_the_failing_and_retrying_panels_count_each_channel_kind(ops, tmp_path):
    # Slack: one failed in the last hour (after a day of retries), one failed yesterday; webhook: one retrying
    # for two hours, one made ten minutes ago (retrying, but not for an hour yet).
    deliver("failed-now", "failed", created_ago=timedelta(days=1))
    yesterday = deliver("failed-yesterday", "failed", created_ago=timedelta(days=2))
    Delivery.objects.filter(pk=yesterday.pk).update(updated_at=timezone.now() - timedelta(days=1))
    deliver("retrying-long", "retrying", created_ago=timedelta(hours=2))
    deliver("retrying-new", "retrying", created_ago=timedelta(minutes=10))
    Delivery.objects.filter(key__startswith="retrying").update(kind="webhook")
    now = dict(series(scrape(Client())))
    input_series = [{"series": name, "values": f"{value:g}x30"} for name, value in now.items()]
    expected = {
        "Failed in the last hour, by channel": {"slack": 1, "webhook": 0},
        "Retrying for over an hour, by channel": {"slack": 0, "webhook": 1},
    }
    tests = [{"expr": panel_expr(title), "eval_time": "30m", "exp_samples": [
        {"labels": f'{{channel="{channel}"}}', "value": value} for channel, value in values.items()]}
        for title, values in expected.items()]
    spec = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series, "promql_expr_test": tests}]}
    path = tmp_path / "panel_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    result = subprocess.run([shutil.which("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
