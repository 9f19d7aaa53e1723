"""Every series, label and label value the dashboards and alert rules select on exists in a real scrape.

test_deploy.py and test_alerts.py check metric families (a name without its ``_total`` suffix passes
there) and that each panel returns something; here each selector is checked on its own: the exact
series name, each label a matcher or a ``by (...)`` names, each value an ``=`` matcher or a literal
``a|b|c`` regular expression asks for. A misspelt alternative or grouping label returns data all the
same, and reads as a silent zero on a panel or an alert that never fires.
"""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from tests.conftest import make_world

from .conftest import scrape
from .test_alerts import ALERTS
from .test_deploy import DASHBOARDS, panel_queries
from .test_metrics import other_app_rows

pytestmark = pytest.mark.django_db

SELECTOR = re.compile(r"\b(portal_[a-zA-Z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LITERAL_ALTERNATIVES = re.compile(r"[\w\-]+(?:\|[\w\-]+)*")


def queries() -> list[tuple[str, str]]:
    out = [(f"{board} / {title}", expr) for board, title, expr in panel_queries()]
    out += [(f"alert {name}", rule["expr"]) for name, rule in ALERTS.items()]
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            name, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"]).groups()
            out.append((f"{path.name} variable {variable['name']}", f"sum by ({label}) ({name})"))
    return out


def test_every_series_label_and_value_a_query_selects_is_in_a_real_scrape(ops, django_capture_on_commit_callbacks):
    from reservations import services

    world = make_world(nodes=4)
    other_app_rows(world)
    with django_capture_on_commit_callbacks(execute=True):
        services.node_update(actor=world.users["staff"], node=world.nodes[-1], state="failed")
    client = Client()
    client.get("/healthz")
    # PortalServerErrorRate leaves out view="ops-readyz": that series exists once /readyz was asked (run
    # alone, without test_health.py before it in this process, the scrape had none and this test failed).
    client.get("/readyz")
    s = scrape(client)
    labels_of: dict[str, list[dict[str, str]]] = {}
    for name, labels in s.samples:
        labels_of.setdefault(name, []).append(dict(labels))

    problems = []
    for where, expr in queries():
        without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        names = set(re.findall(r"\bportal_[a-zA-Z0-9_]+\b", without_strings))
        for name in names:
            if name not in labels_of:
                problems.append(f"{where}: no series {name} in the scrape")
        for name, braces in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(braces or ""):
                present = {labels.get(label) for labels in labels_of.get(name, [])} - {None}
                if not present:
                    problems.append(f"{where}: {name} has no label {label}")
                elif op == "=" and value not in present:
                    problems.append(f"{where}: {name}{{{label}={value!r}}} matches nothing in {sorted(present)}")
                elif op in ("=~", "!~") and LITERAL_ALTERNATIVES.fullmatch(value):
                    missing = set(value.split("|")) - present
                    if missing:
                        problems.append(f"{where}: {name}{{{label}{op}{value!r}}}: {missing} not in {sorted(present)}")
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                for name in names:
                    if not any(label in labels for labels in labels_of.get(name, [])):
                        problems.append(f"{where}: groups by {label}, which {name} does not have")
    assert not problems, "\n".join(problems)
