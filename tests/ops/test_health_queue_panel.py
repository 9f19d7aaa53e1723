"""The GPU health dashboard's queue panel shows every queue the health checks wait in.

With the simulated fleet (.env.example's PORTAL_HEALTH_AGENT_QUEUE=fleet) the checks themselves are sent
to the `fleet` queue, which worker-health serves next to `health` (where agents post their reports).
The panel showed only `health`: a sweep outrunning worker-health (the backlog docs/operations.md's
PortalQueueBacklog section sends operators to look for) stayed at zero on it.
"""

from __future__ import annotations

import json
import re

from .test_deploy import DASHBOARDS, SERVICES, env_example


def queues_shown(expr: str) -> set[str]:
    shown = set()
    for op, value in re.findall(r'queue\s*(=~|=)\s*"([^"]*)"', expr):
        assert op == "=" or re.fullmatch(r"[\w.-]+(\|[\w.-]+)*", value), f"not a plain list of queues: {value}"
        shown |= set(value.split("|"))
    return shown


def test_the_health_dashboard_shows_every_queue_worker_health_serves():
    command = SERVICES["worker-health"]["command"]
    served = set(command[command.index("-Q") + 1].split(","))
    assert env_example()["PORTAL_HEALTH_AGENT_QUEUE"] == "fleet" and "fleet" in served
    board = json.loads(next(p for p in DASHBOARDS if p.stem == "health").read_text())
    panels = [p for p in board["panels"] if any("portal_celery_queue_length" in t["expr"] for t in p["targets"])]
    assert len(panels) == 1, [p["title"] for p in panels]
    (panel,) = panels
    shown = set().union(*(queues_shown(t["expr"]) for t in panel["targets"]))
    assert served <= shown, f"worker-health serves {sorted(served)}; the panel shows {sorted(shown)}"
    # One line per queue, each named by its queue.
    for target in panel["targets"]:
        if len(queues_shown(target["expr"])) > 1:
            assert "{{queue}}" in target["legendFormat"], target
