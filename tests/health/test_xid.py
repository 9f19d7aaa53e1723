"""XIDs: kernel-log parsing, live events, and reporting each XID once."""

from __future__ import annotations

from pathlib import Path

from provisioning.health import xid
from provisioning.health.agent import run_checks
from provisioning.health.fake_nvml import FakeNvml, Fault
from provisioning.health.xid import HealthState, parse_kernel_log, xid_policy

from .conftest import DATA, PINS, check, quick, validate_report

LOG = (DATA / "kernel_log_xids.txt").read_text().splitlines()


def test_kernel_log_parser_reads_dmesg_and_journal_lines_once() -> None:
    xids = parse_kernel_log(LOG)
    # two distinct XID 13 lines, the duplicated XID 48 line once, 63, the journal-format 74, 94 with ".0"
    assert [(x.xid, x.pci) for x in xids] == [
        (13, (0, 0x2A, 0)),
        (13, (0, 0x2A, 0)),
        (48, (0, 0x5D, 0)),
        (63, (0, 0x5D, 0)),
        (74, (0, 0x9A, 0)),
        (94, (0, 0xDB, 0)),
    ]
    assert xids[2].detail.startswith("pid='<unknown>', name=<unknown>, An uncorrectable double bit error")
    assert len({x.key for x in xids}) == len(xids)


def test_kernel_log_xids_are_mapped_to_gpus_by_pci_address() -> None:
    fake = FakeNvml(seed=3)  # H100 HGX bus ids 18 2a 3a 5d 9a ab ba db
    report = quick(fake, kernel_log=lambda: LOG)
    by_gpu = {gpu["index"]: check(report, "xid", gpu["index"]) for gpu in report["gpus"]}
    assert [e["xid"] for e in by_gpu[1]["value"]] == [13] and by_gpu[1]["value"][0]["count"] == 2
    assert by_gpu[1]["status"] == "pass"  # application fault: listed, not held against the GPU
    assert [e["xid"] for e in by_gpu[3]["value"]] == [48, 63]
    assert (by_gpu[3]["status"], by_gpu[3]["action"]) == ("fail", "drain_and_reset")
    assert (by_gpu[4]["status"], by_gpu[4]["action"]) == ("fail", "drain_and_reset")
    assert (by_gpu[7]["status"], by_gpu[7]["action"]) == ("warn", "reset_when_idle")
    assert by_gpu[0]["value"] == [] and by_gpu[0]["status"] == "pass"
    assert report["verdict"] == "fail"


def test_the_same_xid_is_reported_once_across_runs() -> None:
    fake = FakeNvml(seed=3, faults=[Fault("xid", gpu=2, xid=79, repeat=2)])
    state = HealthState()
    first = quick(fake, state=state)
    assert check(first, "xid", 2)["status"] == "fail"
    assert check(first, "xid", 2)["value"][0]["count"] == 1  # identical duplicate lines count once
    second = quick(fake, state=state)
    assert check(second, "xid", 2)["status"] == "pass"
    assert second["verdict"] == "pass"


def test_a_new_occurrence_after_reporting_is_reported_again() -> None:
    state = HealthState()
    old = "[  100.000000] NVRM: Xid (PCI:0000:18:00): 92, pid='<unknown>', name=<unknown>, High single-bit ECC"
    new = "[  900.000000] NVRM: Xid (PCI:0000:18:00): 92, pid='<unknown>', name=<unknown>, High single-bit ECC"
    fake = FakeNvml(seed=3)
    assert check(quick(fake, state=state, kernel_log=lambda: [old]), "xid", 0)["status"] == "warn"
    assert check(quick(fake, state=state, kernel_log=lambda: [old]), "xid", 0)["status"] == "pass"
    assert check(quick(fake, state=state, kernel_log=lambda: [old, new]), "xid", 0)["status"] == "warn"


def test_dedup_survives_processes_through_the_state_file(tmp_path: Path) -> None:
    spec = {"model": "H100-SXM", "seed": 9, "faults": [{"kind": "xid", "gpu": 6, "xid": 95}]}
    path = tmp_path / "state" / "health.json"
    first = validate_report(run_checks("quick", FakeNvml.from_spec(spec), state_path=path, event_wait_ms=0, **PINS))
    assert first["verdict"] == "fail"
    assert path.exists()
    saved = HealthState.load(path)
    assert len(saved.reported_xids) == 1
    assert len(saved.counters) == 8  # a baseline per GPU UUID
    # a fresh fake from the same spec has the same log: nothing new to report
    second = validate_report(run_checks("quick", FakeNvml.from_spec(spec), state_path=path, event_wait_ms=0, **PINS))
    assert second["verdict"] == "pass"


def test_corrupt_state_file_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text("{not json")
    state = HealthState.load(path)
    assert state.reported_xids == {} and state.counters == {}
    state.mark_reported("abc")
    state.save(path)
    assert HealthState.load(path).is_reported("abc")


def test_state_forgets_the_oldest_xids_beyond_its_cap() -> None:
    state = HealthState(max_xids=3)
    for key in "abcde":
        state.mark_reported(key)
    assert list(state.reported_xids) == ["c", "d", "e"]


def test_live_event_with_mig_ids_is_delivered_once() -> None:
    fake = FakeNvml(seed=3, faults=[Fault("xid", gpu=5, xid=94, source="event", gi=2, ci=1)])
    first = quick(fake)
    result = check(first, "xid", 5)
    assert result["status"] == "warn" and result["action"] == "reset_when_idle"
    assert result["value"] == [
        {
            "xid": 94,
            "sources": ["event"],
            "count": 1,
            "mig": [{"gi": 2, "ci": 1}],
            "meaning": xid_policy(94).meaning,
            "severity": "warn",
        }
    ]
    assert check(first, "xid_events")["value"]["events"] == 1
    # NVML delivers an event once: the next run on the same node sees nothing
    assert check(quick(fake), "xid", 5)["status"] == "pass"


def test_event_and_log_of_the_same_xid_are_one_finding() -> None:
    report = quick(FakeNvml(seed=3, faults=[Fault("xid", gpu=0, xid=119, source="both")]))
    value = check(report, "xid", 0)["value"]
    assert len(value) == 1
    assert value[0]["sources"] == ["event", "kernel_log"] and value[0]["count"] == 2


def test_unreadable_kernel_log_makes_xids_unknown() -> None:
    def broken() -> list[str]:
        raise OSError("dmesg: read kernel buffer failed: Operation not permitted")

    report = quick(FakeNvml(seed=3), kernel_log=broken)
    assert "xid_log" in report["parts_unknown"] and "xid_log" not in report["parts_ran"]
    assert check(report, "xid_log")["status"] == "unknown"
    assert {check(report, "xid", g["index"])["status"] for g in report["gpus"]} == {"unknown"}
    assert report["verdict"] == "unknown"


def test_event_registration_failure_is_unknown_for_that_gpu_only() -> None:
    fake = FakeNvml(seed=3, faults=[Fault("nvml_error", gpu=4, call="nvmlDeviceRegisterEvents", error="Unknown")])
    report = quick(fake)
    assert check(report, "xid", 4)["status"] == "unknown"
    assert "nvmlDeviceRegisterEvents" in check(report, "xid", 4)["message"]
    assert [check(report, "xid", g)["status"] for g in (0, 1, 2, 3, 5, 6, 7)] == ["pass"] * 7


def test_ecc_events_unsupported_still_listen_for_xids() -> None:
    fake = FakeNvml(
        seed=3,
        faults=[
            Fault("not_supported", gpu=1, call="nvmlDeviceRegisterEvents"),
        ],
    )
    report = quick(fake)
    # both registrations fail with NotSupported: unknown, never a pass
    assert check(report, "xid", 1)["status"] == "unknown"
    assert fake.call_counts["nvmlDeviceRegisterEvents"] == 8 + 1  # one retry with XIDs only


def test_an_xid_sent_for_a_check_counts_as_reported_only_once_the_portal_accepted_it(tmp_path: Path) -> None:
    """The node agent marked kernel-log XIDs reported as soon as it ran, before its report reached the
    portal: a report that never arrived (the check had expired, the post failed) took them with it, and
    they were never reported. An agent run for a check holds them under that check until the portal says
    it stored the report (HealthState.accept); until then every run reports them again."""
    spec = {"model": "H100-SXM", "seed": 9, "faults": [{"kind": "xid", "gpu": 6, "xid": 95}]}
    path = tmp_path / "state" / "health.json"

    def run(receipt: str) -> dict:
        return validate_report(run_checks("quick", FakeNvml.from_spec(spec), state_path=path, event_wait_ms=0,
                                          xid_receipt=receipt, **PINS))

    assert check(run("41"), "xid", 6)["status"] == "fail"
    assert HealthState.load(path).reported_xids == {}  # held for check 41, not reported yet
    # Check 41's report never reached the portal: the next check reports the XID again.
    assert check(run("42"), "xid", 6)["status"] == "fail"
    state = HealthState.load(path)
    state.accept("42")  # the portal stored check 42's report
    state.accept("999")  # a receipt the agent never held changes nothing
    state.save(path)
    assert len(HealthState.load(path).reported_xids) == 1
    assert run("43")["verdict"] == "pass"
    # Without a receipt (the CLI, printing its report) an XID counts as reported once the run ends.
    plain = tmp_path / "plain.json"
    validate_report(run_checks("quick", FakeNvml.from_spec(spec), state_path=plain, event_wait_ms=0, **PINS))
    assert len(HealthState.load(plain).reported_xids) == 1


def test_the_state_keeps_only_the_latest_unaccepted_receipts() -> None:
    state = HealthState(max_receipts=2)
    for receipt, key in (("1", "a"), ("2", "b"), ("3", "c")):
        state.hold(receipt, [key])
    assert list(state.pending_xids) == ["2", "3"]
    state.accept("1")  # dropped: its XID is simply reported again by a later run
    assert state.reported_xids == {}
    state.accept("3")
    assert list(state.reported_xids) == ["c"] and list(state.pending_xids) == ["2"]
    assert HealthState.from_dict(state.to_dict()).pending_xids == {"2": ["b"]}


def test_a_counter_increase_sent_for_a_check_stays_news_until_the_portal_accepted_it(tmp_path: Path) -> None:
    """Counter baselines (aggregate ECC, PCIe replays, NVLink errors) were saved as the run ended, like the
    XIDs were: a report that never reached the portal took the increase with it, the next run compared
    against the new baseline and passed. They are held under the receipt and become the baseline only once
    the portal stored the report."""
    clean = {"model": "H100-SXM", "seed": 9, "faults": []}
    broken = {**clean, "faults": [{"kind": "ecc_uncorrected_aggregate", "gpu": 4, "count": 3}]}
    path = tmp_path / "health.json"

    def run(spec: dict, receipt: str) -> dict:
        return validate_report(run_checks("quick", FakeNvml.from_spec(spec), state_path=path, event_wait_ms=0,
                                          xid_receipt=receipt, **PINS))

    assert run(clean, "40")["verdict"] == "pass"
    assert HealthState.load(path).counters == {}  # held for check 40, no baseline yet
    state = HealthState.load(path)
    state.accept("40")
    state.save(path)
    baseline = HealthState.load(path).counters
    assert len(baseline) == 8
    # Three new uncorrected errors on GPU 4; check 41's report never reaches the portal.
    assert check(run(broken, "41"), "ecc_uncorrected_aggregate", 4)["status"] == "fail"
    assert HealthState.load(path).counters == baseline
    # The next check still compares against the accepted baseline: the errors are reported again.
    result = check(run(broken, "42"), "ecc_uncorrected_aggregate", 4)
    assert (result["status"], result["value"]["new"]) == ("fail", 3)
    state = HealthState.load(path)
    state.accept("42")  # stored: its readings are the baseline now, check 41's (older) are dropped
    state.save(path)
    assert HealthState.load(path).pending_counters == {}
    assert check(run(broken, "43"), "ecc_uncorrected_aggregate", 4)["status"] == "pass"


def test_an_older_receipt_accepted_late_never_moves_a_baseline_back() -> None:
    state = HealthState()
    state.hold("1", [], counters={"GPU-a": {"pcie_replay": [5.0, 100.0]}})
    state.hold("2", [], counters={"GPU-a": {"pcie_replay": [9.0, 200.0]}})
    state.accept("2")
    state.accept("1")  # superseded by 2 (dropped) — and would be older anyway
    assert state.counters == {"GPU-a": {"pcie_replay": [9.0, 200.0]}}
    state.hold("3", ["x"], counters={"GPU-a": {"pcie_replay": [12.0, 300.0]}})
    restored = HealthState.from_dict(state.to_dict())
    assert restored.pending_counters == {"3": {"GPU-a": {"pcie_replay": [12.0, 300.0]}}}
    assert restored.pending_xids == {"3": ["x"]}


def test_kernel_log_xids_name_no_process_of_whoever_ran_it() -> None:
    """An application XID's kernel line names the process that hit it (pid, name). Those are the work of the
    team on the node then, while the report may be read by the next team (a check bound to its booking that
    carries XIDs not reported yet): the report keeps the XID and the rest of the line, not the process."""
    lines = [
        "[ 100.1] NVRM: Xid (PCI:0000:18:00): 31, pid=48213, name=secret_train.py, Ch 00000008, intr 10000000. "
        "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_3456a000.",
        "[ 100.2] NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    ]
    report = quick(FakeNvml(seed=1), kernel_log=lambda: lines)
    details = [entry["detail"] for gpu in (0, 1) for entry in check(report, "xid", gpu)["value"]]
    assert len(details) == 2
    assert not any("48213" in d or "secret_train" in d for d in details), details
    assert "MMU Fault" in details[0] and "fallen off the bus" in details[1]


def test_the_agent_and_the_portal_take_the_same_process_out_of_an_xid_line():
    """The node agent imports no portal code, so the XID line's process pattern is written twice: in the health
    library (what an agent stores) and in portal.core.redact (what a tenant is shown). They must not drift."""
    from portal.core.redact import XID_PROCESS, without_processes

    assert xid._XID_PROCESS.pattern == XID_PROCESS.pattern
    line = "pid=48213, name=train.py, Ch 00000008, engmask 00000101"
    assert xid.without_process(line) == without_processes(line) == "Ch 00000008, engmask 00000101"
    assert without_processes("1 stray compute process(es): pids [4242, 5353]") == "1 stray compute process(es)"
