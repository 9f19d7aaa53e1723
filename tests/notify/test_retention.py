"""Finished deliveries stay PORTAL_NOTIFY_RETENTION_DAYS after their last change; then the beat prunes them."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from notifications import services
from notifications.choices import AttemptVerdict, DeliveryStatus
from notifications.models import Delivery, DeliveryAttempt
from portal.core.exceptions import InvalidState
from tests.conftest import wait_for_lock_waiter


def _delivery(world, status: str, *, age_days: float, touched_days: float | None = None, attempts: int = 1) -> Delivery:
    delivery = Delivery.objects.create(
        key=f"test:{uuid.uuid4()}", kind="webhook", tenant=world.tenants["alpha"], event="reservation.confirmed",
        message_id=f"msg_{uuid.uuid4().hex}", body="{}", status=status, attempts=attempts,
        delivered_at=timezone.now() if status == DeliveryStatus.DELIVERED else None,
    )
    for number in range(1, attempts + 1):
        DeliveryAttempt.objects.create(delivery=delivery, number=number, started_at=timezone.now(),
                                       verdict=AttemptVerdict.DELIVERED)
    now = timezone.now()
    touched = age_days if touched_days is None else touched_days
    Delivery.objects.filter(pk=delivery.pk).update(created_at=now - timedelta(days=age_days),
                                                   updated_at=now - timedelta(days=touched))
    return delivery


@pytest.mark.django_db
def test_finished_deliveries_past_retention_go_with_their_attempts(world, settings):
    settings.PORTAL_NOTIFY_RETENTION_DAYS = 90
    old = [_delivery(world, status, age_days=91, attempts=2)
           for status in (DeliveryStatus.DELIVERED, DeliveryStatus.FAILED, DeliveryStatus.SKIPPED)]
    kept = [
        _delivery(world, DeliveryStatus.DELIVERED, age_days=89),  # young
        _delivery(world, DeliveryStatus.FAILED, age_days=200, touched_days=3),  # requeued and failed again lately
        *(_delivery(world, status, age_days=400)  # never finished: a worker still owes them a send
          for status in (DeliveryStatus.PENDING, DeliveryStatus.SENDING, DeliveryStatus.RETRYING)),
    ]

    assert services.deliveries_prune() == 3
    assert set(Delivery.objects.values_list("pk", flat=True)) == {d.pk for d in kept}
    assert not DeliveryAttempt.objects.filter(delivery_id__in=[d.pk for d in old]).exists()
    assert DeliveryAttempt.objects.count() == len(kept)
    assert services.deliveries_prune() == 0


@pytest.mark.django_db
def test_one_batch_per_call_and_the_retention_is_a_setting(world, settings):
    for _ in range(5):
        _delivery(world, DeliveryStatus.DELIVERED, age_days=10)
    settings.PORTAL_NOTIFY_RETENTION_DAYS = 30
    assert services.deliveries_prune() == 0
    settings.PORTAL_NOTIFY_RETENTION_DAYS = 7
    assert services.deliveries_prune(batch=3) == 3
    assert services.deliveries_prune(batch=3) == 2
    assert not Delivery.objects.exists()


def _session() -> psycopg.Connection:
    """A second database session, outside Django: another worker or an admin's request in flight."""
    params = connection.get_connection_params()
    return psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory", "context")},
                           autocommit=False)


@pytest.mark.django_db(transaction=True)
def test_a_requeue_in_flight_keeps_its_delivery(world):
    delivery = _delivery(world, DeliveryStatus.FAILED, age_days=120)
    with _session() as other:  # a requeue holding the row, not yet committed
        other.execute("SELECT id FROM notifications_delivery WHERE id = %s FOR UPDATE", [delivery.pk])
        assert services.deliveries_prune() == 0  # skipped, not waited for
        other.rollback()
    assert services.deliveries_prune() == 1


@pytest.mark.django_db(transaction=True)
def test_a_requeue_racing_the_prune_answers_invalid_state_not_500(world):
    """The prune has the row (deleted, not yet committed); the lead's "retry now" waits, then finds it gone."""
    delivery = _delivery(world, DeliveryStatus.FAILED, age_days=120)
    result: dict = {}

    def requeue() -> None:
        try:
            result["value"] = services.delivery_requeue(actor=world.users["alpha-lead"], delivery=delivery)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            result["value"] = exc
        finally:
            connection.close()

    with _session() as pruner:
        pruner.execute("DELETE FROM notifications_deliveryattempt WHERE delivery_id = %s", [delivery.pk])
        pruner.execute("DELETE FROM notifications_delivery WHERE id = %s", [delivery.pk])
        thread = threading.Thread(target=requeue)
        thread.start()
        wait_for_lock_waiter("notifications_delivery")
        pruner.commit()
    thread.join(30)
    assert isinstance(result["value"], InvalidState), result
    assert "no longer kept" in str(result["value"])




@pytest.mark.django_db
def test_the_hourly_run_drains_more_than_one_batch(world, settings):
    """One 10,000-row batch an hour capped the prune at 240,000 deliveries a day: a busier cluster (or a
    backlog after the beat was down) outgrew it for good. The beat's run takes batches until none is left."""
    from notifications.tasks import prune_task

    settings.PORTAL_NOTIFY_RETENTION_DAYS = 90
    tenant = world.tenants["alpha"]
    Delivery.objects.bulk_create([
        Delivery(key=f"bulk:{i}", kind="webhook", tenant=tenant, event="reservation.confirmed", message_id=f"m{i}",
                 body="{}", status=DeliveryStatus.SKIPPED) for i in range(25_001)
    ], batch_size=5000)
    old = timezone.now() - timedelta(days=91)
    Delivery.objects.update(created_at=old, updated_at=old)
    young = _delivery(world, DeliveryStatus.DELIVERED, age_days=1)

    assert prune_task() == 25_001
    assert list(Delivery.objects.values_list("pk", flat=True)) == [young.pk]


@pytest.mark.django_db
def test_a_batch_goes_in_a_few_statements_without_loading_the_rows(world, settings):
    """Deleting through the ORM loaded every pruned delivery whole (body, payload) into the worker and
    then deleted them 100 at a time, holding the batch's row locks all the while (about 1 s for 10,000)."""
    from django.test.utils import CaptureQueriesContext

    settings.PORTAL_NOTIFY_RETENTION_DAYS = 90
    for _ in range(3):
        _delivery(world, DeliveryStatus.DELIVERED, age_days=91, attempts=2)
    tenant = world.tenants["alpha"]
    Delivery.objects.bulk_create([
        Delivery(key=f"bulk:{i}", kind="webhook", tenant=tenant, event="reservation.confirmed", message_id=f"m{i}",
                 body="{}", status=DeliveryStatus.DELIVERED, delivered_at=timezone.now()) for i in range(250)
    ])
    old = timezone.now() - timedelta(days=91)
    Delivery.objects.update(created_at=old, updated_at=old)

    with CaptureQueriesContext(connection) as queries:
        assert services.deliveries_prune() == 253
    statements = [q["sql"] for q in queries.captured_queries
                  if q["sql"] not in ("BEGIN", "COMMIT") and "SAVEPOINT" not in q["sql"]]
    assert not any('"body"' in sql or '"payload"' in sql for sql in statements), statements
    assert len(statements) <= 4, statements
    assert not Delivery.objects.exists() and not DeliveryAttempt.objects.exists()
