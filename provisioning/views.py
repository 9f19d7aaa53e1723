"""Cluster pages: the list, and one cluster with its phases, connection details, credentials, teardown."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST, require_safe
from django.views.decorators.vary import vary_on_headers

from portal.core.exceptions import DomainError
from tenants.views import portal_view, render_page, stops_polling_when_gone

from . import selectors, services
from .choices import LIVE_STATUSES, PROVISION_PHASES, TERMINAL_STATUSES, ClusterStatus, CredentialKind
from .models import VirtualCluster

_PIPELINE = (ClusterStatus.PENDING, *PROVISION_PHASES, ClusterStatus.READY)


def _cluster(request, pk: int):
    return get_object_or_404(selectors.clusters_for_user(user=request.user), pk=pk)


def panel_context(user, cluster) -> dict:
    """What the cluster page and the reservation page's cluster panel show (read-only)."""
    transitions = list(cluster.transitions.all())
    reached = {t.phase: t for t in transitions}
    pipeline = [
        {"phase": phase, "label": ClusterStatus(phase).label, "transition": reached.get(phase),
         "current": cluster.status == phase}
        for phase in _PIPELINE
    ]
    can_manage = selectors.can_manage_cluster(user=user, cluster=cluster)
    credentials = getattr(cluster, "current_credentials", None)
    return {
        "cluster": cluster,
        "nodes": selectors.cluster_node_hostnames(cluster),
        "pipeline": pipeline,
        "history": transitions,
        "credentials": list(cluster.credentials.current()) if credentials is None else credentials,
        "can_download": selectors.can_download_credentials(user=user, cluster=cluster),
        "can_teardown": can_manage and cluster.reservation.status in ("provisioning", "active"),
        "can_retry": selectors.can_retry_cluster(user=user, cluster=cluster),
        "polling": cluster.status not in TERMINAL_STATUSES and cluster.status not in LIVE_STATUSES,
    }


@require_safe
@portal_view
def cluster_list(request):
    # Only the columns the table shows: no phases, credentials or nodes for 200 rows.
    clusters = (VirtualCluster.objects.for_user(request.user).select_related("reservation__pool", "tenant")
                .order_by("-created_at", "-id")[:200])
    return render_page(request, "provisioning/cluster_list.html", {"clusters": clusters})


@require_safe
@vary_on_headers("HX-Request")  # one URL, two answers: a browser must not cache the polled fragment as the page
@portal_view
@stops_polling_when_gone("cluster")  # its htmx GET is the page's own poll
def cluster_detail(request, pk: int):
    cluster = _cluster(request, pk)
    template = "provisioning/_cluster_poll.html" if request.headers.get("HX-Request") else \
        "provisioning/cluster_detail.html"
    return render_page(request, template, panel_context(request.user, cluster))


@portal_view
@require_POST
def cluster_teardown(request, pk: int):
    cluster = _cluster(request, pk)
    try:
        services.cluster_request_teardown(actor=request.user, cluster=cluster)
        messages.success(request, "Teardown started; the reservation completes once it is done.")
    except DomainError as exc:
        messages.error(request, exc.detail)
    return redirect("cluster-page", pk=pk)


@portal_view
@require_POST
def cluster_retry(request, pk: int):
    cluster = _cluster(request, pk)
    try:
        services.cluster_retry(actor=request.user, cluster=cluster)
        messages.success(request, "Retry started.")
    except DomainError as exc:
        messages.error(request, exc.detail)
    return redirect("cluster-page", pk=pk)


@require_safe
@portal_view
def cluster_credential(request, pk: int, kind: str):
    if kind not in CredentialKind.values:
        raise Http404
    cluster = _cluster(request, pk)
    try:
        filename, data = services.credential_download(actor=request.user, cluster=cluster, kind=kind,
                                                      record=request.method != "HEAD")
    except DomainError as exc:
        if exc.status == 404:
            raise Http404 from None
        # A portal page that says why (not ready yet, a viewer, a secret no key reads), with the way back.
        return render_page(request, "provisioning/credential_error.html", {"cluster": cluster, "detail": exc.detail},
                           status=exc.status)
    response = HttpResponse(data, content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response
