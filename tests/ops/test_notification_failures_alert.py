"""PortalNotificationsFailing fires for a delivery that failed in the last hour, whenever it was created (found in a
review: it counted only deliveries created in the last hour, and a message retried for a day before it failed, as
every retryable one now is, never set it off)."""

from __future__ import annotations

import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.test import Client
from django.utils import timezone

from notifications.models import Delivery

from .conftest import promtool_series, scrape

pytestmark = pytest.mark.django_db
RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "alerts.yml"


def _delivery(key: str, status: str, *, created_ago: timedelta, changed_ago: timedelta,
              event: str = "reservation.confirmed") -> None:
    row = Delivery.objects.create(key=key, kind="slack", event=event, message_id=key, body="{}",
                                  status=status)
    Delivery.objects.filter(pk=row.pk).update(created_at=timezone.now() - created_ago,
                                              updated_at=timezone.now() - changed_ago)


def _firing(s, tmp_path, alertname: str = "PortalNotificationsFailing", *,
            channel: str = "slack") -> subprocess.CompletedProcess:
    series = promtool_series(s, 20, prefix="portal_notification")
    spec = {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{
            "expr": 'count by (alertname, channel) '
                    f'(ALERTS{{alertstate="firing", alertname="{alertname}"}})',
            "eval_time": "18m",
            "exp_samples": [{"labels": f'{{alertname="{alertname}", channel="{channel}"}}', "value": 1}],
        }],
    }]}
    path = tmp_path / "failures_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    return subprocess.run([shutil.which("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=120)


def test_a_message_that_failed_after_a_day_of_retries_sets_off_the_alert(ops, tmp_path):
    # Created yesterday, retried all day, out of retries ten minutes ago.
    _delivery("day-long", "failed", created_ago=timedelta(hours=25), changed_ago=timedelta(minutes=10))
    # Failed (and told) yesterday: not this hour's news.
    _delivery("old", "failed", created_ago=timedelta(hours=30), changed_ago=timedelta(hours=5))
    s = scrape(Client())
    assert s.value("portal_notification_failures_last_hour", channel="slack") == 1
    assert s.value("portal_notification_failures_last_hour", channel="webhook") == 0
    result = _firing(s, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_a_receiver_down_for_over_an_hour_sets_off_an_alert_before_the_day_of_retries_ends(ops, tmp_path):
    """Retries now go on for a day: a receiver down for hours must not wait that long to be noticed."""
    _delivery("down-90m", "retrying", created_ago=timedelta(minutes=90), changed_ago=timedelta(minutes=5))
    _delivery("down-3h", "pending", created_ago=timedelta(hours=3), changed_ago=timedelta(minutes=1))
    _delivery("fresh", "retrying", created_ago=timedelta(minutes=20), changed_ago=timedelta(minutes=1))
    s = scrape(Client())
    assert s.value("portal_notification_deliveries_retrying_over_an_hour", channel="slack") == 2
    assert s.value("portal_notification_deliveries_retrying_over_an_hour", channel="webhook") == 0
    result = _firing(s, tmp_path, "PortalNotificationsRetrying")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_no_retrying_alert_while_every_waiting_delivery_is_under_an_hour_old(ops, tmp_path):
    _delivery("fresh", "retrying", created_ago=timedelta(minutes=50), changed_ago=timedelta(minutes=1))
    _delivery("failed", "failed", created_ago=timedelta(hours=3), changed_ago=timedelta(hours=2))
    s = scrape(Client())
    assert s.value("portal_notification_deliveries_retrying_over_an_hour", channel="slack") == 0
    result = _firing(s, tmp_path, "PortalNotificationsRetrying")
    assert result.returncode != 0 and "PortalNotificationsRetrying" in result.stdout + result.stderr


def test_a_leads_failed_test_message_pages_nobody(ops, tmp_path):
    """A test message to a receiver that is down fails within a minute, on purpose, and its lead reads why on the
    notifications page: it is no delivery lost (or late), and sets off neither alert; a real one still does."""
    _delivery("test-failed", "failed", created_ago=timedelta(minutes=3), changed_ago=timedelta(minutes=2),
              event="test")
    _delivery("test-stuck", "retrying", created_ago=timedelta(hours=2), changed_ago=timedelta(minutes=2),
              event="test")
    s = scrape(Client())
    assert s.value("portal_notification_failures_last_hour", channel="slack") == 0
    assert s.value("portal_notification_deliveries_retrying_over_an_hour", channel="slack") == 0
    result = _firing(s, tmp_path)
    assert result.returncode != 0 and "PortalNotificationsFailing" in result.stdout + result.stderr

    _delivery("real", "failed", created_ago=timedelta(hours=25), changed_ago=timedelta(minutes=2))
    assert scrape(Client()).value("portal_notification_failures_last_hour", channel="slack") == 1
