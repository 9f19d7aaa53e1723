"""Check messages count in plain English: "1 stray compute process", "2 uncorrected ECC errors", "GPU 2"."""

from __future__ import annotations

import pytest

from provisioning.health.checks import check_vbios_consistency
from provisioning.health.fake_nvml import FakeNvml, Fault
from provisioning.health.results import counted, gpus_named

from .conftest import check, quick


@pytest.mark.parametrize(("n", "singular", "plural", "expected"), [
    (0, "path", None, "0 paths"),
    (1, "path", None, "1 path"),
    (2, "path", None, "2 paths"),
    (1, "stray compute process", "stray compute processes", "1 stray compute process"),
    (3, "stray compute process", "stray compute processes", "3 stray compute processes"),
])
def test_counted_says_one_thing_or_several(n: int, singular: str, plural: str | None, expected: str) -> None:
    assert counted(n, singular, plural) == expected


def test_gpus_named_lists_the_indices_without_brackets() -> None:
    assert gpus_named([2]) == "GPU 2"
    assert gpus_named([0, 3]) == "GPUs 0, 3"


@pytest.mark.parametrize(("count", "volatile", "aggregate"), [
    (1, "1 uncorrected ECC error since the driver loaded", "1 uncorrected ECC error over the GPU's life"),
    (2, "2 uncorrected ECC errors since the driver loaded", "2 uncorrected ECC errors over the GPU's life"),
])
def test_uncorrected_ecc_errors_are_counted_in_words(count: int, volatile: str, aggregate: str) -> None:
    report = quick(FakeNvml(seed=1, faults=[Fault("ecc_uncorrected", gpu=0, count=count)]))
    assert check(report, "ecc_uncorrected_volatile", 0)["message"].startswith(volatile)
    assert check(report, "ecc_uncorrected_aggregate", 0)["message"].startswith(aggregate)
    assert "(s)" not in report["gpus"][0]["checks"][0]["message"]


@pytest.mark.parametrize(("count", "expected"), [(1, "1 uncorrected SRAM error;"), (3, "3 uncorrected SRAM errors;")])
def test_uncorrected_sram_errors_are_counted_in_words(count: int, expected: str) -> None:
    report = quick(FakeNvml(seed=1, faults=[Fault("ecc_sram_uncorrected", gpu=0, count=count)]))
    assert check(report, "ecc_corrected", 0)["message"].startswith(expected)


def test_stray_compute_processes_are_counted_in_words() -> None:
    one = quick(FakeNvml(seed=1, faults=[Fault("stray_process", gpu=1)]))
    assert check(one, "compute_processes", 1)["message"] == "1 stray compute process on an idle GPU"
    two = quick(FakeNvml(seed=1, faults=[Fault("stray_process", gpu=1), Fault("stray_process", gpu=1, pid=5353)]))
    assert check(two, "compute_processes", 1)["message"] == "2 stray compute processes on an idle GPU"
    assert check(two, "compute_processes", 0)["message"] == "no compute processes"
    busy = quick(FakeNvml(seed=1, faults=[Fault("stray_process", gpu=1)]), expect_idle=False)
    assert check(busy, "compute_processes", 1)["message"] == "1 compute process of the node's current work"
    assert check(busy, "compute_processes", 0)["message"] == "0 compute processes of the node's current work"


def test_xid_listening_counts_the_gpus_in_words() -> None:
    assert check(quick(FakeNvml(seed=1, gpus=1)), "xid_events")["message"] == "listened for XID events on 1 GPU"
    assert check(quick(FakeNvml(seed=1, gpus=2)), "xid_events")["message"] == "listened for XID events on 2 GPUs"


def test_unreadable_vbios_names_the_gpus_in_words() -> None:
    assert check_vbios_consistency({0: None, 1: "96.00.99.00.01"}).message == "VBIOS version unreadable on GPU 0"
    assert check_vbios_consistency({0: None, 1: None}, ["NotSupported"]).message == (
        "VBIOS version unreadable on GPUs 0, 1: NotSupported")
