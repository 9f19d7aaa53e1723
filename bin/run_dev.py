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


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.dev")
    # The demo fleet does not exist: its GPU checks run against the fake NVML, five nodes faulty.
    os.environ.setdefault("PORTAL_FAKE_NVML", "@provisioning/health/simulated/demo_fleet.json")
    # Links in notifications (Slack, reminders) point at the address this portal listens on.
    os.environ.setdefault("PORTAL_BASE_URL", f"http://{HOST}:{PORT}")
    try:
        subprocess.run([PY, "bin/devservices.py", "up"], check=True)
        subprocess.run([PY, "manage.py", "migrate", "--no-input", "-v", "0"], check=True)
        subprocess.run([PY, "manage.py", "seed_demo"], check=True)
        subprocess.run([PY, "manage.py", "collectstatic", "--no-input", "-v", "0"], check=True)
    except subprocess.CalledProcessError as exc:
        # The step printed why; name it and keep its status, without a traceback of this script under it.
        step = " ".join(str(a) for a in exc.cmd[1:])
        print(f"make run: `{step}` failed (exit status {exc.returncode}); see its output above.", file=sys.stderr)
        return exc.returncode if exc.returncode > 0 else 1
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
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while not stopping:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(f"{name} exited with {proc.returncode}; stopping the rest.", file=sys.stderr)
                stopping, code = True, proc.returncode or 1
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


if __name__ == "__main__":
    sys.exit(main())
