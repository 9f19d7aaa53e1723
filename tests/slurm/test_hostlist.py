"""Hostlist expansion and compression, checked by round trips and against Slurm's parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provisioning.backends.hostlist import HostlistError, compress, expand

prefixes = st.sampled_from(["h100-sxm-", "a100-", "n", "gpu", "rack1-n", "x.y-"])
numbers = st.integers(min_value=0, max_value=1200)
widths = st.integers(min_value=0, max_value=4)
numbered = st.builds(lambda p, n, w: f"{p}{n:0{w}d}" if w else f"{p}{n}", prefixes, numbers, widths)
plain = st.from_regex(r"[a-z][a-z.-]{0,8}[a-z]", fullmatch=True)
hostnames = st.one_of(numbered, numbered, numbered, plain)
host_sets = st.lists(hostnames, max_size=40)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("h100-sxm-[001-003,007]", ["h100-sxm-001", "h100-sxm-002", "h100-sxm-003", "h100-sxm-007"]),
        ("n[9-10]", ["n9", "n10"]),
        ("n[08-10],login", ["n08", "n09", "n10", "login"]),
        ("a[1,01]", ["a1", "a01"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("single", ["single"]),
        ("", []),
    ],
)
def test_expand_examples(hostlist: str, hosts: list[str]) -> None:
    assert expand(hostlist) == hosts


@pytest.mark.parametrize(
    ("hosts", "hostlist"),
    [
        (["h100-sxm-007", "h100-sxm-001", "h100-sxm-003", "h100-sxm-002"], "h100-sxm-[001-003,007]"),
        (["n9", "n10", "n11"], "n[9-11]"),
        (["n099", "n100", "n101"], "n[099-101]"),
        (["n1-ib", "n2-ib"], "n1-ib,n2-ib"),
        (["h100-sxm-001"], "h100-sxm-001"),
        (["b2", "b1", "b1"], "b[1-2]"),
    ],
)
def test_compress_examples(hosts: list[str], hostlist: str) -> None:
    assert compress(hosts) == hostlist


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[3-1]", "n[]", "n[a-b]", "a,,b", "n[1-[2]]"])
def test_malformed_hostlists_are_refused(bad: str) -> None:
    with pytest.raises(HostlistError):
        expand(bad)


def test_compress_refuses_names_with_hostlist_syntax() -> None:
    with pytest.raises(HostlistError):
        compress(["n[1]"])


@settings(deadline=None)  # a stalled CI machine must not fail a correct example
@given(host_sets)
def test_round_trip_keeps_the_set(hosts: list[str]) -> None:
    text = compress(hosts)
    expanded = expand(text)
    assert sorted(expanded) == sorted(set(hosts))
    assert len(expanded) == len(set(hosts))


@settings(deadline=None)  # a stalled CI machine must not fail a correct example
@given(host_sets)
def test_compress_is_canonical(hosts: list[str]) -> None:
    text = compress(hosts)
    assert compress(reversed(hosts)) == text
    assert compress(expand(text)) == text


@pytest.mark.slurm
@settings(max_examples=30, deadline=None)
@given(st.lists(numbered, min_size=1, max_size=25))
def test_slurm_expands_our_compression_to_the_same_names(scontrol_hostnames, hosts: list[str]) -> None:
    assert sorted(scontrol_hostnames(compress(hosts))) == sorted(set(hosts))


@pytest.mark.slurm
@pytest.mark.parametrize(
    "hostlist", ["h100-sxm-[001-003,007]", "n[9-10,008,099-100]", "a[1,01],b,c[5]", "rack[1-2]-n[01-02]"]
)
def test_expand_agrees_with_slurm(scontrol_hostnames, hostlist: str) -> None:
    assert expand(hostlist) == scontrol_hostnames(hostlist)


@pytest.fixture(scope="session")
def scontrol_hostnames(scontrol):
    def run(hostlist: str) -> list[str]:
        output = scontrol("show", "hostnames", hostlist)
        assert "Invalid" not in output, output
        return output.split()

    return run
