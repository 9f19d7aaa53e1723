"""A write that loses to concurrent ones (a deadlock, a serialization failure: SQLSTATE class 40) is retried
where it can be, and otherwise answered as "busy, send it again" (503 with Retry-After), never a 500."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange

from portal.core.models import AuditLog
from reservations import services
from reservations.models import Allocation, Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db

DEADLOCK = "deadlock_detected"  # 40P01
SERIALIZATION = "serialization_failure"  # 40001


def _raise_from_postgresql(condition: str) -> None:
    """Have PostgreSQL itself raise condition, so the error arrives as psycopg and Django hand it on."""
    with connection.cursor() as cur:
        cur.execute(f"DO $$ BEGIN RAISE EXCEPTION 'lost to a concurrent change' USING ERRCODE = '{condition}'; END $$")


@pytest.fixture
def failing_guard(monkeypatch):
    """A window-change guard (as provisioning's storage guard, which takes the tenant row lock) that loses to a
    concurrent transaction the first `times` times it runs."""
    state = {"times": 0, "calls": 0, "condition": DEADLOCK}

    def guard(reservation, period):
        state["calls"] += 1
        if state["calls"] <= state["times"]:
            _raise_from_postgresql(state["condition"])

    monkeypatch.setattr(services, "window_change_guards", [*services.window_change_guards, guard])
    return state


def _book(world, t0, hours=4):
    body = {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=hours))}
    r = world.client("alpha-lead").post("/api/v1/reservations/", body, format="json")
    assert r.status_code == 201, r.json()
    return r.json()["id"]


@pytest.mark.parametrize("condition", [DEADLOCK, SERIALIZATION])
def test_an_extend_that_loses_a_race_once_is_retried_and_done(world, t0, failing_guard, condition):
    rid = _book(world, t0)
    failing_guard.update(times=1, condition=condition)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 200, r.content
    assert r.json()["end"] == iso(t0 + timedelta(hours=6))
    assert failing_guard["calls"] == 2
    assert {a.period.upper for a in Allocation.objects.filter(reservation_id=rid, active=True)} == {
        t0 + timedelta(hours=6)}
    assert AuditLog.objects.filter(action="reservation.update").count() == 1


def test_an_extend_that_keeps_losing_answers_503_busy_and_changes_nothing(world, t0, failing_guard, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    rid = _book(world, t0)
    failing_guard.update(times=100, condition=SERIALIZATION)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 503, r.content
    body = r.json()
    assert body["code"] == "busy" and body["fields"] == {} and body["detail"]
    assert int(r["Retry-After"]) >= 1
    assert failing_guard["calls"] == 3
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.period.upper == t0 + timedelta(hours=4)
    assert {a.period.upper for a in reservation.allocations.filter(active=True)} == {t0 + timedelta(hours=4)}
    assert not AuditLog.objects.filter(action="reservation.update").exists()


def test_the_extend_page_says_busy_and_changes_nothing(world, web, t0, failing_guard, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    rid = _book(world, t0)
    failing_guard.update(times=100, condition=DEADLOCK)
    r = web("alpha-lead", raise_request_exception=False).post(f"/reservations/{rid}/extend/",
                               {"end": (t0 + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M")})
    assert r.status_code == 503
    assert int(r["Retry-After"]) >= 1  # as the API's 503 and the middleware's page say when to send it again
    assert "try again" in r.content.decode().lower()
    assert Reservation.objects.get(pk=rid).period.upper == t0 + timedelta(hours=4)


@pytest.fixture
def deadlocking_allocation_updates():
    """Every UPDATE of an allocation loses a deadlock (a trigger raising 40P01), as a cancel meeting a
    concurrent node swap in the opposite lock order would."""
    with connection.cursor() as cur:
        cur.execute("CREATE FUNCTION test_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                    " RAISE EXCEPTION 'deadlock detected' USING ERRCODE = 'deadlock_detected'; END $$")
        cur.execute("CREATE TRIGGER test_deadlock BEFORE UPDATE ON reservations_allocation"
                    " FOR EACH ROW EXECUTE FUNCTION test_deadlock()")
    yield
    with connection.cursor() as cur:
        cur.execute("DROP TRIGGER test_deadlock ON reservations_allocation; DROP FUNCTION test_deadlock()")


def test_a_cancel_that_keeps_deadlocking_answers_the_busy_envelope_not_a_500(world, t0, deadlocking_allocation_updates):
    rid = _book(world, t0)
    r = world.client("alpha-lead").post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 503, r.content
    assert r.json()["code"] == "busy" and int(r["Retry-After"]) >= 1
    assert Reservation.objects.get(pk=rid).status == "confirmed"


def test_the_cancel_page_answers_503_not_a_500(world, web, t0, deadlocking_allocation_updates):
    rid = _book(world, t0)
    r = web("alpha-lead", raise_request_exception=False).post(f"/reservations/{rid}/cancel/")
    assert r.status_code == 503
    assert int(r["Retry-After"]) >= 1
    assert Reservation.objects.get(pk=rid).status == "confirmed"


@pytest.fixture
def deadlock_once():
    """Have PostgreSQL fail the first `times` rows a statement on table writes with 40P01 (a trigger; a sequence,
    which a rollback does not undo, counts them), as a transaction losing a deadlock to a concurrent one would."""
    made = []

    def make(table: str, *, op: str = "UPDATE", when: str = "BEFORE", times: int = 1) -> None:
        with connection.cursor() as cur:
            cur.execute("CREATE SEQUENCE test_deadlock_once")
            cur.execute("CREATE FUNCTION test_deadlock_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                        f" IF nextval('test_deadlock_once') <= {int(times)} THEN"
                        " RAISE EXCEPTION 'deadlock detected' USING ERRCODE = 'deadlock_detected'; END IF;"
                        " RETURN NEW; END $$")
            cur.execute(f"CREATE TRIGGER test_deadlock_once {when} {op} ON {table}"
                        " FOR EACH ROW EXECUTE FUNCTION test_deadlock_once()")
        made.append(table)

    yield make
    with connection.cursor() as cur:
        for table in made:
            cur.execute(f"DROP TRIGGER test_deadlock_once ON {table}; DROP FUNCTION test_deadlock_once();"
                        " DROP SEQUENCE test_deadlock_once")


def _losses(seq: str = "test_deadlock_once") -> int:
    with connection.cursor() as cur:
        cur.execute(f"SELECT last_value FROM {seq}")
        return cur.fetchone()[0]


def test_an_extend_of_a_provisioning_booking_that_loses_a_deadlock_is_retried_not_refused(world, t0, deadlock_once):
    """A provisioning (or running) booking keeps its nodes: its extend moves their allocations' end in a savepoint.
    A deadlock there was taken for "its nodes are booked in the new window" (409 capacity_unavailable) though
    they were free; it is a lost race, run again whole, and only a real 23P01 means the nodes are taken."""
    rid = _book(world, t0)
    Reservation.objects.filter(pk=rid).update(status="provisioning")
    deadlock_once("reservations_allocation", times=1)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 200, r.content
    assert r.json()["end"] == iso(t0 + timedelta(hours=6))
    assert _losses() == 2  # lost once, then done
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.period.upper == t0 + timedelta(hours=6)
    assert {a.period.upper for a in reservation.allocations.filter(active=True)} == {t0 + timedelta(hours=6)}
    assert AuditLog.objects.filter(action="reservation.update").count() == 1


def test_an_extend_of_a_provisioning_booking_that_keeps_losing_deadlocks_answers_busy(world, t0, deadlock_once,
                                                                                       settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    rid = _book(world, t0)
    Reservation.objects.filter(pk=rid).update(status="provisioning")
    deadlock_once("reservations_allocation", times=100)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 503, r.content
    assert r.json()["code"] == "busy"
    assert _losses() == 3
    assert Reservation.objects.get(pk=rid).period.upper == t0 + timedelta(hours=4)
    assert not AuditLog.objects.filter(action="reservation.update").exists()


def test_an_extend_not_yet_begun_that_loses_a_deadlock_is_run_again_on_its_own_nodes(world, t0, deadlock_once):
    """Not yet begun, a deadlock moving its allocations is no reason to re-pick its nodes either: run again whole."""
    rid = _book(world, t0)
    held = set(Allocation.objects.filter(reservation_id=rid, active=True).values_list("node_id", flat=True))
    deadlock_once("reservations_allocation", times=1)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 200, r.content
    allocations = Allocation.objects.filter(reservation_id=rid)
    assert allocations.count() == 1  # the same allocation, moved; not deleted and booked again
    assert set(allocations.values_list("node_id", flat=True)) == held
    assert {a.period.upper for a in allocations} == {t0 + timedelta(hours=6)}


@pytest.mark.parametrize("table, op, when", [
    ("reservations_allocation", "UPDATE", "BEFORE"),  # releasing its nodes, as against a concurrent node swap
    ("core_outboxevent", "INSERT", "AFTER"),  # the last write: everything before it is rolled back too
])
def test_a_cancel_that_loses_a_deadlock_once_is_retried_and_done(world, t0, deadlock_once, settings, table, op,
                                                                 when):
    from portal.core.models import OutboxEvent

    rid = _book(world, t0)
    settings.PORTAL_EVENTS_INLINE = False  # as in production: the event is an outbox row in the cancel's transaction
    OutboxEvent.objects.all().delete()
    deadlock_once(table, op=op, when=when, times=1)
    r = world.client("alpha-lead").post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "cancelled"
    assert _losses() == 2
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.status == "cancelled"
    assert not reservation.allocations.filter(active=True).exists()
    assert AuditLog.objects.filter(action="reservation.cancel").count() == 1
    assert OutboxEvent.objects.filter(event="reservation.cancelled").count() == 1


def test_the_cancel_page_that_loses_a_deadlock_once_cancels(world, web, t0, deadlock_once):
    rid = _book(world, t0)
    deadlock_once("reservations_allocation", times=1)
    r = web("alpha-lead").post(f"/reservations/{rid}/cancel/")
    assert r.status_code == 302
    assert _losses() == 2
    assert Reservation.objects.get(pk=rid).status == "cancelled"
    assert AuditLog.objects.filter(action="reservation.cancel").count() == 1


def test_a_cancel_that_keeps_losing_is_tried_as_often_as_a_change(world, t0, deadlock_once, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    rid = _book(world, t0)
    deadlock_once("reservations_allocation", times=100)
    r = world.client("alpha-lead").post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 503, r.content
    assert r.json()["code"] == "busy" and int(r["Retry-After"]) >= 1
    assert _losses() == 3
    assert Reservation.objects.get(pk=rid).status == "confirmed"
    assert not AuditLog.objects.filter(action="reservation.cancel").exists()


def _block_own_node_after(rid, start, end):
    """Take the booking's node in [start, end) (a maintenance window), so extending it into that time must
    re-pick its nodes (not yet begun): the move of its allocation fails with a real 23P01 first."""
    node_id = Allocation.objects.get(reservation_id=rid, active=True).node_id
    Allocation.objects.create(node_id=node_id, period=DateTimeTZRange(start, end, "[)"), kind="maintenance")
    return node_id


def test_a_repick_that_keeps_losing_deadlocks_answers_busy_not_capacity_unavailable(world, t0, deadlock_once,
                                                                                    settings):
    """Re-picking the nodes of a booking not yet begun runs in a savepoint of the change's transaction. A deadlock
    there keeps every lock taken before it, so trying again in place only deadlocks the same way: that used up the
    attempts and answered 409 capacity_unavailable though free nodes were there. The whole change runs again, and
    a change that keeps losing answers 503 busy, changing nothing."""
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    rid = _book(world, t0)
    own = _block_own_node_after(rid, t0 + timedelta(hours=4), t0 + timedelta(hours=6))
    deadlock_once("reservations_allocation", op="INSERT", times=3)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 503, r.content
    assert r.json()["code"] == "busy"
    assert _losses() == 3  # one loss per run of the whole change
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.period.upper == t0 + timedelta(hours=4)
    assert list(reservation.allocations.values_list("node_id", "active")) == [(own, True)]
    assert not AuditLog.objects.filter(action="reservation.update").exists()


def test_a_repick_that_loses_a_deadlock_once_is_run_again_and_done(world, t0, deadlock_once, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    rid = _book(world, t0)
    own = _block_own_node_after(rid, t0 + timedelta(hours=4), t0 + timedelta(hours=6))
    deadlock_once("reservations_allocation", op="INSERT", times=1)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6))},
                                         format="json")
    assert r.status_code == 200, r.content
    assert _losses() == 2
    allocations = Allocation.objects.filter(reservation_id=rid)
    assert allocations.count() == 1 and allocations.get().node_id != own
    assert allocations.get().period.upper == t0 + timedelta(hours=6)
    assert AuditLog.objects.filter(action="reservation.update").count() == 1


def _fail_node_of(rid):
    from reservations.models import Node

    node = Node.objects.get(pk=Allocation.objects.get(reservation_id=rid, active=True).node_id)
    Node.objects.filter(pk=node.pk).update(state="failed")
    node.refresh_from_db()
    return node


def test_a_swap_that_keeps_losing_deadlocks_is_busy_not_degraded(world, t0, deadlock_once, settings):
    """A swap took its spare in a savepoint and tried again there on a deadlock: deadlocking again the same way,
    it ran out of attempts and marked the booking degraded (a node short, the team told so) though spares were
    free. The swap runs again whole; one that keeps losing raises Busy with nothing changed, to be tried again."""
    from portal.core.exceptions import Busy

    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    rid = _book(world, t0)
    failed = _fail_node_of(rid)
    deadlock_once("reservations_allocation", op="INSERT", times=3)
    with pytest.raises(Busy):
        services.node_replace_allocations(node=failed, reason="failed")
    assert _losses() == 3
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.missing_nodes == 0
    assert list(reservation.allocations.values_list("node_id", "active")) == [(failed.pk, True)]
    assert not AuditLog.objects.filter(action="reservation.replace_node").exists()


def test_a_swap_that_loses_a_deadlock_once_is_run_again_and_moves_the_booking(world, t0, deadlock_once, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    rid = _book(world, t0)
    failed = _fail_node_of(rid)
    deadlock_once("reservations_allocation", op="INSERT", times=1)
    [outcome] = services.node_replace_allocations(node=failed, reason="failed")
    assert outcome["result"] == "replaced"
    assert _losses() == 2
    assert Reservation.objects.get(pk=rid).missing_nodes == 0
    assert Allocation.objects.filter(reservation_id=rid, active=True).exclude(node=failed).count() == 1
    assert AuditLog.objects.filter(action="reservation.replace_node").count() == 1


def test_a_node_sync_whose_swap_keeps_losing_deadlocks_is_retried_later(world, t0, deadlock_once, settings):
    """node_sync (the node_changed task) tells its task to try again when the swap stays busy, rather than
    failing the task with the bookings left on the failed node."""
    from provisioning import services as provisioning

    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    rid = _book(world, t0)
    failed = _fail_node_of(rid)
    deadlock_once("reservations_allocation", op="INSERT", times=2)
    with pytest.raises(provisioning.RetryLater):
        provisioning.node_sync(node_id=failed.pk)
    assert Allocation.objects.get(reservation_id=rid, active=True).node_id == failed.pk
    assert provisioning.node_sync(node_id=failed.pk) == {"replaced": 1}  # the task's retry
    assert Allocation.objects.filter(reservation_id=rid, active=True).exclude(node=failed).count() == 1


def _book_body(t0, hours=4):
    return {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=hours))}


def test_a_booking_that_keeps_losing_deadlocks_answers_busy_not_capacity_unavailable(world, t0, deadlock_once,
                                                                                    settings):
    """A booking whose every attempt lost a deadlock (not a node: the pool is free) was answered 409
    capacity_unavailable with suggested windows, as if the nodes were taken. It is busy (503, Retry-After), as a
    change or a cancel that keeps losing is, and nothing of it is stored."""
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    deadlock_once("reservations_allocation", op="INSERT", times=100)
    r = world.client("alpha-lead").post("/api/v1/reservations/", _book_body(t0), format="json",
                                        HTTP_IDEMPOTENCY_KEY="busy-booking-1")
    assert r.status_code == 503, r.content
    body = r.json()
    assert body["code"] == "busy" and body["fields"] == {} and body["detail"]
    assert "suggestions" not in body
    assert int(r["Retry-After"]) >= 1
    assert _losses() == 3
    assert not Reservation.objects.exists()
    assert not Allocation.objects.filter(kind="reservation").exists()
    assert not AuditLog.objects.filter(action="reservation.create").exists()
    from reservations.models import IdempotencyKey
    assert not IdempotencyKey.objects.exists()


def test_a_booking_whose_last_attempt_loses_a_node_still_answers_capacity_unavailable(world, t0, deadlock_once,
                                                                                      settings):
    """Deadlocks first, then the pool really full: the answer is capacity_unavailable (the pick found no node)."""
    from reservations.models import Node

    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 3
    h100 = Node.objects.filter(pool__name="h100", state="available")
    for node in h100:
        Allocation.objects.create(node=node, period=DateTimeTZRange(t0, t0 + timedelta(hours=4), "[)"),
                                  kind="maintenance")
    deadlock_once("reservations_idempotencykey", op="INSERT", times=2)  # the claim, before the pick
    r = world.client("alpha-lead").post("/api/v1/reservations/", _book_body(t0), format="json",
                                        HTTP_IDEMPOTENCY_KEY="full-pool-1")
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "capacity_unavailable" and "suggestions" in r.json()
    assert _losses() == 3
    assert not Reservation.objects.exists()


@pytest.mark.parametrize("condition", [DEADLOCK, SERIALIZATION])
def test_a_booking_that_loses_a_race_once_is_retried_and_booked(world, t0, deadlock_once, condition):
    """A serialization failure is a lost race as a deadlock is: the booking runs again (it was answered busy at
    once, never retried)."""
    deadlock_once("reservations_allocation", op="INSERT", times=1)
    if condition == SERIALIZATION:
        with connection.cursor() as cur:
            cur.execute("CREATE OR REPLACE FUNCTION test_deadlock_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                        " IF nextval('test_deadlock_once') <= 1 THEN"
                        " RAISE EXCEPTION 'could not serialize' USING ERRCODE = 'serialization_failure'; END IF;"
                        " RETURN NEW; END $$")
    r = world.client("alpha-lead").post("/api/v1/reservations/", _book_body(t0), format="json")
    assert r.status_code == 201, r.content
    assert _losses() == 2
    assert Reservation.objects.count() == 1
    assert AuditLog.objects.filter(action="reservation.create").count() == 1


def test_the_booking_page_that_keeps_losing_deadlocks_says_busy_not_full(world, web, t0, deadlock_once, settings):
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    deadlock_once("reservations_allocation", op="INSERT", times=100)
    data = {"tenant": "alpha", "pool": "h100", "node_count": 1, "start": iso(t0),
            "end": iso(t0 + timedelta(hours=2)), "name": "web run", "orchestrator": "kubernetes",
            "cuda_version": "12.6"}
    r = web("alpha-lead", raise_request_exception=False).post("/reservations/new/", data)
    assert r.status_code == 503
    assert int(r["Retry-After"]) >= 1
    page = r.content.decode()
    assert "try again" in page.lower() and 'value="web run"' in page  # the form kept, to send again
    assert _losses() == 2
    assert not Reservation.objects.exists()
