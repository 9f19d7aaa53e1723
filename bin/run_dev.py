#!/usr/bin/env python
"""`make run`: services, migrations, the demo fleet, then web + two Celery workers + beat in one terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
HOST = os.environ.get("PORTAL_HOST", "127.0.0.1")
PORT = os.environ.get("PORTAL_PORT", "8000")
# Two workers, as the compose stack splits them by queue: domain events (the `default` queue) never
# wait behind a burst of provisioning phases, health checks or slow webhook deliveries.
EVENT_QUEUES = os.environ.get("PORTAL_EVENT_WORKER_QUEUES", "default")
WORK_QUEUES = os.environ.get("PORTAL_WORKER_QUEUES", "provisioning,health,fleet,notifications")
SETUP = [
    ["bin/devservices.py", "up"],
    ["manage.py", "migrate", "--no-input", "-v", "0"],
    ["manage.py", "seed_demo"],
    ["manage.py", "collectstatic", "--no-input", "-v", "0"],
]
# Ctrl-C during setup: how long the running step gets after SIGTERM before SIGKILL.
STOP_GRACE_S = 5


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.dev")
    # The demo fleet does not exist: its GPU checks run against the fake NVML, five nodes faulty.
    os.environ.setdefault("PORTAL_FAKE_NVML", "@provisioning/health/simulated/demo_fleet.json")
    # Links in notifications (Slack, reminders) point at the address this portal listens on.
    os.environ.setdefault("PORTAL_BASE_URL", f"http://{HOST}:{PORT}")
    stopping, code = False, 0

    def stop(signum, _frame):
        nonlocal stopping, code
        if not stopping:  # the first reason to stop is the one reported
            stopping, code = True, 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports them
            print("\nmake run: stopping web, workers and beat.", file=sys.stderr, flush=True)

    # SIGTERM (`kill`) during setup is taken as Ctrl-C is: the running step is stopped, not orphaned.
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        for step in SETUP:
            failed = _setup_step(step)
            if failed:
                return failed
        # The handlers go in before the first service starts: a Ctrl-C while they start stops those started.
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
    except (KeyboardInterrupt, _Terminated) as exc:  # between two steps, or before the first service: none runs
        return _interrupted("setup", exc)
    celery = [PY, "-m", "celery", "-A", "portal"]
    procs = {
        "web": subprocess.Popen([PY, "manage.py", "runserver", f"{HOST}:{PORT}", "--noreload"]),
        "worker-events": subprocess.Popen([*celery, "worker", "-Q", EVENT_QUEUES, "-c", "1", "-l", "info",
                                           "-n", "portal-dev-events@%h"]),
        "worker": subprocess.Popen([*celery, "worker", "-Q", WORK_QUEUES, "-c", "2", "-l", "info",
                                    "-n", "portal-dev@%h"]),
        "beat": subprocess.Popen([*celery, "beat", "-l", "info", "-s", str(ROOT / "var" / "celerybeat-schedule")]),
    }
    print(f"\n  GPU Portal on http://{HOST}:{PORT}/  (API docs: http://{HOST}:{PORT}/api/docs/, "
          f"admin: http://{HOST}:{PORT}/admin/)\n  Ctrl-C stops web, workers and beat.\n", flush=True)
    while not stopping:
        for name, proc in procs.items():
            if not stopping and proc.poll() is not None:  # not one a Ctrl-C (to the whole group) just ended
                print(f"{name} {_ended(proc.returncode)}; stopping the rest.", file=sys.stderr)
                stopping, code = True, _status(proc.returncode)
        time.sleep(0.5)
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return code


class _Terminated(Exception):
    """SIGTERM arrived during setup (see _raise_terminated)."""


def _raise_terminated(_signum, _frame) -> None:
    raise _Terminated


def _interrupted(what: str, exc: BaseException) -> int:
    """Say that make run was interrupted during what; return the status a shell reports for the signal:
    130 (128 + SIGINT) after Ctrl-C, 143 (128 + SIGTERM) after SIGTERM."""
    terminated = isinstance(exc, _Terminated)
    print(f"\nmake run: {'terminated' if terminated else 'interrupted'} during {what}; stopped.",
          file=sys.stderr, flush=True)
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


def _setup_step(args: list[str]) -> int:
    """Run one setup step: 0 when it succeeded, else the status make run exits with.

    A failing step printed why: it is named and its status kept, without a traceback of this script
    under it. The step ignores SIGINT, so a Ctrl-C in the terminal (which reaches the whole foreground
    process group) interrupts only this script, which stops the step (see _stop) and exits 130, as a
    shell does for SIGINT: one line, no traceback of the step's Python either. SIGTERM to this script
    (main turns it into _Terminated) stops the step the same way and exits 143.
    """
    step = " ".join(args)
    proc = None
    try:
        # preexec_fn is safe here: this script starts no threads.
        proc = subprocess.Popen([PY, *args], preexec_fn=_ignore_sigint)
        code = proc.wait()
    except (KeyboardInterrupt, _Terminated) as exc:
        if proc is not None:
            _stop(proc)
        return _interrupted(f"`{step}`", exc)
    if code != 0:
        how = f"failed (exit status {code})" if code > 0 else _ended(code)
        print(f"make run: `{step}` {how}; see its output above.", file=sys.stderr)
        return _status(code)
    return 0


def _status(returncode: int) -> int:
    """The status make run exits with for a child that ended with returncode (not 0): its own, or 128 + the
    signal that killed it (a negative returncode), as a shell reports it; sys.exit(-9) would exit 247."""
    return 128 - returncode if returncode < 0 else returncode or 1


def _ended(returncode: int) -> str:
    """How a child ended, for a message: "exited with 3", "was killed by SIGKILL"."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(proc: subprocess.Popen) -> None:
    """Stop an interrupted setup step: SIGTERM (a migrate's or seed_demo's open transaction is rolled
    back), then SIGKILL if it is still there after STOP_GRACE_S. Another Ctrl-C (or SIGTERM) goes straight
    to SIGKILL."""
    try:
        proc.terminate()
        proc.wait(STOP_GRACE_S)
        return
    except (subprocess.TimeoutExpired, KeyboardInterrupt, _Terminated):
        pass
    proc.kill()
    proc.wait()


if __name__ == "__main__":
    sys.exit(main())
