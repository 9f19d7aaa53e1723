"""Celery entry points: ids in, one service call, retries here (DESIGN §2, house style 9).

Every task is safe to run twice and in any order: the services re-read the database under
a lock and do nothing when the state has moved on. Routed to the ``provisioning`` queue by
the ``provisioning.*`` route in settings.
"""

from __future__ import annotations

import logging

from celery import shared_task

logger = logging.getLogger(__name__)

# A teardown that finds the provisioning task still running asks again this often (5 s × 60).
_BUSY_RETRY_SECONDS = 5
_BUSY_RETRIES = 60
# A provisioning task that finds the cluster busy (a booking sync or node swap, seconds) asks again
# a few times (5 s × 12); bounded, so a duplicate delivery beside a running provisioning stops by
# itself, and past it the lifecycle tick's resend still catches the cluster.
_PROVISION_BUSY_RETRIES = 12
# A failed cluster's cleanup that finds the cluster busy asks again as often (5 s × 12); then the tick's resend.
_CLEANUP_BUSY_RETRIES = 12


@shared_task(name="provisioning.lifecycle_tick", ignore_result=True)
def lifecycle_tick() -> dict:
    """Every minute (beat): provision ahead of start, activate, remind, end, resend lost work."""
    from . import services

    report = services.lifecycle_tick()
    if report:
        logger.info("lifecycle tick: %s", report)
    return report


@shared_task(bind=True, name="provisioning.provision_cluster", ignore_result=True, max_retries=None)
def provision_cluster(self, cluster_id: int) -> str:
    from . import services

    try:
        result = services.cluster_provision(cluster_id=cluster_id)
    except services.RetryLater as exc:
        # The attempt count lives in the database, so the message may retry without limit.
        raise self.retry(countdown=exc.countdown, max_retries=None)
    if result == "busy" and self.request.retries < _PROVISION_BUSY_RETRIES:
        raise self.retry(countdown=_BUSY_RETRY_SECONDS, max_retries=None)
    return result


@shared_task(bind=True, name="provisioning.teardown_cluster", ignore_result=True, max_retries=None)
def teardown_cluster(self, cluster_id: int) -> str:
    from . import services

    try:
        result = services.cluster_teardown(cluster_id=cluster_id)
    except services.RetryLater as exc:
        raise self.retry(countdown=exc.countdown, max_retries=None)
    if result == "busy" and self.request.retries < _BUSY_RETRIES:
        raise self.retry(countdown=_BUSY_RETRY_SECONDS, max_retries=None)
    return result


@shared_task(bind=True, name="provisioning.cleanup_failed_cluster", ignore_result=True, max_retries=None)
def cleanup_failed_cluster(self, cluster_id: int) -> str:
    """Go on removing a failed cluster's backend objects (the service sends the next poll itself)."""
    from . import services

    result = services.cluster_cleanup_failed(cluster_id=cluster_id)
    # Another task holds the cluster (a sync, a swap: seconds): ask again soon, not at the tick's resend minutes
    # later while the backend still claims nodes other bookings now hold. Bounded, as provisioning's: a
    # duplicate beside a running cleanup stops by itself (that cleanup sends its own next poll).
    if result == "busy" and self.request.retries < _CLEANUP_BUSY_RETRIES:
        raise self.retry(countdown=_BUSY_RETRY_SECONDS, max_retries=None)
    return result


@shared_task(bind=True, name="provisioning.sync_reservation", ignore_result=True, max_retries=60)
def sync_reservation(self, reservation_id: int) -> str:
    from . import services

    try:
        return services.reservation_sync(reservation_id=reservation_id)
    except services.RetryLater as exc:
        # Waiting out a provisioning run can take minutes; past max_retries the booking stays as it
        # is and `manage.py reconcile` repairs it.
        raise self.retry(countdown=exc.countdown)


@shared_task(bind=True, name="provisioning.node_changed", ignore_result=True, max_retries=12)
def node_changed(self, node_id: int) -> dict:
    from . import services

    try:
        return services.node_sync(node_id=node_id)
    except services.RetryLater as exc:
        # Another sync of this node runs; past the retries `manage.py reconcile` converges it.
        raise self.retry(countdown=exc.countdown)


@shared_task(bind=True, name="provisioning.cluster_nodes_changed", ignore_result=True, max_retries=None)
def cluster_nodes_changed(self, reservation_id: int, failed: str, spare: str | None,
                          allocation_id: int | None = None) -> str:
    from . import services

    try:
        return services.cluster_nodes_changed(reservation_id=reservation_id, failed=failed, spare=spare,
                                              allocation_id=allocation_id)
    except services.RetryLater as exc:
        # The cluster is being provisioned or torn down: the swap follows once that run lets go.
        raise self.retry(countdown=exc.countdown, max_retries=None)
