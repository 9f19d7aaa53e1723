"""Print the runtime part of requirements.lock: the pins [project].dependencies reach, without the dev group.

requirements.lock is compiled by uv with `--group dev` (pytest, Playwright, ruff, …) for development and CI.
The production image (Dockerfile) installs only what this prints, with --no-deps and then `pip check`:
the same locked versions, and nothing the portal does not run. It follows uv's `# via` annotations from
the packages marked `gpu-portal (pyproject.toml)` (the dev group's are marked `(pyproject.toml:dev)`).
Standard library only: it runs in the build stage before anything is installed.

    python bin/runtime_requirements.py requirements.lock > runtime.txt
"""

from __future__ import annotations

import re
import sys

ROOT_MARK = "gpu-portal (pyproject.toml)"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, tuple[str, set[str]]]:
    """Map each locked package to (its pin line, the packages it is required by)."""
    packages: dict[str, tuple[str, set[str]]] = {}
    current = None
    for line in text.splitlines():
        match = PIN.match(line)
        if match:
            current = normalize(match.group(1))
            packages[current] = (f"{match.group(1)}=={match.group(2)}", set())
            continue
        note = line.strip()
        if current is None or not note.startswith("#"):
            continue
        note = note.lstrip("#").strip()
        if note.startswith("via"):
            note = note[3:].strip()
        if not note:
            continue
        packages[current][1].add(note if note.startswith("gpu-portal") else normalize(note.split()[0]))
    return packages


def runtime(text: str) -> list[str]:
    packages = parse(text)
    keep = {name for name, (_, via) in packages.items() if ROOT_MARK in via}
    if not keep:
        raise SystemExit("no package in the lock is marked 'via gpu-portal (pyproject.toml)'")
    changed = True
    while changed:
        changed = False
        for name, (_, via) in packages.items():
            if name not in keep and via & keep:
                keep.add(name)
                changed = True
    return [packages[name][0] for name in sorted(keep)]


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "requirements.lock"
    with open(path, encoding="utf-8") as f:
        print("\n".join(runtime(f.read())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
