"""One race, run for real: a transaction holds its locks while requests or service calls meet them.

Threads on the real database: ``hold`` runs in a transaction of its own and keeps it open (its locks
held) until each call, started in turn in a thread of its own, is seen waiting on a lock (or has finished
without waiting); then the holder commits and the calls go on. What each returned, or the exception it
raised, comes back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

__all__ = ["behind_a_lock", "demoting", "in_turn", "lock_waiters"]


def lock_waiters(table: str | None = None) -> int:
    """How many other sessions of this database wait on a lock (in a statement naming table, when given):
    sessions of other databases on the same server (another test run) do not count."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")  # in a transaction, a fresh view on every call
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                    " AND datname = current_database() AND query ILIKE %s", [f"%{table or ''}%"])
        return int(cur.fetchone()[0])


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

    def runner(index: int, call: Callable[[], Any]) -> None:
        try:
            outcome[index] = call()
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            outcome[index] = exc
        finally:
            connection.close()

    holding = threading.Thread(target=holder)
    holding.start()
    assert locked.wait(timeout / 3), "the holding transaction never took its locks"
    if "hold" in outcome:
        raise outcome["hold"]
    threads: list[threading.Thread] = []
    for index, call in enumerate(calls):
        thread = threading.Thread(target=runner, args=(index, call))
        thread.start()
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
