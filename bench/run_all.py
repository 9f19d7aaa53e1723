#!/usr/bin/env python
"""Run every benchmark in bench/ (each `*.py` here except this runner and `_`-prefixed helpers),
one after another in its own process, and print each one's ratio line(s) at the end.

    python bench/run_all.py                # what `make bench` runs
    python bench/run_all.py availability   # only the named ones
    BENCH_TIMEOUT=3600 python bench/run_all.py

A benchmark reports by printing a line that contains "ratio" (e.g. ``ratio: API / hand SQL =
1.6 at p50 …``); its full output is passed through as it runs. The runner exits non-zero when a
benchmark fails, times out or prints no ratio, after running all of them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIO = re.compile(r"\bratio\b", re.IGNORECASE)


def discover(directory: Path, only: list[str]) -> list[Path]:
    found = sorted(p for p in directory.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))
    if only:
        wanted = {name.removesuffix(".py") for name in only}
        missing = wanted - {p.stem for p in found}
        if missing:
            sys.exit(f"run_all: no benchmark named {', '.join(sorted(missing))} in {directory}")
        found = [p for p in found if p.stem in wanted]
    return found


def run(path: Path, timeout: float) -> tuple[int | str, list[str], float]:
    """Run one benchmark, echoing its output; return (exit status or 'timeout', ratio lines, seconds)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(path)], cwd=path.parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    expired = threading.Event()

    def stop() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    ratios: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  {path.stem} | {line}", end="", flush=True)
            if RATIO.search(line):
                ratios.append(line.strip())
        status = proc.wait()
    finally:
        timer.cancel()
    return ("timeout" if expired.is_set() else status), ratios, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark in bench/ and print their ratios.")
    parser.add_argument("names", nargs="*", help="benchmark file names (without .py); default: all")
    parser.add_argument("--dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("BENCH_TIMEOUT", "3600")))
    args = parser.parse_args(argv)
    benches = discover(args.dir, args.names)
    if not benches:
        print(f"run_all: no benchmarks in {args.dir}")
        return 1
    results = []
    for path in benches:
        print(f"== {path.stem}", flush=True)
        results.append((path.stem, *run(path, args.timeout)))
    print("\n== summary")
    failed = 0
    for name, status, ratios, seconds in results:
        if status != 0 or not ratios:
            failed += 1
            why = "timed out" if status == "timeout" else f"exit {status}" if status != 0 else "printed no ratio"
            print(f"{name:<16} FAILED ({why}, {seconds:.0f} s)")
        for ratio in ratios:
            print(f"{name:<16} {ratio}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
