"""One race, run for real: a transaction holds its locks while requests or service calls meet them.

Threads on the real database: ``hold`` runs in a transaction of its own and keeps it open (its locks
held) until each call, started in turn in a thread of its own, is seen waiting on a lock (or has finished
without waiting); then the holder commits and the calls go on. What each returned, or the exception it
raised, comes back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

__all__ = ["advisory_waits", "behind_a_lock", "demoting", "failing_inserts", "in_thread", "in_turn", "lock_waiters",
           "pausing_inserts", "until"]


def waiting_in(table: str | None) -> tuple[str, list[Any]]:
    """SQL (and its parameters) for pg_stat_activity's rows running a statement that names table (any, when None).
    A booking runs its statements inside one function call (reservations.services.BOOK_FUNCTION), the query the
    server shows while it waits: it counts as naming every table the function's statements name."""
    from reservations.services import BOOK_FUNCTION, BOOK_FUNCTION_SQL

    if table is None:
        return "true", []
    return "(query ILIKE %s OR (%s AND query ILIKE %s))", [
        f"%{table}%", table.lower() in BOOK_FUNCTION_SQL.lower(), f"%{BOOK_FUNCTION}(%"]


def lock_waiters(table: str | None = None) -> int:
    """How many other sessions of this database wait on a lock (in a statement naming table, when given):
    sessions of other databases on the same server (another test run) do not count."""
    where, params = waiting_in(table)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")  # in a transaction, a fresh view on every call
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                    f" AND datname = current_database() AND {where}", params)
        return int(cur.fetchone()[0])


def in_thread(result: dict, key: Any, fn: Callable[[], Any]) -> threading.Thread:
    """Start fn in a thread of its own; what it returns, or the exception it raises, lands in result[key]."""
    def run() -> None:
        try:
            result[key] = fn()
        except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
            result[key] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=str(key))
    thread.start()
    return thread


def until(condition: Callable[[], Any], timeout: float = 30) -> None:
    """Wait until condition() holds (a race has reached its point); fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the race never reached its point"
        time.sleep(0.02)


def advisory_waits(namespace: int) -> list[int]:
    """The keys other sessions of this database wait for in namespace's advisory locks (two-key form)."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute("SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = %s"
                    " AND objsubid = 2 AND pid <> pg_backend_pid()"
                    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY 1",
                    [namespace])
        return [int(row[0]) for row in cur.fetchall()]


def behind_a_lock(hold: Callable[[], Callable[[], None] | None], act: Callable[[], Any], *,
                  waits_on: str | None = None, timeout: float = 30) -> Any:
    """Run act while hold's transaction is open; return act's result or the exception it raised.

    hold may return a function, run after act was seen waiting and before the commit (a write that must
    come after act read the clock, say). waits_on: the table act's waiting statement names (None: any).
    """
    return in_turn(hold, [act], waits_on=waits_on, timeout=timeout)[0]


def in_turn(hold: Callable[[], Callable[[], None] | None], calls: list[Callable[[], Any]], *,
            waits_on: str | None = None, timeout: float = 30) -> list[Any]:
    """Hold hold's locks in a transaction; start calls one by one, each once the ones before it wait on a lock
    (or have finished); then commit. Return what each call returned, or the exception it raised."""
    locked, release = threading.Event(), threading.Event()
    outcome: dict[Any, Any] = {}

    def holder() -> None:
        try:
            with transaction.atomic():
                then = hold()
                locked.set()
                release.wait(timeout)
                if then is not None:
                    then()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["hold"] = exc
            locked.set()
        finally:
            connection.close()

    holding = threading.Thread(target=holder)
    holding.start()
    assert locked.wait(timeout / 3), "the holding transaction never took its locks"
    if "hold" in outcome:
        raise outcome["hold"]
    threads: list[threading.Thread] = []
    for index, call in enumerate(calls):
        thread = in_thread(outcome, index, call)
        threads.append(thread)
        # Either it queues on a lock (then the holder commits first), or it ran past it.
        while thread.is_alive() and lock_waiters(waits_on) < sum(t.is_alive() for t in threads):
            thread.join(0.02)
    release.set()
    for thread in (holding, *threads):
        thread.join(timeout)
    assert not any(t.is_alive() for t in (holding, *threads)), "the race did not finish"
    if "hold" in outcome:
        raise outcome["hold"]
    return [outcome[index] for index in range(len(calls))]


def demoting(membership_pk: int, role: str | None) -> Callable[[], None]:
    """A hold for behind_a_lock: a lead demoted to role (removed when None), the tenant's lead rows locked
    FOR UPDATE as the team services lock them (the team lock)."""
    from tenants.choices import Role
    from tenants.models import Membership

    def hold() -> None:
        membership = Membership.objects.select_for_update().get(pk=membership_pk)
        list(Membership.objects.select_for_update().filter(tenant_id=membership.tenant_id, role=Role.LEAD))
        if role is None:
            membership.delete()
        else:
            membership.role = role
            membership.save(update_fields=["role"])
    return hold


# Pauses and faults inside one statement (the booking statement runs its steps in one PL/pgSQL call, out of a
# Python hook's reach) come from a trigger the test installs on the table written: an AFTER ROW trigger fires at
# the end of its statement, inside the writing transaction, with every lock taken before it still held.
# The tests' own advisory lock: one bigint key (the app's locks all take two int keys, never met by this one).
_PAUSE_KEY = 72999


class Pause:
    def __init__(self) -> None:
        self.held = True

    def reached(self) -> int:
        """How many sessions wait at the pause now."""
        with connection.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
            cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = 0"
                        " AND objid = %s AND objsubid = 1"
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                        [_PAUSE_KEY])
            return int(cur.fetchone()[0])

    def wait_reached(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.reached():
            assert time.monotonic() < deadline, "no insert reached the pause"
            time.sleep(0.02)

    def advisory_keys(self, namespace: int) -> list[int]:
        """The keys of namespace's advisory locks (two-key form) the sessions waiting at the pause hold."""
        with connection.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
            cur.execute("SELECT DISTINCT held.objid FROM pg_locks waiting JOIN pg_locks held ON held.pid = waiting.pid"
                        " WHERE waiting.locktype = 'advisory' AND NOT waiting.granted AND waiting.classid = 0"
                        " AND waiting.objid = %s AND waiting.objsubid = 1 AND held.locktype = 'advisory'"
                        " AND held.granted AND held.classid = %s AND held.objsubid = 2 ORDER BY 1",
                        [_PAUSE_KEY, namespace])
            return [int(row[0]) for row in cur.fetchall()]

    def release(self) -> None:
        if self.held:
            self.held = False
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s::bigint)", [_PAUSE_KEY])


@contextmanager
def pausing_inserts(table: str, *, when: str = "true") -> Iterator[Pause]:
    """Every row inserted into table (where `when`, an SQL condition on NEW, holds) waits at the end of its
    statement, in its transaction, until pause.release() (or the block's end). Only for transaction=True tests:
    the trigger must be committed for other sessions to meet it. Holds the pause in this thread's connection."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s::bigint)", [_PAUSE_KEY])
        cur.execute("CREATE OR REPLACE FUNCTION test_pause_row() RETURNS trigger LANGUAGE plpgsql AS $$"
                    f" BEGIN PERFORM pg_advisory_xact_lock_shared({_PAUSE_KEY}::bigint); RETURN NULL; END $$")
        cur.execute(f"CREATE TRIGGER test_pause AFTER INSERT ON {table} FOR EACH ROW WHEN ({when})"
                    " EXECUTE FUNCTION test_pause_row()")
    pause = Pause()
    try:
        yield pause
    finally:
        pause.release()
        with connection.cursor() as cur:
            cur.execute(f"DROP TRIGGER IF EXISTS test_pause ON {table}")
            cur.execute("DROP FUNCTION IF EXISTS test_pause_row()")


@contextmanager
def failing_inserts(table: str, *, sqlstate: str, message: str, times: int = 1) -> Iterator[Callable[[], int]]:
    """The first `times` statements inserting into table fail with the server's own error sqlstate (as a deadlock
    victim gets 40P01); yields a function answering how many inserts were tried. Undone at the block's end (in a
    test's transaction, with it)."""
    with connection.cursor() as cur:
        cur.execute("CREATE SEQUENCE test_failing_inserts")
        cur.execute("CREATE OR REPLACE FUNCTION test_fail_row() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                    f" IF nextval('test_failing_inserts') <= {int(times)} THEN"
                    f" RAISE EXCEPTION '{message}' USING ERRCODE = '{sqlstate}'; END IF; RETURN NULL; END $$")
        cur.execute(f"CREATE TRIGGER test_fail AFTER INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION test_fail_row()")

    def tried() -> int:
        with connection.cursor() as cur:
            cur.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM test_failing_inserts")
            return int(cur.fetchone()[0])
    try:
        yield tried
    finally:
        with connection.cursor() as cur:
            cur.execute(f"DROP TRIGGER IF EXISTS test_fail ON {table}")
            cur.execute("DROP FUNCTION IF EXISTS test_fail_row()")
            cur.execute("DROP SEQUENCE IF EXISTS test_failing_inserts")
