"""Every `manage.py` command line the operator docs and the README show parses with that command's own
argument parser: the command exists (test_alerts.py checks names only), and so do its flags, in the
form written. Placeholders (USERNAME, N, PREFIX) get a sample value; an optional part in [brackets]
is tried with and without it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from django.core.management import CommandError, get_commands, load_command_class

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command line: in a `code span`, or a line of a ```sh block; up to a comment or the span's end.
LINE = re.compile(r"manage\.py ([a-z_]+)([^`#\n…]*)")
SAMPLES = {"USERNAME": "research-lead", "N": "30", "PREFIX": "gpp_AbC123xy"}


def documented() -> list[tuple[str, str, list[str]]]:
    out = []
    for path in DOCS:
        for number, text in enumerate(path.read_text().splitlines(), 1):
            for spans in re.findall(r"`([^`]*manage\.py [^`]*)`", text) or ([text] if "manage.py" in text else []):
                for name, rest in LINE.findall(spans):
                    out.append((f"{path.name}:{number}", name, rest.strip()))
    return out


def variants(rest: str) -> list[list[str]]:
    """The argument lists a synopsis stands for: each [optional part] left out and put in. A line without one
    is split as the shell splits it (a quoted argument, `shell -c "…"`, stays one)."""
    sampled = re.sub(r"\b[A-Z]+\b", lambda m: SAMPLES.get(m.group(), m.group()), rest)
    if "[" not in sampled:
        return [shlex.split(sampled)]
    joined = " ".join(shlex.split(sampled))
    optional = re.findall(r"\[([^\]]*)\]", joined)
    bare = re.sub(r"\s*\[[^\]]*\]", "", joined).split()
    full = re.sub(r"\[([^\]]*)\]", r"\1", joined).split()
    return [bare, full] if optional else [bare]


CASES = documented()


def test_the_docs_show_the_commands_operators_need():
    names = {name for _, name, _ in CASES}
    assert {"issue_token", "revoke_token", "reconcile", "rebuild_slot_usage", "rotate_credentials",
            "seed_scale", "notifications_receiver", "createsuperuser"} <= names, names


@pytest.mark.parametrize(("where", "name", "rest"), CASES, ids=[f"{w} {n} {r}".strip() for w, n, r in CASES])
def test_each_documented_command_line_parses(where, name, rest):
    commands = get_commands()
    assert name in commands, f"{where}: no management command {name}"
    parser = load_command_class(commands[name], name).create_parser("manage.py", name)
    for args in variants(rest):
        try:
            parser.parse_args(args)
        except (CommandError, SystemExit):
            pytest.fail(f"{where}: manage.py {name} {' '.join(args)} does not parse")
