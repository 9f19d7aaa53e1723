"""bench/run_all.py: runs every benchmark, passes their output through, summarises the ratio lines,
and fails when one fails or reports no ratio."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_run_all",
                                               Path(__file__).resolve().parents[2] / "bench" / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)


@pytest.fixture
def benches(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    (d / "alpha.py").write_text("print('warming up')\nprint('ratio: alpha/limit = 0.80 (goal <= 1)')\n")
    (d / "beta.py").write_text("print('RATIO api/sql = 1.70')\nprint('p50 12 ms')\n")
    (d / "_shared.py").write_text("raise SystemExit('helpers are never run')\n")
    (d / "run_all.py").write_text("raise SystemExit('the runner never runs itself')\n")
    return d


def test_runs_every_benchmark_and_prints_each_ratio(benches, capsys):
    assert run_all.main(["--dir", str(benches)]) == 0
    out = capsys.readouterr().out
    assert "  alpha | warming up" in out  # output passes through as it runs
    summary = out.split("== summary", 1)[1]
    assert "alpha            ratio: alpha/limit = 0.80 (goal <= 1)" in summary
    assert "beta             RATIO api/sql = 1.70" in summary
    assert "helpers are never run" not in out and "never runs itself" not in out


def test_a_failing_or_silent_benchmark_fails_the_run_after_all_ran(benches, capsys):
    (benches / "crash.py").write_text("print('ratio: 2.0')\nraise SystemExit(3)\n")
    (benches / "quiet.py").write_text("print('done')\n")
    assert run_all.main(["--dir", str(benches)]) == 1
    summary = capsys.readouterr().out.split("== summary", 1)[1]
    assert "crash            FAILED (exit 3" in summary
    assert "quiet            FAILED (printed no ratio" in summary
    assert "beta             RATIO api/sql = 1.70" in summary


def test_a_benchmark_past_its_timeout_is_stopped(benches, capsys):
    (benches / "slow.py").write_text("import time\nprint('ratio: 1', flush=True)\ntime.sleep(30)\n")
    assert run_all.main(["--dir", str(benches), "--timeout", "2", "slow"]) == 1
    assert "slow             FAILED (timed out" in capsys.readouterr().out


def test_the_real_bench_directory_is_discovered():
    names = [p.stem for p in run_all.discover(run_all.HERE, [])]
    assert "availability" in names and "run_all" not in names
    assert not [n for n in names if n.startswith("_")]
