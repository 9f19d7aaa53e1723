"""A check requested while the node's open check finishes is still queued, never silently left out."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from provisioning.health import services
from provisioning.health.choices import OPEN_CHECK_STATUSES, CheckStatus
from provisioning.health.models import HealthCheck


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_open_check_finishes_between_insert_and_read_gets_a_new_check(fleet, monkeypatch):
    a, b = fleet.nodes[:2]
    (old,) = services.health_checks_request(nodes=[a], level="quick", trigger="schedule")
    real_insert = services._insert_checks
    rounds = []

    def insert_then_the_open_check_finishes(**kwargs):
        ids = real_insert(**kwargs)  # skips a: its scheduled check is open
        rounds.append(ids)
        if len(rounds) == 1:
            # Another worker records a's result and commits, before our read of the open checks.
            def finish():
                HealthCheck.objects.filter(pk=old.pk).update(status=CheckStatus.DONE, verdict="pass")
                connection.close()
            worker = threading.Thread(target=finish)
            worker.start()
            worker.join()
        return ids

    monkeypatch.setattr(services, "_insert_checks", insert_then_the_open_check_finishes)
    checks = services.health_checks_request(nodes=[a, b], level="quick", trigger="staff")
    assert {c.node_id for c in checks} == {a.pk, b.pk}, "a node was left out of the request"
    fresh = {c.node_id: c for c in checks}[a.pk]
    assert fresh.pk != old.pk and fresh.status in OPEN_CHECK_STATUSES and fresh.trigger == "staff"
    assert HealthCheck.objects.filter(node=a, status__in=OPEN_CHECK_STATUSES).count() == 1
