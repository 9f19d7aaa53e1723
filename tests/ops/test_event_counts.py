"""portal_domain_events_total counts events wherever they are emitted: cluster phases, node failures
found by health checks and reminders are emitted in Celery workers, which Prometheus never scrapes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.test import Client

from tests.dburl import database_url

from .conftest import scrape

pytestmark = pytest.mark.django_db

# What a worker process does when a cluster becomes ready: emit the event (inline subscribers run
# at once outside a transaction). The notification fan-out is left out: it would need the outbox.
EMIT_IN_ANOTHER_PROCESS = """
import django
django.setup()
from portal.core import events
events._background.clear()
events.emit("cluster.ready", cluster_id=1, reservation_id=1, tenant_id=1, status="ready")
"""


def cluster_ready_count() -> float:
    return scrape(Client()).value("portal_domain_events_total", event="cluster.ready") or 0.0


def test_an_event_emitted_in_a_worker_process_is_counted_in_the_scrape(ops):
    before = cluster_ready_count()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings.test", "REDIS_URL": settings.REDIS_URL,
           "DATABASE_URL": database_url()}
    result = subprocess.run([sys.executable, "-c", EMIT_IN_ANOTHER_PROCESS], cwd=settings.BASE_DIR, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cluster_ready_count() == before + 1
