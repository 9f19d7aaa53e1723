"""One race, run for real: a transaction holds its locks while a request or a service call meets them.

Two threads on the real database: ``hold`` runs in a transaction of its own and keeps it open (its locks
held) until ``act``, in the second thread, is seen waiting on a lock (or has finished without waiting);
then the holder commits and ``act`` goes on. What ``act`` returned, or the exception it raised, comes back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

__all__ = ["behind_a_lock", "demoting", "waiting_on_a_lock"]


def waiting_on_a_lock(table: str | None = None) -> bool:
    """Whether another session of this database waits on a lock (in a statement naming table, when given):
    sessions of other databases on the same server (another test run) do not count."""
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                    " AND datname = current_database() AND query ILIKE %s", [f"%{table or ''}%"])
        return bool(cur.fetchone()[0])


def behind_a_lock(hold: Callable[[], Callable[[], None] | None], act: Callable[[], Any], *,
                  waits_on: str | None = None, timeout: float = 30) -> Any:
    """Run act while hold's transaction is open; return act's result or the exception it raised.

    hold may return a function, run after act was seen waiting and before the commit (a write that must
    come after act read the clock, say). waits_on: the table act's waiting statement names (None: any).
    """
    locked, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

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

    def actor() -> None:
        try:
            outcome["act"] = act()
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            outcome["act"] = exc
        finally:
            connection.close()

    holding = threading.Thread(target=holder)
    holding.start()
    assert locked.wait(timeout / 3), "the holding transaction never took its locks"
    if "hold" in outcome:
        raise outcome["hold"]
    acting = threading.Thread(target=actor)
    acting.start()
    # Either act queues on the lock (then the holder commits first), or it ran past it.
    while acting.is_alive() and not waiting_on_a_lock(waits_on):
        acting.join(0.02)
    release.set()
    holding.join(timeout)
    acting.join(timeout)
    assert not holding.is_alive() and not acting.is_alive(), "the race did not finish"
    if "hold" in outcome:
        raise outcome["hold"]
    return outcome["act"]


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
