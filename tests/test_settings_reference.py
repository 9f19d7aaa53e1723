"""docs/settings.md has a row for every setting the code reads from the environment, and no stale ones.

"Read" means what the code can look up, found by parsing the source (not its comments or
docstrings): a string literal that is exactly a ``PORTAL_*`` name (``env("PORTAL_X")``,
``setting("PORTAL_X", …)``, ``getattr(settings, "PORTAL_X", …)``, ``os.environ.get("PORTAL_X")``),
or a ``PORTAL_*`` identifier (a module-level setting in portal/settings, ``settings.PORTAL_X``).
Plain Python over the files: no database, no Django setup beyond what pytest-django already did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "settings.md"
# The apps and the developer scripts; never migrations (and tests live outside these folders).
SOURCE_DIRS = ("portal", "tenants", "reservations", "provisioning", "notifications", "bin")

PORTAL_NAME = re.compile(r"PORTAL_[A-Z0-9_]+")
# A name in the document: not the tail of a longer identifier.
DOC_NAME = re.compile(r"(?<![A-Za-z0-9_])PORTAL_[A-Z0-9_]+")
# The first cell of a table row: | `NAME` | …
ROW = re.compile(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|", re.MULTILINE)

# Names built at run time from a literal prefix (an f-string), each mapped to every name the code
# can build from it. The document lists the expanded names; the scan must still find each prefix,
# and test_dynamic_names_are_the_ones_the_code_builds keeps each expansion honest.
DYNAMIC = {
    # provisioning/health/conf.py level_timeout_s: f"PORTAL_HEALTH_TIMEOUT_{level.upper()}", per CheckLevel.
    "PORTAL_HEALTH_TIMEOUT_": (
        "PORTAL_HEALTH_TIMEOUT_QUICK",
        "PORTAL_HEALTH_TIMEOUT_MEDIUM",
        "PORTAL_HEALTH_TIMEOUT_FULL",
    ),
}


def _source_files() -> list[Path]:
    files = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "migrations" in path.relative_to(ROOT).parts:
                continue
            files.append(path)
    return files


def _scan(files: list[Path]) -> tuple[set[str], set[str]]:
    """Return (names read, prefixes of names built at run time) in these files."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for path in files:
        text = path.read_text()
        if "PORTAL_" not in text:
            continue
        # The literal parts of an f-string are judged with it, never as names of their own: ast.walk
        # goes breadth first, so an f-string is met (and its parts noted) before its parts are.
        parts: set[int] = set()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.JoinedStr):
                parts.update(id(part) for part in node.values)
                head = node.values[0] if node.values else None
                if (len(node.values) > 1 and isinstance(head, ast.Constant) and isinstance(head.value, str)
                        and PORTAL_NAME.fullmatch(head.value)):
                    prefixes.add(head.value)
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
                candidate = node.value
            elif isinstance(node, ast.Name):
                candidate = node.id
            elif isinstance(node, ast.Attribute):
                candidate = node.attr
            else:
                continue
            if candidate.startswith("PORTAL_") and PORTAL_NAME.fullmatch(candidate):
                (prefixes if candidate.endswith("_") else names).add(candidate)
    return names, prefixes


def _read_names() -> set[str]:
    names, prefixes = _scan(_source_files())
    unknown = prefixes - DYNAMIC.keys()
    assert not unknown, f"names built at run time from {sorted(unknown)}: add their expansions to DYNAMIC"
    gone = DYNAMIC.keys() - prefixes
    assert not gone, f"DYNAMIC lists {sorted(gone)}, which no code builds names from any more"
    for prefix in prefixes:
        names.update(DYNAMIC[prefix])
    return names


def _settings_env_names() -> set[str]:
    """Every variable portal/settings/*.py reads with env(...), env.int(...), env.list(...), …"""
    names = set()
    for path in sorted((ROOT / "portal" / "settings").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            is_env = (isinstance(func, ast.Name) and func.id == "env") or (
                isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env")
            first = node.args[0]
            if is_env and isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def test_every_portal_setting_read_has_one_row_and_no_row_is_stale():
    doc = DOC.read_text()
    read = _read_names()
    rows = ROW.findall(doc)
    assert len(read) > 50, "the scan found too few settings: is it still looking in the right place?"

    missing = sorted(read - set(rows))
    assert not missing, f"read by the code but without a row in docs/settings.md: {missing}"
    twice = sorted({name for name in rows if rows.count(name) > 1})
    assert not twice, f"more than one row in docs/settings.md: {twice}"

    mentioned = set(DOC_NAME.findall(doc))
    partial = sorted(name for name in mentioned if name.endswith("_"))
    assert not partial, f"docs/settings.md writes a name in part; spell each one out: {partial}"
    stale = sorted(mentioned - read)
    assert not stale, f"docs/settings.md names settings no code reads any more: {stale}"


def test_every_environment_variable_the_settings_modules_read_has_a_row():
    rows = set(ROW.findall(DOC.read_text()))
    missing = sorted(_settings_env_names() - rows)
    assert not missing, f"portal/settings reads these without a row in docs/settings.md: {missing}"


def test_dynamic_names_are_the_ones_the_code_builds():
    from provisioning.health.choices import CheckLevel
    from provisioning.health.conf import LEVEL_TIMEOUTS_S

    built = {f"PORTAL_HEALTH_TIMEOUT_{level.upper()}" for level in CheckLevel.values}
    assert set(DYNAMIC["PORTAL_HEALTH_TIMEOUT_"]) == built
    assert set(LEVEL_TIMEOUTS_S) == set(CheckLevel.values), "every level has a default timeout"


def test_the_scan_finds_what_it_should_and_skips_what_it_should_not(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""PORTAL_IN_A_DOCSTRING is only mentioned."""\n'
        "# PORTAL_IN_A_COMMENT too\n"
        "import os\n"
        "_PORTAL_PATTERN = 1\n"
        'A = os.environ.get("PORTAL_FROM_ENVIRON", "x")\n'
        'B = setting("PORTAL_FROM_HELPER", 1)\n'
        "C = settings.PORTAL_FROM_ATTRIBUTE\n"
        "PORTAL_ASSIGNED = 3\n"
        'D = f"PORTAL_BUILT_{level}"\n'
        'E = f"PORTAL_IN_A_MESSAGE={value} is wrong"\n'
        'F = f""\n'
    )
    names, prefixes = _scan([sample])
    assert names == {"PORTAL_FROM_ENVIRON", "PORTAL_FROM_HELPER", "PORTAL_FROM_ATTRIBUTE", "PORTAL_ASSIGNED"}
    assert prefixes == {"PORTAL_BUILT_"}


# --- Defaults: the row's "Default" cell gives the value the code falls back to ----------------------

# Functions whose call reads a variable with a fallback: env(...)/env.int(...)/env_list(...) in the
# settings modules, setting(...)/setting_int(...)/_setting(...)/conf.setting_float(...) at call time,
# os.environ.get(...) in the developer scripts. gunicorn.conf.py's variables are documented there.
READERS = re.compile(r"env|env_list|_?setting(_\w+)?")
# Fallbacks that are not the documented default, with why.
NOT_A_DEFAULT = {
    # The node agent takes the broker from CELERY_BROKER_URL, else REDIS_URL, and refuses to start without.
    ("portal/settings/node_agent.py", "CELERY_BROKER_URL"),
    ("portal/settings/node_agent.py", "REDIS_URL"),
    # base.py only asks whether it runs production before reading var/dev.env.
    ("portal/settings/base.py", "DJANGO_SETTINGS_MODULE"),
    # The metrics read Django's REDIS_URL / CELERY_BROKER_URL, which the settings modules always define.
    ("portal/ops/collectors.py", "CELERY_BROKER_URL"),
    ("portal/ops/collectors.py", "REDIS_URL"),
    # "a fixed dev key" in the document: the key itself is no business of the reader.
    ("portal/settings/dev.py", "PORTAL_FERNET_KEYS"),
    # "Is PORTAL_HEALTH_STATE_DIR set at all?" (a fake-NVML node keeps state only then), not its default.
    ("provisioning/health/tasks.py", "PORTAL_HEALTH_STATE_DIR"),
}


def _default_cells() -> dict[str, str]:
    cells = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|([^|]*)\|", line)
        if match:
            cells[match.group(1)] = match.group(2)
    return cells


def _literal_defaults(files: list[Path], names: set[str], root: Path = ROOT) -> list[tuple[str, int, str, object]]:
    """(file, line, name, value) for each read of a documented variable with a constant fallback."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            reader = (isinstance(func, ast.Name) and READERS.fullmatch(func.id)) or owner in ("env", "os.environ") or (
                isinstance(func, ast.Attribute) and READERS.fullmatch(func.attr))
            first = node.args[0]
            if not (reader and isinstance(first, ast.Constant) and first.value in names):
                continue
            fallback = node.args[1] if len(node.args) > 1 else None
            fallback = next((kw.value for kw in node.keywords if kw.arg == "default"), fallback)
            if fallback is None or (isinstance(fallback, ast.Constant) and fallback.value is None):
                continue  # no fallback, or None: "unset", the default worked out further on
            try:  # constants and arithmetic on them (1024 * 1024); a name or a call is no constant default
                value = eval(compile(ast.Expression(fallback), str(path), "eval"), {"__builtins__": {}})  # noqa: S307
            except NameError:
                continue
            out.append((str(path.relative_to(root)), node.lineno, first.value, value))
    return out


def _spelt(value: object) -> set[str]:
    """How the document may write a default: `true`, `600` (for 600.0), `a,b`; empty as "empty"/"unset"."""
    if value in ("", [], None):
        return {"empty", "unset"}
    if isinstance(value, bool):
        return {f"`{str(value).lower()}`"}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, list):
        return {f"`{','.join(value)}`", f"`{', '.join(value)}`"}
    return {f"`{value}`"}


def test_every_documented_default_is_the_one_the_code_falls_back_to():
    cells = _default_cells()
    found = _literal_defaults(_source_files(), set(cells))
    assert len(found) > 80, "the scan found too few defaults: is it still looking in the right place?"
    wrong = [f"{path}:{line}: {name} falls back to {value!r}; docs/settings.md says {cells[name].strip()!r}"
             for path, line, name, value in found
             if (path, name) not in NOT_A_DEFAULT and not any(s in cells[name] for s in _spelt(value))]
    assert not wrong, "\n".join(wrong)


def test_the_default_check_catches_a_wrong_default(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('A = env.int("PORTAL_SLURM_TIMEOUT", default=60)\n'
                      'B = setting("PORTAL_SCONTROL", "scontrol")\n'
                      'C = env.int("SESSION_COOKIE_AGE", default=60 * 60 * 12)\n'
                      'D = setting("PORTAL_SCONTROL", compute())\n')
    found = _literal_defaults([sample], {"PORTAL_SLURM_TIMEOUT", "PORTAL_SCONTROL", "SESSION_COOKIE_AGE"}, tmp_path)
    assert [(line, name, value) for _, line, name, value in found] == [
        (1, "PORTAL_SLURM_TIMEOUT", 60), (2, "PORTAL_SCONTROL", "scontrol"), (3, "SESSION_COOKIE_AGE", 43200)]
    cells = _default_cells()
    assert not any(s in cells["PORTAL_SLURM_TIMEOUT"] for s in _spelt(60))
    assert any(s in cells["PORTAL_SLURM_TIMEOUT"] for s in _spelt(30.0))
    assert any(s in cells["SESSION_COOKIE_AGE"] for s in _spelt(43200))
