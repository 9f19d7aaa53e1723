"""Health pages: the staff fleet-health board, node and repair pages, check details, and the
cluster health page where a tenant's leads and members run checks on their nodes.

Views parse, call a service or selector and render; every read goes through the tenant scope
(``selectors.checks_for_user`` / ``VirtualCluster.objects.for_user``).
"""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from portal.core.exceptions import DomainError
from portal.core.words import count_of
from reservations.models import Node
from tenants.views import portal_view, render_page, stops_polling_when_gone

from . import selectors, services
from .choices import CheckLevel, RepairState, Verdict
from .models import Repair

__all__ = [
    "fleet_health",
    "node_health",
    "node_check",
    "node_repair_open",
    "sweep_now",
    "repair_detail",
    "repair_step",
    "check_detail",
    "cluster_health",
    "cluster_health_results",
    "cluster_health_run",
]

# The staff's buttons on a repair in each state: (target state, label, style).
REPAIR_ACTIONS: dict[str, list[tuple[str, str, str]]] = {
    RepairState.RECOMMENDED: [(RepairState.ACCEPTED, "Accept repair", "primary")],
    RepairState.ACCEPTED: [(RepairState.CORDONED, "Cordon and drain", "primary")],
    RepairState.CORDONED: [(RepairState.REMEDIATING, "Start remediation", "primary")],
    RepairState.REMEDIATING: [(RepairState.RETESTING, "Re-test (medium)", "primary")],
    RepairState.RETESTING: [(RepairState.REJOINED, "Rejoin the fleet", "primary"),
                            (RepairState.REMEDIATING, "Back to remediation", "")],
}


def _is_partial(request) -> bool:
    return bool(getattr(request, "htmx", False)) and not request.htmx.boosted


# --- staff ----------------------------------------------------------------------------------------


@require_GET
@portal_view(staff_only=True)
def fleet_health(request):
    verdict = request.GET.get("verdict", "")
    nodes = selectors.nodes_with_health(Node.objects.exclude(state="retired").select_related("pool"))
    if verdict in Verdict.values:
        nodes = nodes.filter(health_verdict=verdict)
    elif verdict == "unchecked":
        nodes = nodes.filter(health_verdict__isnull=True)
    elif verdict != "all":
        verdict = ""
        # By default: what needs a look (not passing — never checked included —, out of service, or being
        # checked). The verdict is an annotation: a NULL one made exclude()'s condition unknown, dropping the row.
        nodes = nodes.filter(~Q(health_verdict=Verdict.PASS) | ~Q(state="available") | Q(health_verdict__isnull=True))
    page = Paginator(nodes.order_by("pool__name", "hostname"), 100).get_page(request.GET.get("page"))
    return render_page(request, "health/fleet.html", {
        "summary": selectors.fleet_summary(),
        "page": page,
        "verdict": verdict,
        "verdicts": Verdict.values,
        "repairs": selectors.open_repairs()[:50],
        "levels": CheckLevel.choices,
    })


@require_GET
@portal_view(staff_only=True)
def node_health(request, hostname: str):
    node = get_object_or_404(selectors.nodes_with_health(Node.objects.select_related("pool")),
                             hostname__iexact=hostname)
    checks = selectors.checks_for_user(request.user).filter(node=node).order_by("-created_at", "-pk")
    page = Paginator(checks, 50).get_page(request.GET.get("page"))
    latest = selectors.latest_checks([node.pk]).get(node.pk)
    return render_page(request, "health/node.html", {
        "node": node, "page": page, "latest": latest, "levels": CheckLevel.choices,
        "repairs": Repair.objects.filter(node=node).order_by("-opened_at")[:20],
    })


@require_POST
@portal_view(staff_only=True)
def node_check(request, hostname: str):
    node = get_object_or_404(Node, hostname__iexact=hostname)
    try:
        check = services.node_health_check_request(actor=request.user, node=node, level=request.POST.get("level"))
        messages.success(request, f"{check.get_level_display().split(' (')[0]} check #{check.pk} of {node} queued.")
    except DomainError as exc:
        messages.error(request, exc.detail)
    return HttpResponseRedirect(reverse("health-node", args=[node.hostname]))


@require_POST
@portal_view(staff_only=True)
def node_repair_open(request, hostname: str):
    node = get_object_or_404(Node, hostname__iexact=hostname)
    try:
        repair = services.repair_open(actor=request.user, node=node, reason=request.POST.get("reason", ""))
    except DomainError as exc:
        messages.error(request, exc.detail)
        return HttpResponseRedirect(reverse("health-node", args=[node.hostname]))
    messages.success(request, f"Repair #{repair.pk} opened; {node} is drained.")
    return HttpResponseRedirect(reverse("health-repair", args=[repair.pk]))


@require_POST
@portal_view(staff_only=True)
def sweep_now(request):
    ids = services.health_sweep(level=CheckLevel.QUICK)
    messages.success(request, f"Quick check{'' if len(ids) == 1 else 's'} queued on {count_of(len(ids), 'node')}.")
    return HttpResponseRedirect(reverse("health-fleet"))


@require_GET
@portal_view(staff_only=True)
def repair_detail(request, pk: int):
    repair = get_object_or_404(
        Repair.objects.select_related("node__pool", "triggering_check", "retest_check", "opened_by"), pk=pk
    )
    return render_page(request, "health/repair.html", {
        "repair": repair,
        "actions": REPAIR_ACTIONS.get(repair.state, []),
        "can_fail": repair.is_open,
    })


@require_POST
@portal_view(staff_only=True)
def repair_step(request, pk: int):
    repair = get_object_or_404(Repair, pk=pk)
    try:
        repair = services.repair_advance(actor=request.user, repair=repair, to=request.POST.get("to", ""),
                                         note=request.POST.get("note", ""))
        done = f"Repair #{repair.pk}: {repair.get_state_display().lower()}."
        held_for = selectors.rejoined_node_held_for(repair)
        if held_for is None:
            messages.success(request, done)
        else:  # the GPUs are fine, but the node is not back in service: say so, and why
            messages.warning(request, f"{done} {repair.node.hostname} stays held in maintenance: the teardown of "
                                      f"cluster #{held_for} failed and the tenant's cluster may still be on it; "
                                      "it is given back when a retried teardown succeeds.")
    except DomainError as exc:
        messages.error(request, exc.detail)
    return HttpResponseRedirect(reverse("health-repair", args=[pk]))


# --- everyone (scoped) ----------------------------------------------------------------------------


@require_GET
@portal_view
def check_detail(request, pk: int):
    check = selectors.checks_for_user(request.user).filter(pk=pk).first()
    if check is None:
        raise Http404("No such check.")
    return render_page(request, "health/check.html", {"check": selectors.check_as_seen_by(request.user, check)})


def _cluster(request, pk: int):
    from provisioning.models import VirtualCluster  # the cluster app may load after this one

    cluster = VirtualCluster.objects.for_user(request.user).select_related("reservation", "tenant").filter(
        pk=pk).first()
    if cluster is None:
        raise Http404("No such cluster.")
    return cluster


def _cluster_context(request, cluster) -> dict:
    rows = selectors.cluster_health(cluster, user=request.user)
    return {
        "cluster": cluster,
        "rows": rows,
        "polling": any(row["open"] for row in rows),
        "can_request": selectors.can_request_cluster_checks(request.user, cluster),
        "levels": CheckLevel.choices,
        "compact": False,
    }


@require_GET
@portal_view
def cluster_health(request, pk: int):
    cluster = _cluster(request, pk)
    history = selectors.checks_for_user(request.user).filter(
        selectors.cluster_checks_q(cluster.reservation)).order_by("-created_at", "-pk")[:50]
    history = [selectors.check_as_seen_by(request.user, check) for check in history]
    return render_page(request, "health/cluster.html", {**_cluster_context(request, cluster), "history": history})


@require_GET
@portal_view
@stops_polling_when_gone("cluster")
def cluster_health_results(request, pk: int):
    """The results partial alone (htmx polls it while checks run)."""
    return render_page(request, "health/_results.html", _cluster_context(request, _cluster(request, pk)))


@require_POST
@portal_view
def cluster_health_run(request, pk: int):
    cluster = _cluster(request, pk)
    if not selectors.may_check_cluster(request.user, cluster):
        raise PermissionDenied("Only the tenant's leads and members can run health checks.")
    try:
        checks = services.cluster_health_checks_request(actor=request.user, cluster=cluster,
                                                        level=request.POST.get("level"))
        messages.success(request, f"{count_of(len(checks), request.POST.get('level') + ' check')} queued.")
    except DomainError as exc:
        messages.error(request, exc.detail)
    if _is_partial(request):
        return render_page(request, "health/_results.html", _cluster_context(request, cluster))
    return HttpResponseRedirect(reverse("health-cluster", args=[pk]))
