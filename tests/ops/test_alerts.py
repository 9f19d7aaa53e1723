"""The alerting rules (deploy/alerts.yml): valid, unit-tested, loaded by Prometheus, documented in
docs/operations.md, and true to the metrics the portal exports — checked on a real scrape, where the
alerts that should fire do and the others stay quiet."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands
from django.test import Client
from django.urls import reverse

from portal.ops.collectors import FAMILIES
from reservations import services
from tests.conftest import make_world

from .conftest import promtool_series, scrape
from .test_deploy import SERVICES, family_of, metric_names, tool
from .test_metrics import other_app_rows

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "deploy" / "alerts.yml"
UNIT_TESTS = ROOT / "deploy" / "alerts_test.yml"
RUNBOOK = ROOT / "docs" / "operations.md"
ALERTS = {rule["alert"]: rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"]
          for rule in group["rules"]}
SEVERITIES = {"critical", "warning", "info"}
SELECTOR = re.compile(r"\b(portal_[a-zA-Z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_rules_pass_promtool():
    result = promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(ALERTS) >= 10


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet():
    result = promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    cases = [case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert set(ALERTS) - fires == set(), "alerts never shown firing"
    assert set(ALERTS) - quiet == set(), "alerts never shown staying quiet"
    assert fires | quiet <= set(ALERTS), "tests of alerts that no longer exist"


def test_every_alert_is_labelled_and_points_at_its_runbook_section():
    runbook = RUNBOOK.read_text()
    sections = anchors(runbook)
    for name, rule in ALERTS.items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, name
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in sections, f"docs/operations.md has no section for {name}"
        # The runbook's table gives the same severity.
        row = re.search(rf"^\| {name} \| (\w+) \|", runbook, re.M)
        assert row and row.group(1) == rule["labels"]["severity"], name


def test_every_metric_an_alert_reads_is_exported():
    for name, rule in ALERTS.items():
        families = {family_of(n) for n in metric_names(rule["expr"])}
        if name == "PortalDown":
            assert "up{" in rule["expr"]
            continue
        assert families, name
        assert families <= set(FAMILIES), f"{name}: {families - set(FAMILIES)} is not exported by portal.ops"


def test_the_error_rate_leaves_out_the_health_endpoints_and_needs_traffic():
    """Every selector of PortalServerErrorRate leaves out /healthz and /readyz by the URL names the
    request metrics label them with (a misspelt name would count /readyz's deliberate 503s again),
    and the alert needs a minimum request rate (alerts_test.yml shows both)."""
    expr = ALERTS["PortalServerErrorRate"]["expr"]
    selectors = re.findall(r"portal_http_requests_total(\{[^}]*\})?", expr)
    assert len(selectors) == 3
    for matchers in selectors:
        (excluded,) = re.findall(r'view!~"([^"]+)"', matchers)
        assert set(excluded.split("|")) == {"ops-healthz", "ops-readyz"}
    assert reverse("ops-healthz") == "/healthz"
    assert reverse("ops-readyz") == "/readyz"
    assert re.search(r"\band\s+sum\(rate\(portal_http_requests_total\{[^}]*\}\[5m\]\)\) >= 0\.1\s*$", expr)


def test_prometheus_loads_the_rules_the_compose_file_mounts(tmp_path):
    prom_text = (ROOT / "deploy" / "prometheus.yml").read_text()
    prom = yaml.safe_load(prom_text)
    (path,) = prom["rule_files"]
    assert f"./deploy/alerts.yml:{path}:ro" in SERVICES["prometheus"]["volumes"]
    # A full check (not syntax only) loads the rule file, with the container paths pointed here.
    token = tmp_path / "token"
    token.write_text("t")
    local = tmp_path / "prometheus.yml"
    local.write_text(prom_text.replace(path, str(RULES_FILE)).replace("/run/secrets/metrics_token", str(token)))
    result = promtool("check", "config", str(local))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(ALERTS)} rules found" in result.stdout


def test_every_manage_command_the_runbook_names_exists():
    named = set(re.findall(r"manage\.py (\w+)", RUNBOOK.read_text()))
    assert {"rotate_credentials", "reconcile", "issue_token", "revoke_token"} <= named
    assert named - set(get_commands()) == set()


@pytest.mark.django_db
def test_on_a_real_scrape_the_alerts_that_should_fire_do(ops, tmp_path, django_capture_on_commit_callbacks):
    """A real /metrics scrape, held for 70 minutes, through the rules: a pool with a quarter of its nodes
    failed and a Slack delivery that failed fire their alerts; nothing else does. Every label value an
    alert matches on exists in the scrape (a misspelt state would keep an alert quiet forever)."""
    world = make_world(nodes=4)
    other_app_rows(world)  # clusters, checks, one open repair, deliveries (one Slack one failed)
    with django_capture_on_commit_callbacks(execute=True):
        services.node_update(actor=world.users["staff"], node=world.nodes[-1], state="failed")
    client = Client()
    client.get("/healthz")
    s = scrape(client)

    for name, rule in ALERTS.items():
        for metric, matchers in SELECTOR.findall(rule["expr"]):
            samples = [labels for sample_name, labels in s.samples if sample_name == metric]
            assert samples, f"{name}: the scrape has no {metric}"
            for label, op, value in MATCHER.findall(matchers):
                present = {dict(labels).get(label) for labels in samples}
                assert present - {None}, f"{name}: {metric} has no label {label}"
                if op == "=":
                    assert value in present, f"{name}: {metric}{{{label}={value!r}}} matches nothing in {present}"

    series = promtool_series(s, 70)
    spec = {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{
            "expr": 'count by (alertname, pool, channel) (ALERTS{alertstate="firing"})', "eval_time": "65m",
            "exp_samples": [
                {"labels": '{alertname="PortalNotificationsFailing", channel="slack"}', "value": 1},
                {"labels": f'{{alertname="PortalPoolNodesOutOfService", pool="{world.pool.name}"}}', "value": 1},
            ],
        }],
    }]}
    path = tmp_path / "real_scrape_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
