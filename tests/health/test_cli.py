"""The agent CLI, run as a real subprocess: JSON validated against report.schema.json, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from provisioning.health.fake_nvml import ENV_VAR

from .conftest import validate_report

ROOT = Path(__file__).resolve().parents[2]


def agent(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """Run the agent CLI in a clean environment (no Django settings) and return rc, stdout, stderr."""
    environ = {key: value for key, value in os.environ.items() if key not in (ENV_VAR, "DJANGO_SETTINGS_MODULE")}
    environ.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "provisioning.health.agent", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def report_of(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    rc, out, err = agent(*args, env=env)
    try:
        report = json.loads(out)
    except ValueError:
        pytest.fail(f"stdout is not JSON (rc={rc}): {out[:500]} {err[:500]}")
    return rc, validate_report(report)


def fake(*faults: dict[str, Any], **node: Any) -> str:
    return json.dumps({"model": "H100-SXM", "seed": 1, **node, "faults": list(faults)})


@pytest.mark.parametrize(
    ("faults", "verdict", "rc"),
    [
        ((), "pass", 0),
        (({"kind": "persistence_off", "gpu": 1},), "warn", 1),
        (({"kind": "xid", "gpu": 2, "xid": 79},), "fail", 2),
        (({"kind": "not_supported", "call": "nvmlDeviceGetPcieReplayCounter"},), "unknown", 3),
    ],
)
def test_exit_code_follows_the_verdict(faults: tuple[dict[str, Any], ...], verdict: str, rc: int) -> None:
    code, report = report_of("--level", "quick", "--json", "--fake", fake(*faults), "--hostname", "gpu-7")
    assert report["verdict"] == verdict
    assert code == rc
    assert report["hostname"] == "gpu-7"
    assert report["level"] == "quick"
    assert len(report["gpus"]) == 8


def test_real_pynvml_without_a_gpu_gives_valid_json_and_no_pass() -> None:
    code, report = report_of("--level", "quick", "--json")
    assert report["verdict"] in ("fail", "unknown")
    assert code in (2, 3)
    init = next(c for c in report["node_checks"] if c["name"] == "nvml_init")
    assert init["status"] != "pass"
    assert "NVMLError_" in init["message"]
    assert report["gpus"] == []
    assert "nvml" in report["parts_unknown"]


def test_real_pynvml_medium_level_skips_the_tools() -> None:
    code, report = report_of("--level", "medium", "--json")
    assert code in (2, 3)
    assert {"dcgm_diag", "nvbandwidth", "nccl_all_reduce"} <= set(report["parts_unknown"])


def test_fleet_spec_from_the_environment_picks_the_host() -> None:
    fleet = {
        "default": {"model": "A100-80GB"},
        "nodes": {"a100-003": [{"kind": "remap_failure", "gpu": 4}], "a100-004": {"gpus": 7}},
    }
    env = {ENV_VAR: json.dumps(fleet)}
    code, healthy = report_of("--json", "--hostname", "a100-001", env=env)
    assert (code, healthy["verdict"], healthy["gpu_model"]) == (0, "pass", "A100-80GB")
    code, broken = report_of("--json", "--hostname", "a100-003", env=env)
    assert (code, broken["verdict"], broken["recommended_action"]) == (2, "fail", "replace_gpu")
    assert broken["gpus"][4]["verdict"] == "fail"
    code, short = report_of("--json", "--hostname", "a100-004", env=env)
    assert code == 2 and short["gpu_count"] == 7


def test_state_file_reports_an_xid_once_across_invocations(tmp_path: Path) -> None:
    spec = fake({"kind": "xid", "gpu": 0, "xid": 48})
    state = str(tmp_path / "state.json")
    first, _ = report_of("--json", "--fake", spec, "--state", state)
    second, report = report_of("--json", "--fake", spec, "--state", state)
    assert (first, second) == (2, 0)
    assert report["verdict"] == "pass"


def test_kernel_log_file_option(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("Nov 29 10:14:07 gpu-7 kernel: NVRM: Xid (PCI:0000:3a:00): 64, pid='<unknown>', name=<unknown>, x\n")
    code, report = report_of("--json", "--fake", fake(), "--kernel-log", str(log))
    assert code == 2
    assert report["gpus"][2]["action"] == "replace_gpu"


def test_threshold_overrides_file(tmp_path: Path) -> None:
    overrides = tmp_path / "thresholds.json"
    overrides.write_text(json.dumps({"H100-SXM": {"gpus_per_node": 4}}))
    code, report = report_of("--json", "--fake", fake(), "--thresholds", str(overrides))
    assert code == 2
    assert report["expected_gpus"] == 4
    assert report["problems"][0]["check"] == "gpu_count"


def test_pins_and_peers_options() -> None:
    code, report = report_of("--json", "--fake", fake(), "--driver-pin", "535.129.03", "--cuda-pin", "13.0")
    assert code == 1
    assert [p["check"] for p in report["problems"]] == ["driver_version"]
    code, report = report_of("--json", "--level", "full", "--fake", fake(), "--peers", "n2,n3", "--peers", "n4")
    assert code == 3
    ib = next(c for c in report["node_checks"] if c["name"] == "ib_write_bw")
    assert "not installed" in ib["message"]


def test_text_output_and_usage_errors() -> None:
    code, out, _ = agent("--fake", fake({"kind": "hot", "gpu": 6}), "--hostname", "gpu-9")
    assert code == 1
    assert out.splitlines()[0].startswith("gpu-9 quick: WARN (action: monitor")
    assert "gpu6 temperature: warn" in out
    code, _, err = agent("--level", "extreme")
    assert code == 64 and "invalid choice" in err


def test_a_broken_fake_spec_still_prints_a_report() -> None:
    code, report = report_of("--json", "--fake", '{"model": "H100-SXM", "faults": [{"kind": "no_such_fault"}]}')
    assert code == 3
    assert report["verdict"] == "unknown"
    assert "no_such_fault" in report["node_checks"][0]["message"]


def test_a_hung_gpu_does_not_hang_the_agent() -> None:
    spec = fake({"kind": "hang", "gpu": 1, "call": "nvmlDeviceGetTemperatureV", "seconds": 30})
    code, report = report_of("--json", "--fake", spec, "--nvml-timeout", "1")
    assert code == 3
    assert report["duration_s"] < 10
    responsive = next(c for c in report["gpus"][1]["checks"] if c["name"] == "responsive")
    assert responsive["value"] == "nvmlDeviceGetTemperatureV"


def test_the_agent_imports_no_django() -> None:
    code = (
        "import sys, runpy; sys.argv = ['agent', '--json', '--fake', '{}'];\n"
        "try:\n    runpy.run_module('provisioning.health.agent', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert not [m for m in sys.modules if m == 'django' or m.startswith('django.')], 'django imported'\n"
        "print('no-django')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no-django")
