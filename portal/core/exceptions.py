"""Domain errors. Services raise them; one API handler turns them into the error envelope."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DomainError",
    "InvalidInput",
    "NotFound",
    "PermissionDenied",
    "CapacityUnavailable",
    "QuotaExceeded",
    "InvalidState",
    "Busy",
    "TRANSIENT_SQLSTATES",
    "is_transient",
]


class DomainError(Exception):
    """Base for errors that carry an envelope code and an HTTP status."""

    code = "invalid"
    status = 400

    def __init__(self, detail: str, *, fields: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fields = fields or {}
        self.extra = extra


class InvalidInput(DomainError):
    code = "invalid"
    status = 400


class PermissionDenied(DomainError):
    code = "permission_denied"
    status = 403


class NotFound(DomainError):
    code = "not_found"
    status = 404


class CapacityUnavailable(DomainError):
    code = "capacity_unavailable"
    status = 409


class QuotaExceeded(DomainError):
    code = "quota_exceeded"
    status = 409


class InvalidState(DomainError):
    code = "invalid_state"
    status = 409


class Busy(DomainError):
    """A write lost to concurrent ones (a deadlock, a serialization failure) where it could not be retried, or
    more times than it is: nothing of it was written, and the same request sent again shortly should succeed."""

    code = "busy"
    status = 503
    retry_after = 1  # seconds, the Retry-After header of the answer

    def __init__(self, detail: str = "The database was busy with concurrent changes; nothing was changed. "
                                     "Try again in a moment.", **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)


# SQLSTATE class 40, transaction rollback: PostgreSQL rolled the transaction back to resolve a conflict with a
# concurrent one (40001 serialization_failure, 40P01 deadlock_detected). Running it again is the remedy.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01"})


def is_transient(exc: BaseException) -> bool:
    """Whether exc (Django's database error, or psycopg's it wraps) is one of TRANSIENT_SQLSTATES."""
    for err in (exc, exc.__cause__):
        state = getattr(err, "sqlstate", None) or getattr(getattr(err, "diag", None), "sqlstate", None)
        if state in TRANSIENT_SQLSTATES:
            return True
    return False
