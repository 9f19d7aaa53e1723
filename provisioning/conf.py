"""Settings of this app, read at call time (never at import).

Each is looked up in Django settings first, then in the environment, then falls back to
its default, so a worker started with only environment variables behaves like the web.
"""

from __future__ import annotations

import json

from portal.core.conf import setting, setting_float, setting_int  # noqa: F401 - re-exported for this app

__all__ = ["setting", "setting_int", "setting_float", "phase_seconds", "backend_names"]


# Demo defaults: long enough to watch the phases move on the cluster page.
DEFAULT_PHASE_SECONDS: dict[str, float] = {
    "allocating_nodes": 8,
    "configuring_network": 6,
    "attaching_storage": 6,
    "installing_drivers": 15,
    "running_acceptance_tests": 10,
    "teardown": 5,
}


def phase_seconds(phase: str) -> float:
    """Return the simulated backend's duration for phase.

    PORTAL_SIMULATED_PHASE_SECONDS is one number for every phase (0 in tests) or a JSON
    object {phase: seconds, "default": seconds}; phases it does not name take its
    "default", else the built-in demo duration.
    """
    raw = setting("PORTAL_SIMULATED_PHASE_SECONDS", None)
    if raw is None:
        return DEFAULT_PHASE_SECONDS.get(phase, 0.0)
    if isinstance(raw, str):
        raw = raw.strip()
        raw = json.loads(raw) if raw.startswith("{") else float(raw)
    if isinstance(raw, dict):
        return float(raw.get(phase, raw.get("default", DEFAULT_PHASE_SECONDS.get(phase, 0.0))))
    return float(raw)


def backend_names() -> list[str]:
    """Return the configured backends: one name, or a comma list chosen per orchestrator."""
    raw = setting("PORTAL_PROVISIONING_BACKEND", "simulated")
    names = [part.strip() for part in str(raw).split(",") if part.strip()]
    return names or ["simulated"]
