"""`make run` whose setup step fails (services, migrate, seed_demo, collectstatic) stops with that step's
exit status and one line naming it, not a Python traceback of bin/run_dev.py under the step's own output.

bin/run_dev.py is run for real from a scratch copy of the checkout's layout whose bin/devservices.py
exits 3 (as it does when, say, the embedded PostgreSQL cannot start): nothing of the checkout runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_setup_step_is_named_and_its_exit_status_kept(tmp_path):
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / "bin" / "run_dev.py", tmp_path / "bin" / "run_dev.py")
    (tmp_path / "bin" / "devservices.py").write_text(
        "import sys\nprint('embedded PostgreSQL: could not start', file=sys.stderr)\nsys.exit(3)\n")
    (tmp_path / "manage.py").write_text("raise SystemExit('manage.py must not run after a failed step')\n")
    done = subprocess.run([sys.executable, str(tmp_path / "bin" / "run_dev.py")], cwd=tmp_path,  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "CalledProcessError" not in done.stderr, done.stderr
    assert "embedded PostgreSQL: could not start" in done.stderr  # the step's own words stay
    assert "bin/devservices.py up" in done.stderr and "exit status 3" in done.stderr, done.stderr
    assert "manage.py must not run" not in done.stderr
