"""Session-level PostgreSQL advisory locks (two-int form: namespace, key).

PostgreSQL releases a session lock when the holding connection goes away, so a worker killed
with SIGKILL never leaves one behind — which is what makes them the right tool for "is somebody
still working on this?". Namespaces of the whole app: 70_xxx here, 71_xxx/72_xxx in
provisioning.constants.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from django.db import DatabaseError, connection

__all__ = ["LOCK_OUTBOX_EVENT", "LOCK_USERNAME", "advisory_lock", "locked_keys"]

logger = logging.getLogger(__name__)

# One worker runs an outbox event's subscribers at a time: a second copy of its message that
# arrives meanwhile (the relay re-sent it while the worker was slow to pick it up) finds the
# lock held and leaves it; a copy redelivered after its worker died finds it free.
LOCK_OUTBOX_EVENT = 70_001
# Creating or renaming an account to a name (case-insensitively, as username__iexact compares): transaction-level
# (pg_advisory_xact_lock), keyed by hashtext(upper(name)), so two names equal but for case queue on one lock.
LOCK_USERNAME = 70_002

_INT4 = 2**31


@contextlib.contextmanager
def advisory_lock(namespace: int, key: int, *, wait: float = 0.0) -> Iterator[bool]:
    """Hold a session-level advisory lock for the block; yield whether we got it.

    Session-level (not transaction-level) because the block may span many short transactions
    and slow calls; PostgreSQL releases it if our connection dies. Keys beyond int4 wrap (two
    keys 2^31 apart share a lock: they only wait for each other).
    """
    key = key % _INT4
    deadline = time.monotonic() + wait
    while True:
        with connection.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s::int, %s::int)", [namespace, key])
            held = bool(cur.fetchone()[0])
        if held or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    try:
        yield held
    finally:
        if held:
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s::int, %s::int)", [namespace, key])
                    released = bool(cur.fetchone()[0])
                if not released:
                    # Our session did not hold it: the statements went to different server sessions,
                    # as behind a transaction-pooling proxy — where session locks cannot work.
                    logger.error("advisory lock (%s, %s) was not held by this session at release; is a "
                                 "transaction-pooling proxy between this process and PostgreSQL?", namespace, key)
            except DatabaseError:  # the connection is gone, and the lock with it
                logger.warning("could not release advisory lock (%s, %s)", namespace, key, exc_info=True)


def locked_keys(namespace: int) -> set[int]:
    """Return the keys of namespace whose advisory lock some session holds right now."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objsubid = 2 AND granted",
            [namespace],
        )
        return {int(row[0]) for row in cur.fetchall()}
