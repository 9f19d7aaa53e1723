"""A tenant's reservations as an iCalendar (RFC 5545) feed for Google Calendar, Outlook, Apple Calendar."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC

from icalendar import Calendar, Event, vText

from .choices import ReservationStatus
from .models import Reservation

__all__ = ["event_uid", "build_feed"]

PRODID = "-//GPU Portal//Reservations//EN"
DOMAIN = "gpu-portal"
_STATUS = {
    ReservationStatus.CANCELLED: "CANCELLED",
    ReservationStatus.FAILED: "CANCELLED",
}


def event_uid(reservation: Reservation) -> str:
    """Return the UID of a reservation's event: stable, so clients update instead of duplicating."""
    return f"reservation-{reservation.pk}@{DOMAIN}"


def _sequence(reservation: Reservation) -> int:
    # Grows with every change and never goes back, as RFC 5545 asks of SEQUENCE: the seconds from
    # creation to the last update (what earlier feeds sent, so no subscriber sees it drop) plus the
    # number of audited changes, so two changes within one second still raise it.
    seconds = max(0, int((reservation.updated_at - reservation.created_at).total_seconds()))
    return seconds + max(0, getattr(reservation, "audited_changes", 1) - 1)


def build_feed(*, tenant, reservations: Iterable[Reservation], base_url: str) -> bytes:
    """Serialise reservations (with `active_allocations` prefetched) into one VCALENDAR.

    The feed has no METHOD, so each event's DTSTAMP is when its information was last revised (RFC 5545
    §3.8.7.2), its LAST-MODIFIED, not the time of the request: a poll that finds nothing changed gets the
    same events."""
    cal = Calendar.new(prodid=PRODID, uid=f"tenant-{tenant.slug}@{DOMAIN}")
    # icalendar types NAME / X-WR-* as unknown and writes them raw: a tenant-controlled comma,
    # semicolon or backslash would go out unescaped and a newline would break serialisation.
    description = f"GPU node reservations of {tenant.name}."
    cal.add("DESCRIPTION", description)
    title = f"{tenant.name} GPU reservations"
    for prop, value in (("NAME", title), ("X-WR-CALNAME", title), ("X-WR-CALDESC", description)):
        cal.add(prop, vText(value))
    cal.add("X-PUBLISHED-TTL", "PT15M")
    base = base_url.rstrip("/")
    for r in reservations:
        nodes = sorted(a.node.hostname for a in getattr(r, "active_allocations", []))
        title = r.name or f"{r.pool.name} booking"
        lines = [
            f"{r.node_count} × {r.pool.name} ({r.pool.gpu_model}, {r.node_count * r.pool.gpus_per_node} GPUs)",
            f"Status: {r.get_status_display()}; billing: {r.get_billing_display()}",
            f"Cluster: {r.get_orchestrator_display()}, CUDA {r.cuda_version}",
        ]
        if nodes:
            lines.append("Nodes: " + ", ".join(nodes))
        url = f"{base}/reservations/{r.pk}/"
        lines.append(url)
        event = Event.new(
            uid=event_uid(r),
            start=r.period.lower.astimezone(UTC),
            end=r.period.upper.astimezone(UTC),
            summary=f"{title} — {r.node_count}× {r.pool.name}",
            description="\n".join(lines),
            stamp=r.updated_at.astimezone(UTC),
            last_modified=r.updated_at.astimezone(UTC),
            created=r.created_at.astimezone(UTC),
            sequence=_sequence(r),
            status=_STATUS.get(r.status, "CONFIRMED"),
            url=url,
            location=f"{r.pool.name} pool",
            categories=["GPU reservation", r.pool.name],
        )
        cal.add_component(event)
    return cal.to_ical()
