"""A scrape of /metrics answers within Prometheus' scrape_timeout, however slow the database is.

Each database section of the scrape has its own statement timeout; without a budget for the whole
scrape, six slow sections add up (6 x 5 s) past Prometheus' scrape_timeout (10 s, deploy/prometheus.yml)
and gunicorn's worker timeout (30 s): the whole scrape is lost (``up`` 0, PortalDown fires instead
of PortalMetricsSourceDown) and a web worker is held, or killed, for every scrape.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from django.test import Client

from portal.ops import collectors

from .conftest import scrape

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
DB_SECTIONS = ("fleet", "reservations", "usage", "provisioning", "health", "notifications", "events")


def seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration).groups()
    return float(value) * {"ms": 0.001, "s": 1, "m": 60}[unit]


def test_the_scrape_budget_fits_inside_prometheus_scrape_timeout_and_gunicorns_worker_timeout():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "portal")
    scrape_timeout = seconds(job.get("scrape_timeout") or prom["global"].get("scrape_timeout", "10s"))
    gunicorn_timeout = int(re.search(r'"GUNICORN_TIMEOUT", "(\d+)"', (ROOT / "gunicorn.conf.py").read_text()).group(1))
    # Room left for the Redis reads, rendering and the network.
    assert collectors.SCRAPE_BUDGET_S <= scrape_timeout - 1
    assert collectors.SCRAPE_BUDGET_S < gunicorn_timeout


def test_slow_database_sections_share_one_budget_and_the_scrape_still_answers(ops, settings, monkeypatch):
    """Every section's query waits on the database (a lock held by a migration, say) longer than its
    statement timeout: the scrape still answers within the budget, with the late sections reported down."""
    settings.PORTAL_READYZ_TIMEOUT = 0.5
    budget = 1.5
    monkeypatch.setattr(collectors, "SCRAPE_BUDGET_S", budget, raising=False)
    monkeypatch.setattr(collectors, "STATEMENT_TIMEOUT_MS", 1000)
    real_rows = collectors._rows

    def slow_rows(sql, params=None):
        real_rows("SELECT pg_sleep(30)")  # cancelled by the statement timeout
        return real_rows(sql, params)

    monkeypatch.setattr(collectors, "_rows", slow_rows)
    started = time.monotonic()
    s = scrape(Client())
    took = time.monotonic() - started
    assert took < budget + 2.0, f"the scrape took {took:.1f} s with a budget of {budget} s"
    # Every section is still reported, each as down: none could finish its queries.
    for section in DB_SECTIONS:
        assert s.value("portal_metrics_source_up", source=section) == 0, section
    assert s.value("portal_metrics_source_up", source="database") == 1
