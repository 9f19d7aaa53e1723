"""Cluster panel and badge for other apps' pages (the reservation page and the dashboard include them)."""

from __future__ import annotations

from django import template

from portal.core.redact import without_secrets
from reservations.choices import ReservationStatus

from ..choices import TERMINAL_STATUSES
from ..models import VirtualCluster
from ..selectors import clusters_for_user

register = template.Library()


def _reservation_panel(context, reservation) -> dict:
    request = context.get("request")
    user = getattr(request, "user", None)
    cluster = clusters_for_user(user=user).filter(reservation_id=reservation.pk).first() if user else None
    if cluster is None:
        # The reservation app's placeholder, which polls the page (its own URL) until the cluster row exists.
        return {"cluster": None, "reservation": reservation, "cluster_poll_url": context.get("cluster_poll_url")}
    from ..views import panel_context

    panel = {**panel_context(user, cluster), "reservation": reservation, "csrf_token": context.get("csrf_token")}
    poll_url = context.get("cluster_poll_url")
    if poll_url:
        # The reservation page polls its own URL, which sends the booking's status parts with the card; it goes on
        # until the booking is under way (a cluster ready before the window starts waits for it to be active).
        panel["poll_url"] = poll_url
        panel["polling"] = panel["polling"] or (
            reservation.status in (ReservationStatus.CONFIRMED, ReservationStatus.PROVISIONING)
            and cluster.status not in TERMINAL_STATUSES)
        # Under way, a booking's node can still fail and be swapped for a spare: the page says how often it goes on
        # looking (slower) for its Nodes card and timeline (cluster_watch_every, none once the booking is over).
        watch_every = context.get("cluster_watch_every")
        if not panel["polling"] and watch_every and cluster.status not in TERMINAL_STATUSES:
            panel["polling"], panel["poll_every"] = True, watch_every
    return panel


@register.inclusion_tag("provisioning/_cluster_panel.html", takes_context=True)
def cluster_panel(context, reservation):
    """The reservation's cluster: phases with times, connection, credentials, actions (tenant-scoped)."""
    return _reservation_panel(context, reservation)


@register.inclusion_tag("provisioning/_cluster_poll.html", takes_context=True)
def cluster_poll(context, reservation):
    """The reservation page's poll of its cluster: the status card, and the credentials and actions beside it."""
    return _reservation_panel(context, reservation)


@register.inclusion_tag("provisioning/_cluster_badge_inner.html")
def cluster_badge(reservation):
    """A small status badge for a reservation row: no query when the row was read with its cluster
    (select_related("cluster"), as the dashboard does), else one."""
    if type(reservation).cluster.is_cached(reservation):
        try:
            cluster = reservation.cluster
        except VirtualCluster.DoesNotExist:
            cluster = None
    else:
        cluster = VirtualCluster.objects.filter(reservation_id=reservation.pk).only("id", "status").first()
    return {"cluster": cluster, "reservation": reservation}


# The connection details' keys as the backends write them (the API returns them as they are), in words.
CONNECTION_LABELS = {
    "login_host": "Login host",
    "ssh_user": "SSH user",
    "ssh_key": "SSH key fingerprint",
    "slurm_account": "Slurm account",
    "slurm_reservation": "Slurm reservation",
    "submit_hint": "Submit a job",
    "api_server": "API server",
    "namespace": "Namespace",
    "kubectl_hint": "Try it",
    "shared_storage": "Shared storage",
    "shared_pvc": "Shared volume claim",
}


@register.filter
def connection_label(key: str) -> str:
    """A connection detail's label: "login_host" -> "Login host"; a key not listed reads as its words."""
    key = str(key)
    return CONNECTION_LABELS.get(key) or key.replace("_", " ").strip().capitalize()


@register.filter(name="without_secrets")
def without_secrets_filter(text: str) -> str:
    """A backend's error as the team reads it: no credentials (portal.core.redact; the admin has it whole)."""
    return without_secrets(text or "")
