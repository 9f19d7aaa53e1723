"""scripts/install-system-deps.sh puts the host's policy-rc.d back however apt-get ends.

It writes an "exit 101" policy-rc.d so that a package's postinst starts no service; an apt-get that
failed used to leave it there (set -e exits before the restore), and every later service start on the
host was refused. apt-get and dpkg-query are stand-ins on PATH here; the policy file lives in a temp
folder (PORTAL_POLICY_RC_D), never /usr/sbin.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-system-deps.sh"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def host(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "dpkg-query", "exit 1")  # nothing installed: the script installs
    _stub(bin_dir, "sudo", 'shift; exec "$@"')  # a non-root runner's "sudo -n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PORTAL_POLICY_RC_D": str(tmp_path / "policy-rc.d")}
    return bin_dir, tmp_path / "policy-rc.d", env


def _run(env):
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_a_failed_install_leaves_no_policy_behind(host):
    bin_dir, policy, env = host
    _stub(bin_dir, "apt-get", '[ "$1" = install ] && { echo "E: broken" >&2; exit 100; }; exit 0')
    result = _run(env)
    assert result.returncode != 0
    assert not policy.exists(), "the exit-101 policy-rc.d was left behind after a failed apt-get install"


def test_a_failed_install_puts_the_hosts_own_policy_back(host):
    bin_dir, policy, env = host
    policy.write_text("#!/bin/sh\nexit 0\n")
    _stub(bin_dir, "apt-get", '[ "$1" = install ] && exit 100; exit 0')
    assert _run(env).returncode != 0
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert not Path(f"{policy}.portal-saved").exists()


def test_during_the_install_services_are_kept_off(host):
    bin_dir, policy, env = host
    seen = policy.parent / "seen"
    # apt-get install records the policy it ran under, then fails so the script stops before install-slurm.sh.
    _stub(bin_dir, "apt-get", f'[ "$1" = install ] && {{ cat "{policy}" > "{seen}"; exit 100; }}; exit 0')
    _run(env)
    assert "exit 101" in seen.read_text()
    assert not policy.exists()
