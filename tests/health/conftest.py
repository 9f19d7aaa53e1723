"""Shared helpers for the health-check tests: fake nodes, tool stubs on PATH, the report schema.

The real tools (dcgmi, nvbandwidth, nccl-tests, perftest) and GPUs do not exist here, so tools
are replaced by tiny shell scripts that print captured-looking outputs from tests/health/data.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from provisioning.health.agent import SCHEMA_PATH, run_checks
from provisioning.health.checks import format_cuda_version
from provisioning.health.fake_nvml import DEFAULT_CUDA, DEFAULT_DRIVER, FakeNvml

DATA = Path(__file__).parent / "data"
PINS: dict[str, Any] = {"driver_pin": DEFAULT_DRIVER, "cuda_pin": format_cuda_version(DEFAULT_CUDA)}
SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())

SH = shutil.which("sh") or "/bin/sh"
CAT = shutil.which("cat") or "/bin/cat"
SLEEP = shutil.which("sleep") or "/bin/sleep"


def validate_report(report: dict[str, Any]) -> dict[str, Any]:
    """Assert the report matches report.schema.json and return it."""
    errors = sorted(VALIDATOR.iter_errors(report), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    return report


def quick(nvml: FakeNvml, **kwargs: Any) -> dict[str, Any]:
    """Run the quick level against a fake with the fleet pins and no event wait; validate the report."""
    options: dict[str, Any] = {"event_wait_ms": 0, **PINS, **kwargs}
    return validate_report(run_checks("quick", nvml, **options))


def check(report: dict[str, Any], name: str, gpu: int | None = None) -> dict[str, Any]:
    """Return the one check called name, of a GPU or (gpu None) of the node."""
    checks = report["node_checks"] if gpu is None else report["gpus"][gpu]["checks"]
    found = [c for c in checks if c["name"] == name]
    assert len(found) == 1, f"{name} on {gpu}: {[c['name'] for c in checks]}"
    return found[0]


class ToolBox:
    """Installs stub executables into a directory that is the whole PATH."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir

    def install(self, name: str, sample: str | None = None, rc: int = 0, sleep_s: float = 0, stderr: str = "") -> Path:
        """Install NAME printing DATA/sample, recording its argv in NAME.args, exiting rc."""
        lines = [f"#!{SH}", f'printf "%s\\n" "$@" > {shlex.quote(str(self.bindir / (name + ".args")))}']
        if sleep_s:
            lines.append(f"{SLEEP} {sleep_s}")
        if sample:
            lines.append(f"{CAT} {shlex.quote(str(DATA / sample))}")
        if stderr:
            lines.append(f"printf '%s\\n' {shlex.quote(stderr)} >&2")
        lines.append(f"exit {rc}")
        return self.script(name, "\n".join(lines) + "\n")

    def script(self, name: str, text: str) -> Path:
        """Install NAME with the given script text."""
        path = self.bindir / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def args(self, name: str) -> list[str]:
        """Return the argv the stub NAME was last called with."""
        return (self.bindir / (name + ".args")).read_text().splitlines()


@pytest.fixture
def toolbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ToolBox:
    """Make PATH an empty directory (no real tool can leak in) and return a way to fill it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    return ToolBox(bindir)


@pytest.fixture
def make_fake() -> Callable[..., FakeNvml]:
    """Return a factory of fake H100 nodes with a fixed seed."""

    def make(*faults: Any, model: str = "H100-SXM", gpus: int | None = None, seed: int = 7) -> FakeNvml:
        return FakeNvml(model=model, gpus=gpus, faults=faults, seed=seed, hostname="gpu-h100-001")

    return make
