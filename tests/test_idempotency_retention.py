"""Idempotency-Keys replay their booking for PORTAL_IDEMPOTENCY_KEY_TTL_HOURS, then the beat forgets them.

The table would otherwise grow by one row per keyed POST for ever. The prune and a client
retrying with the same key race on the real database: the retry either replays (the key was
still there) or books afresh (the key had expired and was pruned) — never a 500.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from reservations.models import IdempotencyKey, Reservation
from reservations.services import idempotency_keys_prune, reservation_create

from .conftest import iso, make_world, wait_for_lock_waiter


def _post(world, t0, key: str, node_count: int = 1):
    body = {"pool": "h100", "node_count": node_count, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    return world.client("alpha-lead").post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def _age(key: str, hours: float) -> None:
    IdempotencyKey.objects.filter(key=key).update(created_at=timezone.now() - timedelta(hours=hours))


@pytest.mark.django_db
def test_keys_past_the_ttl_are_pruned_and_then_book_afresh(world, t0, settings):
    settings.PORTAL_IDEMPOTENCY_KEY_TTL_HOURS = 24
    first = _post(world, t0, "old")
    assert first.status_code == 201
    assert _post(world, t0, "young").status_code == 201
    _age("old", 25)
    _age("young", 23)

    assert idempotency_keys_prune() == 1
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {"young"}
    assert idempotency_keys_prune() == 0  # nothing more to do

    # The young key still replays; the expired one is free again, even with another body.
    assert _post(world, t0, "young").json()["id"] != first.json()["id"]
    assert Reservation.objects.count() == 2
    again = _post(world, t0, "old", node_count=2)
    assert again.status_code == 201, again.json()
    assert again.json()["id"] != first.json()["id"] and again.json()["node_count"] == 2
    assert Reservation.objects.count() == 3


@pytest.mark.django_db
def test_prune_takes_one_batch_per_call(world, t0):
    for i in range(5):
        assert _post(world, t0 + timedelta(hours=i), f"k{i}").status_code == 201
    IdempotencyKey.objects.update(created_at=timezone.now() - timedelta(days=3))
    assert idempotency_keys_prune(batch=3) == 3
    assert idempotency_keys_prune(batch=3) == 2
    assert not IdempotencyKey.objects.exists()
    assert Reservation.objects.count() == 5  # only the keys go, never the bookings


def _book_keyed(world, t0, key: str, request_hash: str) -> Reservation:
    return reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                              node_count=1, start=t0, end=t0 + timedelta(hours=1), idempotency_key=key,
                              request_hash=request_hash)


def _book(world, t0, key: str, result: dict) -> None:
    try:
        result["value"] = _book_keyed(world, t0, key, "other-body")
    except BaseException as exc:  # noqa: BLE001 - asserted by the test
        result["value"] = exc
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_retry_waiting_on_a_prune_in_flight_books_afresh(t0):
    """The prune has deleted the expired key but not committed; the retry's claim waits, then books."""
    world = make_world()
    first = _book_keyed(world, t0, "k", "body")
    _age("k", 48)
    pruning, release = threading.Event(), threading.Event()

    def prune() -> None:
        try:
            with transaction.atomic():
                assert idempotency_keys_prune() == 1
                pruning.set()
                release.wait(30)
        finally:
            connection.close()

    pruner = threading.Thread(target=prune)
    pruner.start()
    assert pruning.wait(30)
    result: dict = {}
    retry = threading.Thread(target=_book, args=(world, t0, "k", result))
    retry.start()
    wait_for_lock_waiter("reservations_idempotencykey")
    release.set()
    pruner.join(30)
    retry.join(30)
    assert isinstance(result["value"], Reservation), result
    assert result["value"].pk != first.pk
    assert IdempotencyKey.objects.get(key="k").reservation_id == result["value"].pk


@pytest.mark.django_db(transaction=True)
def test_a_prune_between_the_claim_and_its_read_cannot_take_the_key(t0):
    """The retry's INSERT met a live key; a prune that already counts it as expired runs before the read.

    The claim locked the key it met, so the prune (SKIP LOCKED) passes it over and the retry
    replays its booking instead of finding the key gone.
    """
    world = make_world()
    first = _book_keyed(world, t0, "k", "body")
    _age("k", 23)
    pruned: list[int] = []

    def prune_after_the_claim(execute, sql, params, many, context):
        outcome = execute(sql, params, many, context)
        if sql.startswith("INSERT INTO reservations_idempotencykey") and not pruned:
            later = timezone.now() + timedelta(hours=2)  # the key is expired for this prune
            thread = threading.Thread(target=_prune_in_another_session, args=(pruned, later))
            thread.start()
            thread.join(30)
        return outcome

    with connection.execute_wrapper(prune_after_the_claim):
        replayed = _book_keyed(world, t0, "k", "body")
    assert pruned == [0]
    assert replayed.pk == first.pk
    assert Reservation.objects.count() == 1
    assert IdempotencyKey.objects.get(key="k").reservation_id == first.pk


def _prune_in_another_session(pruned: list[int], now=None) -> None:
    try:
        pruned.append(idempotency_keys_prune(now=now))
    finally:
        connection.close()



@pytest.mark.django_db
def test_a_key_past_the_ttl_books_afresh_before_the_prune_runs(world, t0, settings):
    """The TTL is what a client is told; the hourly prune's timing must not stretch it."""
    settings.PORTAL_IDEMPOTENCY_KEY_TTL_HOURS = 24
    first = _post(world, t0, "k")
    assert first.status_code == 201
    _age("k", 23)
    assert _post(world, t0, "k").json()["id"] == first.json()["id"]  # still replays
    _age("k", 25)  # expired, not pruned
    again = _post(world, t0, "k")
    assert again.status_code == 201, again.json()
    assert again.json()["id"] != first.json()["id"]
    assert _post(world, t0, "k").json()["id"] == again.json()["id"]  # the new claim replays in turn
    _age("k", 25)
    other = _post(world, t0, "k", node_count=2)  # an expired key is free for another body too
    assert other.status_code == 201, other.json()
    assert other.json()["node_count"] == 2
    assert Reservation.objects.count() == 3
    key = IdempotencyKey.objects.get(key="k")
    assert key.reservation_id == other.json()["id"]
    assert timezone.now() - key.created_at < timedelta(minutes=1)


@pytest.mark.django_db(transaction=True)
def test_two_retries_of_an_expired_key_book_once(t0):
    """Both see the expired key; one claims it afresh, the other waits and replays that booking."""
    world = make_world()
    _book_keyed(world, t0, "k", "body")
    _age("k", 48)
    results: list = []
    barrier = threading.Barrier(2)

    def retry() -> None:
        try:
            barrier.wait(30)
            results.append(_book_keyed(world, t0, "k", "body"))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=retry) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(isinstance(r, Reservation) for r in results), results
    assert results[0].pk == results[1].pk
    assert Reservation.objects.count() == 2
    assert IdempotencyKey.objects.get(key="k").reservation_id == results[0].pk


@pytest.mark.django_db
def test_the_hourly_run_drains_more_than_one_batch(world):
    """One 10,000-row batch an hour capped the prune at 240,000 keys a day: any busier API (or a backlog
    after the beat was down) outgrew it for good. The beat's run takes batches until the backlog is gone."""
    from django.contrib.auth import get_user_model

    from reservations.tasks import idempotency_keys_prune_task

    user = get_user_model().objects.get(username="alpha-lead")
    old = timezone.now() - timedelta(days=3)
    IdempotencyKey.objects.bulk_create(
        [IdempotencyKey(user=user, key=f"bulk{i}", request_hash="h") for i in range(25_001)], batch_size=5000)
    IdempotencyKey.objects.update(created_at=old)
    IdempotencyKey.objects.create(user=user, key="young", request_hash="h")

    assert idempotency_keys_prune_task() == 25_001
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["young"]


@pytest.mark.django_db
def test_a_batch_is_deleted_by_index_not_by_scanning_the_table(world):
    """Each batch's DELETE looked its ids up by hash-joining them against a sequential scan of the whole
    table: with the hourly run taking batch after batch, a backlog cost one full scan per batch."""
    from django.contrib.auth import get_user_model

    from reservations.services import IDEMPOTENCY_KEYS_PRUNE_SQL

    user = get_user_model().objects.get(username="alpha-lead")
    IdempotencyKey.objects.bulk_create(
        [IdempotencyKey(user=user, key=f"bulk{i}", request_hash="h") for i in range(20_000)], batch_size=5000)
    with connection.cursor() as cur:
        cur.execute("ANALYZE reservations_idempotencykey")
        cur.execute("EXPLAIN " + IDEMPOTENCY_KEYS_PRUNE_SQL, [timezone.now(), 10_000])
        plan = "\n".join(row[0] for row in cur.fetchall())
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using reservations_idempotencykey_pkey" in plan
