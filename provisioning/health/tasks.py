"""Celery entry points of the health checks; each fetches by id or job and calls one service.

Queues (CELERY_TASK_ROUTES sends ``provisioning.health.*`` to ``health``; agents' tasks are
sent with an explicit ``queue=``):

- ``node.<hostname>``: :func:`agent_run` in the Celery worker on the GPU node itself
  (``python -m provisioning.health.worker node``). It needs the broker, not the database: it
  posts the report back by id (:func:`record_report`, queue ``health``), which answers with
  :func:`xids_accepted` on the node's queue once the report is stored: only then do the
  kernel-log XIDs it carried count as reported on the node and its counter readings (PCIe
  replays, NVLink errors, aggregate ECC) become the baseline (a report that never arrived, or
  came after its check expired, leaves them to the next check).
- ``fleet``: :func:`fleet_run`, the simulated fleet's worker (``python -m
  provisioning.health.worker fleet``), many nodes per message with FakeNvml. One queue because
  a worker polls every queue it serves: 10,000 per-node queues would cost more than the checks.
  It runs inside the portal, so it records straight into the database.
- ``health``: recording, the beat's sweep and upkeep.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from celery import shared_task
from django.db import DatabaseError

from . import conf
from .choices import CheckLevel, CheckStatus

__all__ = ["agent_run", "fleet_run", "record_report", "xids_accepted", "checks_started", "sweep", "maintain"]

logger = logging.getLogger(__name__)

_fleets: dict[str, Any] = {}
_fleets_lock = threading.Lock()


def simulated_fleet() -> Any:
    """Return this process's SimulatedFleet for the current PORTAL_FAKE_NVML (cached per value)."""
    from .runner import SimulatedFleet

    source = conf.setting("PORTAL_FAKE_NVML", "") or ""
    key = source if isinstance(source, str) else repr(sorted(dict(source).items()))
    with _fleets_lock:
        if key not in _fleets:
            _fleets.clear()
            _fleets[key] = SimulatedFleet(source)
        return _fleets[key]


def _threshold_table() -> Any:
    from .thresholds import thresholds_from_config

    overrides = conf.threshold_overrides()
    return thresholds_from_config(overrides) if overrides else None


def _state_file(host: str) -> Path:
    return Path(conf.setting("PORTAL_HEALTH_STATE_DIR", "/var/lib/gpu-portal")) / f"health-state-{host}.json"


def _state_path(host: str) -> str | None:
    """Where a real agent keeps reported XIDs and counter baselines; None when not writable."""
    folder = _state_file(host).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(_state_file(host)) if os.access(folder, os.W_OK) else None


# Acknowledged on receipt: a redelivery would run a long burn-in twice, and a check whose agent
# died expires on the portal's side into "unknown" anyway.
@shared_task(name="provisioning.health.agent_run", ignore_result=True, acks_late=False)
def agent_run(job: dict[str, Any]) -> str:
    """Run one check on this GPU node and post the report back (the node agent; no database)."""
    from .fake_nvml import fake_from_env
    from .runner import run_job

    checks_started.apply_async(args=[[job["id"]]], queue=conf.health_queue())
    fake = fake_from_env(job["host"])  # a demo node without GPUs; real nodes leave it unset
    # A demo node keeps no state unless told where (PORTAL_HEALTH_STATE_DIR set).
    keep_state = fake is None or conf.setting("PORTAL_HEALTH_STATE_DIR", None) is not None
    report = run_job(
        job,
        nvml=fake,
        threshold_table=_threshold_table(),
        state_path=_state_path(job["host"]) if keep_state else None,
        event_wait_ms=conf.setting_int("PORTAL_HEALTH_EVENT_WAIT_MS", 0 if fake is not None else 500),
        nvml_timeout_s=conf.setting_float("PORTAL_HEALTH_NVML_TIMEOUT", 20.0),
        xid_receipt=str(job["id"]),  # its XIDs and counter readings count once the portal stored the report
    )
    record_report.apply_async(args=[job["id"], report], kwargs={"agent": job["host"]}, queue=conf.health_queue())
    return report["verdict"]


@shared_task(
    name="provisioning.health.fleet_run", ignore_result=True, autoretry_for=(DatabaseError,),
    retry_backoff=True, max_retries=5,
)
def fleet_run(jobs: list[dict[str, Any]]) -> dict[str, int]:
    """Run a batch of simulated nodes' checks and record them (the fleet simulator)."""
    from .agent import _error_report
    from .runner import compact_report
    from .services import health_checks_mark_running, health_checks_record

    health_checks_mark_running([job["id"] for job in jobs])
    try:
        fleet = simulated_fleet()
        table = _threshold_table()
    except (ValueError, TypeError, OSError) as exc:  # a broken fault spec or threshold file: say so per node
        logger.exception("the simulated fleet's configuration is broken")
        return health_checks_record(
            [(job["id"], compact_report(_error_report(job["level"], job["host"], exc))) for job in jobs]
        )
    timeout = conf.setting_float("PORTAL_HEALTH_NVML_TIMEOUT", 20.0)
    wait_ms = conf.setting_int("PORTAL_HEALTH_EVENT_WAIT_MS", 0)
    results = [
        (job["id"], fleet.run(job, threshold_table=table, nvml_timeout_s=timeout, event_wait_ms=wait_ms))
        for job in jobs
    ]
    return health_checks_record(results)


@shared_task(
    name="provisioning.health.record_report", ignore_result=True, autoretry_for=(DatabaseError,),
    retry_backoff=True, max_retries=8,
)
def record_report(check_id: int, report: dict[str, Any], agent: str | None = None) -> dict[str, int]:
    """Store a node agent's report and apply its verdict; tell the agent (its hostname) once it is stored.

    A report for a check that expired is not stored and not acknowledged: the agent then reports its XIDs
    and counter increases again with the next check. One already stored (this task retried after a
    database error in the consequences, or its message redelivered) is acknowledged: only the agent's
    report makes a check ``done``, and the agent sends one per check.
    """
    from .models import HealthCheck
    from .services import health_checks_record

    result = health_checks_record([(check_id, report)])
    stored = result["recorded"] or HealthCheck.objects.filter(pk=check_id, status=CheckStatus.DONE).exists()
    if agent and stored:
        try:
            # It matters until the agent's next check supersedes the receipt; it may wait behind the longest
            # check the agent runs. A dead agent's queue must not keep it past that (Redis evicts nothing).
            xids_accepted.apply_async(args=[agent, check_id], queue=conf.node_queue(agent),
                                      expires=max(conf.level_timeout_s(level) for level in CheckLevel.values))
        except Exception:  # noqa: BLE001 - the report is stored; unacknowledged XIDs are only reported again
            logger.warning("could not acknowledge check %s to %s", check_id, agent, exc_info=True)
    return result


@shared_task(name="provisioning.health.xids_accepted", ignore_result=True)
def xids_accepted(host: str, check_id: int) -> bool:
    """On the node: the portal stored check_id's report, so the XIDs it carried count as reported and its
    counter readings are the baseline the next runs are judged against."""
    from .xid import HealthState

    path = _state_file(host)
    if not path.exists():  # an agent that keeps no state (a demo node) held nothing
        return False
    state = HealthState.load(path)
    if not state.holds(str(check_id)):  # it carried no new XID and no readings (or was superseded)
        return False
    state.accept(str(check_id))
    state.save(path)
    return True


@shared_task(name="provisioning.health.checks_started", ignore_result=True)
def checks_started(check_ids: list[int]) -> int:
    from .services import health_checks_mark_running

    return health_checks_mark_running(check_ids)


@shared_task(name="provisioning.health.sweep", ignore_result=True)
def sweep(level: str = "quick") -> int:
    """Queue a scheduled check of every node in service (beat)."""
    from .services import health_sweep

    return len(health_sweep(level=level))


@shared_task(name="provisioning.health.maintain", ignore_result=True)
def maintain() -> dict[str, int]:
    """Expire unanswered checks, finish interrupted consequences, reconcile repairs, prune (beat)."""
    from .services import health_maintain

    return health_maintain()
