"""Who did something, as a given reader may see it.

Tenants see that the platform team acted, never which staff account: a staff username is the
platform's, not theirs to know (DESIGN §3, isolation). Staff see every name. One rule for every
history a tenant reads: the audit log page, a reservation's timeline and "booked by", a cluster's
history, the reservation API's ``created_by``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STAFF_NAME", "STAFF_WORDS", "is_platform_staff", "actor_name"]

# What a tenant reads instead of a staff account's username: in the API (as the health-check API's
# requested_by already answers; no username can be "platform staff", which has a space) and on pages.
STAFF_NAME = "platform"
STAFF_WORDS = "platform staff"


def is_platform_staff(user: Any) -> bool:
    return bool(getattr(user, "is_staff", False) or getattr(user, "is_superuser", False))


def actor_name(actor: Any, *, viewer: Any, staff: str = STAFF_NAME) -> str | None:
    """actor's username as viewer may see it: None for no actor (the system); ``staff`` in place of a
    platform staff account's name unless viewer is staff themselves (no viewer: hidden too)."""
    if actor is None:
        return None
    if is_platform_staff(actor) and not getattr(viewer, "is_staff", False):
        return staff
    return actor.get_username()
