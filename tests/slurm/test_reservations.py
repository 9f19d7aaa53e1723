"""Reservations on a real slurmctld: every assertion reads state back from Slurm."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from provisioning.backends.slurm_client import (
    EnsureAction,
    ReservationExists,
    ReservationNotFound,
    ReservationOverlap,
    SlurmClient,
    SlurmError,
    reservation_name,
)

pytestmark = pytest.mark.slurm

START = datetime(2030, 3, 1, 8, 0, tzinfo=UTC)
END = START + timedelta(days=2)


def test_create_shows_nodes_start_end_accounts(slurm: SlurmClient, scontrol) -> None:
    name = reservation_name("research", 41)

    created = slurm.create_reservation(
        name,
        ["h100-sxm-001", "h100-sxm-002", "h100-sxm-003", "h100-sxm-007"],
        START,
        END,
        accounts=["research"],
    )

    assert created == slurm.show_reservations()[name]
    assert created.nodes == ("h100-sxm-001", "h100-sxm-002", "h100-sxm-003", "h100-sxm-007")
    assert (created.start, created.end) == (START, END)
    assert created.accounts == {"research"}
    assert not created.active
    # The same facts in scontrol's own words, without our parser.
    raw = scontrol("show", "reservation", name, "--oneliner")
    assert "ReservationName=research-41 " in raw
    assert "Nodes=h100-sxm-[001-003,007] " in raw
    assert "StartTime=2030-03-01T08:00:00 " in raw
    assert "EndTime=2030-03-03T08:00:00 " in raw
    assert "Accounts=research " in raw


def test_aware_times_in_other_zones_are_sent_as_utc(slurm: SlurmClient) -> None:
    india = timezone(timedelta(hours=5, minutes=30))
    start = datetime(2030, 3, 1, 13, 30, 59, 999_999, tzinfo=india)  # 08:00:59.999999 UTC

    reservation = slurm.create_reservation(
        "research-42", ["h100-sxm-004"], start, start + timedelta(hours=3), accounts=["research"]
    )

    assert reservation.start == datetime(2030, 3, 1, 8, 0, 59, tzinfo=UTC)
    assert reservation.end == datetime(2030, 3, 1, 11, 0, 59, tzinfo=UTC)


def test_naive_datetimes_are_refused_before_reaching_slurm(slurm: SlurmClient) -> None:
    with pytest.raises(ValueError, match="aware"):
        slurm.create_reservation(
            "research-43", ["h100-sxm-004"], START.replace(tzinfo=None), END, accounts=["research"]
        )
    assert "research-43" not in slurm.show_reservations()


def test_users_instead_of_accounts(slurm: SlurmClient) -> None:
    reservation = slurm.create_reservation("ops-1", ["h100-sxm-005"], START, END, users=["root"])

    assert slurm.show_reservation("ops-1") == reservation
    assert reservation.users == {"root"}
    assert reservation.accounts == frozenset()


def test_unknown_user_is_a_slurm_error_with_scontrol_message(slurm: SlurmClient) -> None:
    with pytest.raises(SlurmError, match="Invalid user id") as excinfo:
        slurm.create_reservation("ops-2", ["h100-sxm-005"], START, END, users=["no-such-user"])
    assert excinfo.value.returncode == 1
    assert "ops-2" not in slurm.show_reservations()


def test_update_end_extends_and_shortens(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-50", ["h100-sxm-001"], START, END, accounts=["research"])

    slurm.update_reservation("research-50", end=END + timedelta(days=1))
    assert slurm.show_reservation("research-50").end == END + timedelta(days=1)

    slurm.update_reservation("research-50", end=START + timedelta(hours=6))
    after = slurm.show_reservation("research-50")
    assert (after.start, after.end) == (START, START + timedelta(hours=6))


def test_update_moves_window_and_swaps_a_node(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-51", ["h100-sxm-001", "h100-sxm-002"], START, END, accounts=["research"])

    slurm.update_reservation(
        "research-51",
        nodes=["h100-sxm-001", "h100-sxm-008"],
        start=START + timedelta(days=10),
        end=END + timedelta(days=10),
    )

    after = slurm.show_reservation("research-51")
    assert after.nodes == ("h100-sxm-001", "h100-sxm-008")
    assert (after.start, after.end) == (START + timedelta(days=10), END + timedelta(days=10))


def test_delete(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-52", ["h100-sxm-001"], START, END, accounts=["research"])

    slurm.delete_reservation("research-52")

    assert "research-52" not in slurm.show_reservations()
    with pytest.raises(ReservationNotFound):
        slurm.delete_reservation("research-52")
    slurm.delete_reservation("research-52", missing_ok=True)


def test_update_of_unknown_reservation_is_not_found(slurm: SlurmClient) -> None:
    with pytest.raises(ReservationNotFound, match="invalid"):
        slurm.update_reservation("research-404", end=END)
    assert slurm.show_reservation("research-404") is None


def test_duplicate_name_is_already_exists(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-53", ["h100-sxm-001"], START, END, accounts=["research"])

    with pytest.raises(ReservationExists, match="Duplicate reservation name"):
        slurm.create_reservation(
            "research-53",
            ["h100-sxm-006"],
            START + timedelta(days=30),
            END + timedelta(days=30),
            accounts=["research"],
        )
    assert slurm.show_reservation("research-53").nodes == ("h100-sxm-001",)


def test_overlap_on_same_node_is_refused_with_distinct_exception(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-60", ["h100-sxm-002", "h100-sxm-003"], START, END, accounts=["research"])

    with pytest.raises(ReservationOverlap, match="overlaps with another reservation"):
        slurm.create_reservation(
            "vision-61",
            ["h100-sxm-003", "h100-sxm-004"],
            START + timedelta(hours=12),
            END + timedelta(days=1),
            accounts=["vision"],
        )

    reservations = slurm.show_reservations()
    assert "vision-61" not in reservations
    assert reservations["research-60"].nodes == ("h100-sxm-002", "h100-sxm-003")


def test_extension_into_a_neighbour_is_refused_as_overlap(slurm: SlurmClient) -> None:
    slurm.create_reservation("research-62", ["h100-sxm-004"], START, END, accounts=["research"])
    slurm.create_reservation("vision-63", ["h100-sxm-004"], END, END + timedelta(days=1), accounts=["vision"])

    with pytest.raises(ReservationOverlap):
        slurm.update_reservation("research-62", end=END + timedelta(hours=1))

    assert slurm.show_reservation("research-62").end == END


def test_ensure_creates_then_is_a_noop(slurm: SlurmClient) -> None:
    args = ("research-70", ["h100-sxm-001", "h100-sxm-002"], START, END)

    first = slurm.ensure_reservation(*args, accounts=["research"], flags=["IGNORE_JOBS"])
    second = slurm.ensure_reservation(*args, accounts=["research"], flags=["IGNORE_JOBS"])

    assert first.action is EnsureAction.CREATED
    assert second.action is EnsureAction.UNCHANGED
    assert second.reservation == first.reservation == slurm.show_reservation("research-70")
    assert {"IGNORE_JOBS", "SPEC_NODES"} <= second.reservation.flags


def test_ensure_updates_only_what_differs(slurm: SlurmClient) -> None:
    slurm.ensure_reservation("research-71", ["h100-sxm-001"], START, END, accounts=["research"])

    result = slurm.ensure_reservation(
        "research-71",
        ["h100-sxm-001", "h100-sxm-005"],
        START,
        END + timedelta(hours=4),
        accounts=["research"],
    )

    assert result.action is EnsureAction.UPDATED
    assert result.changed_fields == ("end", "nodes")
    after = slurm.show_reservation("research-71")
    assert after.nodes == ("h100-sxm-001", "h100-sxm-005")
    assert after.end == END + timedelta(hours=4)
    again = slurm.ensure_reservation(
        "research-71",
        ["h100-sxm-005", "h100-sxm-001"],
        START,
        END + timedelta(hours=4),
        accounts=["research"],
    )
    assert again.action is EnsureAction.UNCHANGED


def test_ensure_removes_users_added_by_hand_and_says_so(slurm: SlurmClient) -> None:
    """The portal owns its reservations: Users= an operator added goes, and the result names "users" as changed
    (reconcile reports the same difference as a mismatch before --fix repairs it)."""
    slurm.ensure_reservation("research-72", ["h100-sxm-002"], START, END, accounts=["research"])
    slurm.update_reservation("research-72", users=["root"])

    result = slurm.ensure_reservation("research-72", ["h100-sxm-002"], START, END, accounts=["research"])

    assert result.action is EnsureAction.UPDATED
    assert result.changed_fields == ("users",)
    after = slurm.show_reservation("research-72")
    assert (after.users, after.accounts) == (frozenset(), {"research"})


def test_ensure_with_start_in_the_past_starts_now_and_stays_unchanged(slurm: SlurmClient) -> None:
    now = datetime.now(UTC)
    slot_start = now.replace(minute=0, second=0, microsecond=0)
    end = slot_start + timedelta(hours=2)

    first = slurm.ensure_reservation("research-72", ["h100-sxm-006"], slot_start, end, accounts=["research"])
    second = slurm.ensure_reservation("research-72", ["h100-sxm-006"], slot_start, end, accounts=["research"])

    assert first.action is EnsureAction.CREATED
    assert second.action is EnsureAction.UNCHANGED
    live = slurm.show_reservation("research-72")
    assert live.active
    assert now - timedelta(seconds=5) <= live.start <= datetime.now(UTC)
    assert live.end == end


def test_an_operators_reservation_whose_name_holds_a_space_and_key_value_text_is_read_whole(
        slurm: SlurmClient, scontrol) -> None:
    """scontrol takes any reservation name from an operator ("ops Users=x", quotes too) and prints it unquoted
    in --oneliner output; the parser cut the name at the space and read "Users=x" as a field, so it reported a
    reservation "ops" that does not exist (and two such names as one)."""
    names = ["maint Accounts=research", 'ops "q" 1']
    try:
        for name, node in zip(names, ["h100-sxm-001", "h100-sxm-002"], strict=True):
            assert "Reservation created" in scontrol("create", "reservation", f"ReservationName={name}",
                                                     f"Nodes={node}", "StartTime=2030-03-01T08:00:00",
                                                     "Duration=60", "Users=root")
        reservations = slurm.show_reservations()
        assert set(reservations) == set(names)
        maint = reservations["maint Accounts=research"]
        assert maint.name == "maint Accounts=research"
        assert (maint.nodes, maint.accounts, maint.users) == (("h100-sxm-001",), frozenset(), {"root"})
        assert maint.start == START and maint.end == START + timedelta(hours=1)
        assert reservations['ops "q" 1'].nodes == ("h100-sxm-002",)
    finally:
        for name in names:
            scontrol("delete", f"ReservationName={name}")
