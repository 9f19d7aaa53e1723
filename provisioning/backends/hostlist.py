"""Expand and compress Slurm hostlists such as ``h100-sxm-[001-003,007]``.

Slurm prints node sets in this compressed form (``scontrol show res``) and accepts it in
``Nodes=``; the portal stores one row per hostname. These two functions translate between
the forms without calling Slurm, so they also work where no Slurm is installed.

Rules, matching Slurm's own ``hostlist`` code:

- A hostlist is a comma-separated list of patterns; commas inside brackets separate ranges.
- ``[a-b]`` expands to every integer from ``a`` to ``b`` zero-padded to the width of ``a``
  as written (``[08-10]`` gives ``08 09 10``); a single ``[n]`` keeps its own width.
- Several bracket groups in one pattern multiply (``r[1-2]n[1-2]`` gives four names).
- Compression only brackets a *trailing* run of digits, because Slurm 22.05 rejects text
  after the last bracket (``n[1-2]-ib`` is invalid there); such names stay as they are.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

__all__ = ["HostlistError", "compress", "expand"]

# A name ends in digits when it has a non-empty trailing digit run; the prefix may itself
# contain digits (``h100-sxm-001`` splits into ``h100-sxm-`` and ``001``).
_TRAILING_DIGITS = re.compile(r"^(?P<prefix>.*?)(?P<digits>\d+)$")
_RANGE = re.compile(r"^(?P<lo>\d+)(?:-(?P<hi>\d+))?$")
# Characters that would change the meaning of a hostlist if they were part of a name.
_FORBIDDEN = set("[],") | set(" \t\r\n")

# Refuse absurd ranges instead of allocating millions of strings from one typo.
MAX_HOSTS = 100_000


class HostlistError(ValueError):
    """Raised for a malformed hostlist or hostname."""


def expand(hostlist: str) -> list[str]:
    """Return the hostnames named by ``hostlist``, in the order written, without duplicates.

    An empty or blank string gives an empty list. Malformed input raises
    :class:`HostlistError`.
    """
    hosts: list[str] = []
    seen: set[str] = set()
    for pattern in _split_top_level(hostlist):
        for host in _expand_pattern(pattern):
            if host not in seen:
                seen.add(host)
                hosts.append(host)
                if len(hosts) > MAX_HOSTS:
                    raise HostlistError(f"hostlist names more than {MAX_HOSTS} hosts")
    return hosts


def compress(hosts: Iterable[str]) -> str:
    """Return the shortest bracketed hostlist for ``hosts`` (duplicates are dropped).

    The result is canonical: the same set of names always gives the same string, sorted by
    prefix, then number. ``expand(compress(hosts))`` gives back the same set.
    """
    plain: set[str] = set()
    # (prefix, width) -> numbers; width 0 means "not zero-padded".
    groups: dict[tuple[str, int], set[int]] = {}
    unpadded: list[tuple[str, str]] = []
    for host in hosts:
        _check_hostname(host)
        match = _TRAILING_DIGITS.match(host)
        if match is None:
            plain.add(host)
            continue
        prefix, digits = match["prefix"], match["digits"]
        if len(digits) > 1 and digits.startswith("0"):
            groups.setdefault((prefix, len(digits)), set()).add(int(digits))
        else:
            unpadded.append((prefix, digits))
    # A number without leading zeros can join a padded group of its own length (``100`` fits
    # ``[099-100]``); otherwise it goes to the unpadded group, where width is free.
    for prefix, digits in unpadded:
        key = (prefix, len(digits)) if (prefix, len(digits)) in groups else (prefix, 0)
        groups.setdefault(key, set()).add(int(digits))

    parts: list[tuple[str, int, int, str]] = [(host, -1, -1, host) for host in plain]
    for (prefix, width), numbers in groups.items():
        ordered = sorted(numbers)
        if len(ordered) == 1:
            parts.append((prefix, width, ordered[0], prefix + _fmt(ordered[0], width)))
            continue
        ranges = ",".join(_fmt_range(lo, hi, width) for lo, hi in _runs(ordered))
        parts.append((prefix, width, ordered[0], f"{prefix}[{ranges}]"))
    parts.sort()
    return ",".join(text for *_, text in parts)


def _split_top_level(hostlist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    patterns: list[str] = []
    depth = 0
    current: list[str] = []
    for char in hostlist.strip():
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in hostlist {hostlist!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {hostlist!r}")
        if char == "," and depth == 0:
            patterns.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist {hostlist!r}")
    patterns.append("".join(current))
    stripped = [pattern.strip() for pattern in patterns]
    if any(not pattern for pattern in stripped) and hostlist.strip():
        raise HostlistError(f"empty element in hostlist {hostlist!r}")
    return [pattern for pattern in stripped if pattern]


def _expand_pattern(pattern: str) -> list[str]:
    """Expand one comma-free pattern, multiplying its bracket groups."""
    pieces: list[list[str]] = []
    rest = pattern
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        pieces.append([head])
        pieces.append(_expand_ranges(body, pattern))
    pieces.append([rest])
    hosts = ["".join(combo) for combo in itertools.product(*pieces)]
    for host in hosts:
        _check_hostname(host)
    return hosts


def _expand_ranges(body: str, pattern: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise HostlistError(f"invalid range {item!r} in {pattern!r}")
        lo_text, hi_text = match["lo"], match["hi"]
        if hi_text is None:
            values.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise HostlistError(f"descending range {item!r} in {pattern!r}")
        if hi - lo >= MAX_HOSTS:
            raise HostlistError(f"range {item!r} in {pattern!r} is too large")
        values.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    return values


def _check_hostname(host: str) -> None:
    if not host or any(char in _FORBIDDEN for char in host):
        raise HostlistError(f"invalid hostname {host!r}")


def _runs(ordered: list[int]) -> list[tuple[int, int]]:
    """Group sorted integers into maximal consecutive runs."""
    runs: list[tuple[int, int]] = []
    for number in ordered:
        if runs and number == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    return runs


def _fmt(number: int, width: int) -> str:
    return str(number).zfill(width)


def _fmt_range(lo: int, hi: int, width: int) -> str:
    if lo == hi:
        return _fmt(lo, width)
    # Slurm pads every member of a range to the width of its lower bound as written, so
    # writing ``lo`` at the group's width is enough for ``hi`` to come back the same.
    return f"{_fmt(lo, width)}-{_fmt(hi, width)}"
