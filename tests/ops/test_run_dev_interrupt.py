"""Ctrl-C while `make run` is still setting up (services, migrate, seed_demo, collectstatic) stops the step
that is running and exits with status 130 and one line saying so, not a Python traceback of
bin/run_dev.py; SIGTERM (`kill`) stops it the same way and exits 143. Once web, workers and beat run,
Ctrl-C stops them and exits 130 (SIGTERM: 143), as a shell reports a command those signals ended.

bin/run_dev.py runs for real from a scratch copy of the checkout's layout: its bin/devservices.py
returns at once and its manage.py stands in for a long `migrate` (it writes its pid, prints a line and
waits; a KeyboardInterrupt there prints a traceback, as Django's commands do). The test sends SIGINT
only once that line is out, so nothing depends on timing.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DEVSERVICES = "print('database: fake')\n"
# A long migrate; with IGNORE_SIGTERM, one that only SIGKILL stops.
MANAGE = """\
import os, signal, sys, time
if sys.argv[1] != "migrate":
    raise SystemExit("manage.py " + sys.argv[1] + " must not run after Ctrl-C")
if os.environ.get("IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open("migrate.pid", "w").write(str(os.getpid()))
print("migrating", flush=True)
time.sleep(120)
"""


# Setup steps that succeed at once, and services that run until stopped: runserver prints "serving" and the
# Celery processes (`python -m celery`, found in the scratch copy first) "celery <command> [<queues>]" once
# started.
# Each line in one write: the services share the pipe, and their lines must not interleave.
MANAGE_ALL = """\
import os, signal, sys, time
if sys.argv[1] != "runserver":
    raise SystemExit(0)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open("runserver.pid", "w").write(str(os.getpid()))
os.write(1, b"serving\\n")
time.sleep(120)
"""
CELERY = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
queues = [sys.argv[sys.argv.index("-Q") + 1]] if "-Q" in sys.argv else []
line = ["celery", sys.argv[sys.argv.index("-A") + 2], *queues]
os.write(1, (" ".join(line) + "\\n").encode())
time.sleep(120)
"""


def scratch(tmp_path: Path, manage: str = MANAGE) -> Path:
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / "bin" / "run_dev.py", tmp_path / "bin" / "run_dev.py")
    (tmp_path / "bin" / "devservices.py").write_text(DEVSERVICES)
    (tmp_path / "manage.py").write_text(manage)
    (tmp_path / "celery.py").write_text(CELERY)
    (tmp_path / "var").mkdir()
    return tmp_path


def _as_from_a_terminal() -> None:
    # A command a terminal runs in the foreground gets SIGINT's default disposition (Python then raises
    # KeyboardInterrupt). A non-interactive shell starts background jobs with SIGINT ignored, and a test
    # run started that way (nohup ... &, some CI runners) would hand that on to run_dev.py.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cwd: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(cwd / "bin" / "run_dev.py")], cwd=cwd,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **env}, preexec_fn=_as_from_a_terminal)


def wait_for_line(proc: subprocess.Popen, line: str, timeout: float = 60) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(deadline - time.monotonic()):
                got = proc.stdout.readline()
                if got == "":
                    break
                if got.strip() == line:
                    return
    proc.kill()
    pytest.fail(f"never printed {line!r}: {proc.communicate()}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its gone parent) has stopped too.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, stderr


def test_ctrl_c_in_a_terminal_stops_the_running_step_and_exits_130(tmp_path):
    cwd = scratch(tmp_path)
    proc = start(cwd)
    wait_for_line(proc, "migrating")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the whole foreground group
    code, stderr = finish(proc)
    assert code == 130, (code, stderr)
    # Neither run_dev.py's traceback nor the step's (Ctrl-C reaches run_dev.py only; it stops the step).
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip() == "make run: interrupted during `manage.py migrate --no-input -v 0`; stopped.", stderr
    assert not alive(int((cwd / "migrate.pid").read_text()))


def test_a_step_that_ignores_sigterm_is_killed(tmp_path):
    cwd = scratch(tmp_path)
    proc = start(cwd, IGNORE_SIGTERM="1")
    wait_for_line(proc, "migrating")
    pid = int((cwd / "migrate.pid").read_text())
    os.kill(proc.pid, signal.SIGINT)  # run_dev.py alone (kill -INT)
    code, stderr = finish(proc)
    assert code == 130, (code, stderr)
    assert "Traceback" not in stderr, stderr
    assert "make run: interrupted during `manage.py migrate --no-input -v 0`" in stderr, stderr
    assert not alive(pid)


def test_sigterm_during_setup_stops_the_running_step_and_exits_143(tmp_path):
    """`kill <pid of make run's script>` during setup killed run_dev.py alone (SIGTERM's default) and left the
    running step (here a migrate) behind, orphaned. Now the step is stopped as for Ctrl-C, and the status is
    143 (128 + SIGTERM), as a shell reports a command SIGTERM ended."""
    cwd = scratch(tmp_path)
    proc = start(cwd)
    wait_for_line(proc, "migrating")
    pid = int((cwd / "migrate.pid").read_text())
    os.kill(proc.pid, signal.SIGTERM)
    code, stderr = finish(proc)
    assert code == 143, (code, stderr)
    assert "Traceback" not in stderr, stderr
    assert stderr.strip() == "make run: terminated during `manage.py migrate --no-input -v 0`; stopped.", stderr
    assert not alive(pid)


def _wait_for_lines(proc: subprocess.Popen, lines: set[str], timeout: float = 60) -> None:
    """Wait until each of lines was printed (by run_dev.py or the services), in any order."""
    # The raw pipe, not proc.stdout.readline(): several processes write to it, and a buffered readline may
    # take more than one line from the pipe, leaving the next in Python's buffer where select cannot see it.
    fd, seen = proc.stdout.fileno(), b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while lines - {line.strip() for line in seen.decode().splitlines()} and time.monotonic() < deadline:
            if sel.select(deadline - time.monotonic()):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                seen += chunk
    missing = lines - {line.strip() for line in seen.decode().splitlines()}
    if missing:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"never printed {missing!r}: {seen.decode()!r}, {proc.communicate()}")


@pytest.mark.parametrize("signum,group,status", [
    (signal.SIGINT, True, 130),    # Ctrl-C in the terminal: the whole foreground group
    (signal.SIGINT, False, 130),   # kill -INT of run_dev.py alone
    (signal.SIGTERM, False, 143),  # kill
])
def test_stopping_the_running_services_exits_as_interrupted(tmp_path, signum, group, status):
    """Ctrl-C while web, workers and beat ran stopped them, but make run exited 0, as if they had finished."""
    cwd = scratch(tmp_path, MANAGE_ALL)
    proc = start(cwd, PORTAL_EVENT_WORKER_QUEUES="events", PORTAL_WORKER_QUEUES="work")
    _wait_for_lines(proc, {"serving", "celery worker events", "celery worker work", "celery beat"})
    (os.killpg if group else os.kill)(proc.pid, signum)
    code, stderr = finish(proc)
    assert code == status, (code, stderr)
    assert "Traceback" not in stderr and "exited with" not in stderr, stderr


def test_a_service_killed_by_a_signal_exits_as_a_shell_reports_it(tmp_path):
    """A service killed by a signal (here the web server, by SIGKILL: the OOM killer, say) has a negative return
    code, which make run exited with: sys.exit(-9) is status 247 (256 - 9), not the 137 (128 + 9) a shell
    reports. Now it is 128 + the signal, and the message names the signal."""
    cwd = scratch(tmp_path, MANAGE_ALL)
    proc = start(cwd, PORTAL_EVENT_WORKER_QUEUES="events", PORTAL_WORKER_QUEUES="work")
    _wait_for_lines(proc, {"serving", "celery worker events", "celery worker work", "celery beat"})
    os.kill(int((cwd / "runserver.pid").read_text()), signal.SIGKILL)
    code, stderr = finish(proc)
    assert code == 137, (code, stderr)
    assert "web was killed by SIGKILL; stopping the rest." in stderr, stderr


def test_a_setup_step_killed_by_a_signal_exits_as_a_shell_reports_it(tmp_path):
    """A setup step killed by a signal made make run exit 1; now 128 + the signal, as for a service."""
    cwd = scratch(tmp_path)
    proc = start(cwd)
    wait_for_line(proc, "migrating")
    os.kill(int((cwd / "migrate.pid").read_text()), signal.SIGKILL)
    code, stderr = finish(proc)
    assert code == 137, (code, stderr)
    assert "make run: `manage.py migrate --no-input -v 0` was killed by SIGKILL; see its output above." in stderr, \
        stderr
