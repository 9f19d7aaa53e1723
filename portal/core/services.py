"""Cross-cutting write helpers."""

from __future__ import annotations

from typing import Any

from django.db import models

from .models import AuditLog

__all__ = ["audit_record"]


def audit_record(
    *,
    actor: Any,
    action: str,
    obj: models.Model,
    tenant_id: int | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditLog:
    """Write an audit row; call inside the service's transaction so both land or neither."""
    return AuditLog.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        tenant_id=tenant_id,
        before=before or {},
        after=after or {},
    )
