"""Cluster panel and badge for other apps' pages (the reservation page and the dashboard include them)."""

from __future__ import annotations

from django import template

from portal.core.redact import without_secrets

from ..models import VirtualCluster
from ..selectors import clusters_for_user

register = template.Library()


@register.inclusion_tag("provisioning/_cluster_panel.html", takes_context=True)
def cluster_panel(context, reservation):
    """The reservation's cluster: phases with times, connection, credentials, actions (tenant-scoped)."""
    request = context.get("request")
    user = getattr(request, "user", None)
    cluster = clusters_for_user(user=user).filter(reservation_id=reservation.pk).first() if user else None
    if cluster is None:
        return {"cluster": None, "reservation": reservation}
    from ..views import panel_context

    return {**panel_context(user, cluster), "reservation": reservation, "csrf_token": context.get("csrf_token")}


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
