"""Settings of the health app, read at call time: Django settings, else the environment, else a default.

- PORTAL_HEALTH_AGENT_QUEUE (``fleet``): ``fleet`` sends every check to the one ``fleet`` queue
  (the simulated fleet's worker); ``node`` to each node's own ``node.<hostname>`` queue (real agents).
- PORTAL_HEALTH_FLEET_QUEUE / PORTAL_HEALTH_QUEUE (``fleet`` / ``health``): queue names (the
  simulated fleet's; where agents post reports back).
- PORTAL_HEALTH_FLEET_BATCH (50): checks per message to the fleet queue.
- PORTAL_HEALTH_DRIVER_PIN / PORTAL_HEALTH_CUDA_PIN (none): fleet-wide pins (else the per-model ones).
- PORTAL_HEALTH_THRESHOLDS (none): JSON per-model threshold overrides (``thresholds_from_config``).
- PORTAL_HEALTH_EVENT_WAIT_MS (500 on real nodes, 0 simulated): how long to listen for live XIDs.
- PORTAL_HEALTH_NVML_TIMEOUT (20): seconds one GPU's NVML calls may take.
- PORTAL_HEALTH_STATE_DIR (``/var/lib/gpu-portal``): a real agent's reported XIDs and baselines (a
  demo agent with a fake NVML keeps them only when it is set).
- PORTAL_HEALTH_TIMEOUT_QUICK / _MEDIUM / _FULL (300 / 3600 / 14400): seconds before an
  unanswered check becomes an ``unknown`` error.
- PORTAL_HEALTH_ACCEPTANCE_LEVEL (``medium``), PORTAL_HEALTH_ACCEPTANCE_POLL (5 s between gate
  calls while checks run), PORTAL_HEALTH_ACCEPTANCE_MAX_AGE (21600 s a result stays good for the
  same booking), PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS (10: an unknown result is re-run after; the gate
  waits for it until one check's timeout of the level since it began checking the node).
- PORTAL_HEALTH_RETENTION_DAYS (14): older scheduled checks are pruned (each node's latest and
  any a repair names stay).
- PORTAL_HEALTH_MOVE_BOOKINGS (true): a node taken out of service has its bookings moved to
  spares here (``node_replace_allocations``); false leaves it to the ``node.state_changed``
  subscriber.
- PORTAL_FAKE_NVML (none): the simulated fleet's faults: JSON, or ``@/path/file.json`` (re-read
  when the file changes).
"""

from __future__ import annotations

import json
from typing import Any

from portal.core.conf import setting, setting_bool, setting_float, setting_int  # noqa: F401 - re-exported for this app

from .queues import node_queue  # noqa: F401 - re-exported for this app

LEVEL_TIMEOUTS_S = {"quick": 300.0, "medium": 3600.0, "full": 14400.0}


def agent_queue_mode() -> str:
    mode = str(setting("PORTAL_HEALTH_AGENT_QUEUE", "fleet")).strip().lower()
    if mode not in ("fleet", "node"):
        raise ValueError(f"PORTAL_HEALTH_AGENT_QUEUE must be 'fleet' or 'node', not {mode!r}")
    return mode


def fleet_queue() -> str:
    """The simulated fleet's queue (tests and benchmarks use their own name on a shared broker)."""
    return str(setting("PORTAL_HEALTH_FLEET_QUEUE", "fleet"))


def health_queue() -> str:
    """Where agents post reports back (the portal's health workers)."""
    return str(setting("PORTAL_HEALTH_QUEUE", "health"))


def level_timeout_s(level: str) -> float:
    return setting_float(f"PORTAL_HEALTH_TIMEOUT_{level.upper()}", LEVEL_TIMEOUTS_S[level])


def pins() -> dict[str, str]:
    """Return the fleet-wide pins that are set: {"driver": …, "cuda": …}."""
    out = {}
    for key, name in (("driver", "PORTAL_HEALTH_DRIVER_PIN"), ("cuda", "PORTAL_HEALTH_CUDA_PIN")):
        value = setting(name, None)
        if value:
            out[key] = str(value)
    return out


def threshold_overrides() -> dict[str, Any] | None:
    raw = setting("PORTAL_HEALTH_THRESHOLDS", None)
    if not raw:
        return None
    return json.loads(raw) if isinstance(raw, str) else dict(raw)
