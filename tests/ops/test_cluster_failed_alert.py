"""PortalClusterFailed fires for a cluster that just failed, whatever other failed clusters do meanwhile."""

from __future__ import annotations

from datetime import timedelta

import pytest
import yaml
from django.apps import apps
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.test import Client
from django.utils import timezone

from reservations.models import Reservation
from tests.conftest import make_world

from .conftest import scrape
from .test_alerts import RULES_FILE, promtool

pytestmark = pytest.mark.django_db


def failed_cluster(world, *, failed_at):
    VirtualCluster = apps.get_model("provisioning", "VirtualCluster")
    ClusterTransition = apps.get_model("provisioning", "ClusterTransition")
    start = failed_at + timedelta(minutes=30)
    r = Reservation.objects.create(tenant=world.tenants["alpha"], pool=world.pool, node_count=1, status="failed",
                                   period=DateTimeTZRange(start, start + timedelta(hours=4), "[)"))
    cluster = VirtualCluster.objects.create(
        reservation=r, tenant=r.tenant, backend="simulated", orchestrator="slurm", orchestrator_version="24.05",
        cuda_version="12.8", default_memory_per_gpu_gib=80, shared_storage_gib=100, status="failed")
    for phase, at in (("pending", failed_at - timedelta(days=1)),
                      ("allocating_nodes", failed_at - timedelta(minutes=1)), ("failed", failed_at)):
        ClusterTransition.objects.create(cluster=cluster, phase=phase, at=at)
    return cluster


def series_of(*scrapes, minutes: int) -> list[dict]:
    """Scrape i held for `minutes` minutes, one after the other; a series a scrape lacks is missing then."""
    keys = dict.fromkeys(key for s in scrapes for key in s.samples)
    out = []
    for name, labels in keys:
        text = ",".join(f'{k}="{v}"' for k, v in sorted({**dict(labels), "job": "portal", "instance": "web:8000"}
                                                          .items()))
        values = []
        for s in scrapes:
            value = s.samples.get((name, labels))
            values += ["_" if value is None else f"{value:g}"] * minutes
        out.append({"series": f"{name}{{{text}}}", "values": " ".join(values)})
    return out


def test_a_new_failure_fires_even_while_an_old_failed_cluster_is_torn_down(ops, tmp_path):
    """A failed cluster leaves the failed state when its window ends (torn down, then deleted). When that
    happens within 30 minutes of a new failure, the number of failed clusters stays the same: the rule
    delta(portal_virtual_clusters{status="failed"}[30m]) > 0 stayed quiet about the new failure."""
    world = make_world(nodes=2)
    now = timezone.now()
    old = failed_cluster(world, failed_at=now - timedelta(days=2))
    client = Client()
    before = scrape(client)
    # The old one's window ended: torn down. A new one failed just now.
    old.status = "deleted"
    old.save(update_fields=["status"])
    failed_cluster(world, failed_at=now)
    after = scrape(client)
    assert before.value("portal_virtual_clusters", status="failed") == after.value("portal_virtual_clusters",
                                                                                     status="failed") == 1

    spec = {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series_of(before, after, minutes=20),
        "promql_expr_test": [{
            "expr": 'count by (alertname) (ALERTS{alertname="PortalClusterFailed", alertstate="firing"})',
            "eval_time": "25m",
            "exp_samples": [{"labels": '{alertname="PortalClusterFailed"}', "value": 1}],
        }],
    }]}
    path = tmp_path / "cluster_failed_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
