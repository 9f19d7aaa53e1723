"""The production image installs the portal's runtime dependencies, not its test toolchain.

requirements.lock is compiled with `--group dev` (pytest, Playwright, ruff, …): the Dockerfile installs only
the part of it that pyproject's [project].dependencies reach (bin/runtime_requirements.py), with --no-deps
and then `pip check`, so the image holds exactly the locked versions and nothing the portal does not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bin" / "runtime_requirements.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def runtime_pins() -> dict[str, str]:
    result = subprocess.run([sys.executable, str(SCRIPT), str(ROOT / "requirements.lock")],
                            capture_output=True, text=True, timeout=60, check=True)
    pins = {}
    for line in result.stdout.splitlines():
        name, _, version = line.partition("==")
        pins[canonicalize_name(name)] = version
    return pins


def locked_pins() -> dict[str, str]:
    return {canonicalize_name(m.group(1)): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M)}


def test_the_dockerfile_installs_the_runtime_part_of_the_lock_and_checks_it():
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY requirements.lock pyproject.toml bin/runtime_requirements.py ./" in text
    install = re.search(r"^RUN (python runtime_requirements\.py.*)$", text, re.M)
    assert install, "the build stage must install the runtime requirements, not requirements.lock"
    assert "pip install --no-deps -r" in install.group(1) and "pip check" in install.group(1)
    assert "pip install -r requirements.lock" not in text


def needed() -> set[str]:
    """The packages [project].dependencies reach, with the extras asked for, by the installed metadata."""
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    extras: dict[str, set[str]] = {}
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name in extras and set(req.extras) <= extras[name]:
            continue
        extras.setdefault(name, set()).update(req.extras)
        for raw in metadata.distribution(name).requires or []:
            dep = Requirement(raw)
            env = [{"extra": e} for e in extras[name]] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in env):
                wanted.append(dep)
    return set(extras)


def test_the_runtime_requirements_are_complete():
    """Every requirement of every runtime package (with the extras asked for) is in the set — what
    `pip check` verifies in the image, checked here against the installed metadata."""
    missing = needed() - set(runtime_pins())
    assert not missing, f"needed at run time but left out: {missing}"


def test_the_runtime_requirements_leave_out_the_dev_group_and_keep_the_locked_versions():
    pins = runtime_pins()
    locked = locked_pins()
    dev = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependency-groups"]["dev"]}
    dev_only = dev - needed()
    assert {"pytest", "playwright", "ruff", "hypothesis"} <= dev_only
    assert not dev_only & set(pins), dev_only & set(pins)
    assert all(locked[name] == version for name, version in pins.items())
    assert len(pins) < len(locked)
