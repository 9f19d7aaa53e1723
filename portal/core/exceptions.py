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
