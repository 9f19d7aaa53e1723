"""Parsers of dcgmi diag, nvbandwidth, nccl-tests and ib_write_bw outputs."""

from __future__ import annotations

import pytest

from provisioning.health.parsers import (
    parse_dcgmi_diag,
    parse_ib_write_bw,
    parse_nccl_tests,
    parse_nvbandwidth,
)

from .conftest import DATA


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_dcgm4_pass_has_every_gpu_of_every_test() -> None:
    diag = parse_dcgmi_diag(read("dcgmi_diag_r2_pass.json"))  # a banner line precedes the JSON
    assert diag.version == "4.2.3"
    assert diag.runtime_error is None
    assert {(r.category, r.test) for r in diag.results} == {
        ("Deployment", "software"),
        ("Integration", "pcie"),
        ("Hardware", "memory"),
    }
    assert sorted({r.gpu for r in diag.results}) == list(range(8))
    assert {r.status for r in diag.results} == {"pass"}


def test_dcgm4_fail_keeps_messages_and_error_ids() -> None:
    diag = parse_dcgmi_diag(read("dcgmi_diag_r2_fail.json"))
    bad = [r for r in diag.results if r.status != "pass"]
    assert [(r.test, r.gpu, r.status, r.error_ids) for r in bad] == [
        ("pcie", 5, "warn", (28,)),
        ("memory", 3, "fail", (95,)),
    ]
    assert "row remapping failed" in bad[1].messages[0]


def test_dcgm3_gpu_ids_strings_and_skips() -> None:
    diag = parse_dcgmi_diag(read("dcgmi_diag_v3_pass.json"))
    assert diag.version == "3.3.5"
    software = [r for r in diag.results if r.category == "Deployment"]
    assert {r.gpu for r in software} == {None}
    stress = [r for r in diag.results if r.test == "Targeted Stress"]
    assert [r.gpu for r in stress] == list(range(8)) and {r.status for r in stress} == {"skip"}
    assert stress[0].messages == ("Skipped at level 2",)


def test_dcgm_runtime_error_and_garbage() -> None:
    assert "Host engine" in parse_dcgmi_diag(read("dcgmi_diag_runtime_error.json")).runtime_error
    with pytest.raises(ValueError):
        parse_dcgmi_diag("Error: unable to establish a connection to the specified host: localhost")
    with pytest.raises(ValueError):
        parse_dcgmi_diag('{"something": "else"}')


def test_nvbandwidth_text_matrices() -> None:
    tests = parse_nvbandwidth(read("nvbandwidth_h100_slow.txt"))
    assert list(tests) == ["host_to_device_memcpy_ce", "device_to_host_memcpy_ce", "device_to_device_memcpy_read_ce"]
    h2d = tests["host_to_device_memcpy_ce"]
    assert len(h2d.rows) == 1 and len(h2d.rows[0]) == 8 and h2d.rows[0][3] == 27.61
    p2p = tests["device_to_device_memcpy_read_ce"]
    assert len(p2p.rows) == 8 and all(p2p.rows[i][i] is None for i in range(8))
    assert p2p.rows[3][5] == 120.37
    assert p2p.description == "memcpy CE GPU(row) <- GPU(column) bandwidth (GB/s)"


def test_nvbandwidth_json_with_a_waived_test() -> None:
    tests = parse_nvbandwidth(read("nvbandwidth_waived_p2p.json"))
    assert tests["device_to_device_memcpy_read_ce"].status == "waived"
    assert tests["device_to_device_memcpy_read_ce"].values() == []
    assert min(tests["host_to_device_memcpy_ce"].values()) > 55


def test_nvbandwidth_waived_in_text_and_empty_output() -> None:
    text = "Running device_to_device_memcpy_read_ce.\nWaived: Peer access is not available between any devices.\n"
    tests = parse_nvbandwidth(text)
    assert tests["device_to_device_memcpy_read_ce"].status == "waived"
    with pytest.raises(ValueError):
        parse_nvbandwidth("nvbandwidth Version: v0.7\n")


def test_nccl_rows_average_and_validation() -> None:
    result = parse_nccl_tests(read("nccl_all_reduce_h100_pass.txt"))
    assert result.peak_row is not None and result.peak_row.size_bytes == 17179869184
    assert (result.peak_row.oop_busbw, result.peak_row.ip_busbw) == (477.86, 478.19)
    assert result.avg_busbw == pytest.approx(478.0283)
    assert result.out_of_bounds == 0 and result.wrong == 0 and result.failures == []
    wrong = parse_nccl_tests(read("nccl_all_reduce_h100_wrong.txt"))
    assert wrong.wrong == 1 and wrong.out_of_bounds == 1024 and len(wrong.failures) == 1


def test_nccl_older_format_without_root_and_with_float_errors() -> None:
    text = (
        "#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error\n"
        "   268435456      67108864     float     sum   2210.4  121.44  212.52  0e+00   2208.9  121.52  212.67  0e+00\n"
        "  1073741824     268435456     float     sum   8545.2  125.65  219.89  0e+00   8540.1  125.73  220.03  0e+00\n"
    )
    result = parse_nccl_tests(text)
    assert result.peak_row is not None and result.peak_row.oop_busbw == 219.89
    assert result.wrong == 0


def test_nccl_failure_without_rows() -> None:
    text = (
        "gpu-h100-001: Test NCCL failure common.cu:958 'unhandled cuda error'\n .. gpu-h100-001 pid 31337: Test failure"
    )
    result = parse_nccl_tests(text)
    assert result.rows == [] and len(result.failures) == 2
    with pytest.raises(ValueError):
        parse_nccl_tests("# nThread 1 nGpus 8\n")


def test_ib_write_bw_gbits_and_megabytes() -> None:
    result = parse_ib_write_bw(read("ib_write_bw_ndr400_pass.txt"))
    assert (result.size_bytes, result.iterations, result.peak_gbps, result.average_gbps) == (
        8388608,
        5000,
        392.45,
        392.31,
    )
    assert result.device == "mlx5_0"
    megabytes = read("ib_write_bw_ndr400_pass.txt").replace("[Gb/sec]", "[MB/sec]").replace("392.31", "46766.00")
    assert parse_ib_write_bw(megabytes).average_gbps == pytest.approx(392.3, abs=0.1)
    with pytest.raises(ValueError):
        parse_ib_write_bw(" Couldn't connect to gpu-h100-002:18515\nUnable to init the socket connection\n")
