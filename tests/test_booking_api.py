"""Booking through the API: the happy paths and the rules of DESIGN §4."""

from datetime import timedelta

import pytest

from portal.core.models import AuditLog
from reservations.models import Allocation, IdempotencyKey, Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db


def book(world, who, t0, hours=4, n=1, offset=0, **extra):
    body = {"pool": "h100", "node_count": n, "start": iso(t0 + timedelta(hours=offset)),
            "end": iso(t0 + timedelta(hours=offset + hours)), **extra}
    return world.client(who).post("/api/v1/reservations/", body, format="json")


def test_book_returns_the_contract_fields(world, t0):
    r = book(world, "alpha-lead", t0, n=2, name="pretrain")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert set(body) >= {"id", "tenant", "pool", "node_count", "start", "end", "status", "billing", "nodes",
                         "name", "created_at"}
    assert body["tenant"] == "alpha" and body["pool"] == "h100" and body["node_count"] == 2
    assert body["start"] == iso(t0) and body["end"] == iso(t0 + timedelta(hours=4))
    assert body["status"] == "confirmed" and body["billing"] == "committed"
    assert len(body["nodes"]) == 2 and all(h.startswith("h100-") for h in body["nodes"])
    assert body["created_at"].endswith("Z")
    assert Allocation.objects.filter(reservation_id=body["id"], active=True).count() == 2
    assert AuditLog.objects.filter(action="reservation.create", object_id=str(body["id"])).exists()


def test_offset_datetimes_are_normalised_to_utc(world, t0):
    start = (t0 + timedelta(hours=2)).astimezone(__import__("zoneinfo").ZoneInfo("Asia/Kolkata"))
    end = start + timedelta(hours=1)
    r = world.client("alpha-lead").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 1, "start": start.isoformat(), "end": end.isoformat()}, format="json")
    assert r.status_code == 201, r.json()
    assert r.json()["start"] == iso(t0 + timedelta(hours=2))


def test_member_books_and_viewer_cannot(world, t0):
    assert book(world, "alpha-member", t0).status_code == 201
    r = book(world, "alpha-viewer", t0)
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    assert Reservation.objects.count() == 1


def test_quota_guaranteed_then_burst_then_refused(world, t0):
    assert book(world, "alpha-lead", t0, n=3).json()["billing"] == "committed"
    assert book(world, "alpha-lead", t0, n=1).json()["billing"] == "burst"
    r = book(world, "alpha-lead", t0, n=1, hours=1)
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded"
    # The same tenant may book again in a window that does not overlap.
    assert book(world, "alpha-lead", t0, n=3, offset=4).json()["billing"] == "committed"


def test_burst_disabled_means_the_guarantee_is_the_limit(world, t0):
    tenant = world.tenants["alpha"]
    tenant.burst_enabled = False
    tenant.save()
    assert book(world, "alpha-lead", t0, n=3).status_code == 201
    r = book(world, "alpha-lead", t0, n=1)
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded"


def test_no_quota_row_and_max_duration(world, t0):
    q = world.tenants["beta"].quotas.get()
    q.max_duration_hours = 8
    q.save()
    r = book(world, "beta-lead", t0, hours=9)
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded"
    q.delete()
    r = book(world, "beta-lead", t0, hours=1)
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded"
    assert Reservation.objects.count() == 0


def test_capacity_unavailable_carries_suggestions_that_book(world, t0):
    assert book(world, "alpha-lead", t0, n=3, hours=4).status_code == 201
    assert book(world, "beta-lead", t0, n=1, hours=2, offset=1).status_code == 201
    r = book(world, "beta-lead", t0, n=2, hours=2, offset=1)
    assert r.status_code == 409
    body = r.json()
    assert body["code"] == "capacity_unavailable" and body["fields"] == {}
    assert "Only 0 of 4" in body["detail"]
    assert body["suggestions"], body
    for s in body["suggestions"]:
        assert s["end"] > s["start"]
    after = [s for s in body["suggestions"] if s["start"] > iso(t0 + timedelta(hours=1))]
    # Earliest fit after: alpha's 3 nodes free up at t0+4h, beta's node at t0+3h ⇒ t0+4h... but
    # 2 nodes are already free at t0+3h (the 4th node) + none; the first window with 2 free is t0+4h.
    assert after[0]["start"] == iso(t0 + timedelta(hours=4))
    again = world.client("beta-lead").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 2, **after[0]}, format="json")
    assert again.status_code == 201, again.json()


def test_idempotency_key_replays_instead_of_booking_twice(world, t0):
    client = world.client("alpha-lead")
    body = {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    first = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    second = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] == second.json()["id"]
    assert Reservation.objects.count() == 1
    changed = client.post("/api/v1/reservations/", {**body, "node_count": 2}, format="json",
                          HTTP_IDEMPOTENCY_KEY="k-1")
    assert changed.status_code == 400 and "Idempotency-Key" in changed.json()["fields"]
    assert Reservation.objects.count() == 1
    # Another user's identical key is theirs alone.
    other = world.client("alpha-member").post("/api/v1/reservations/", body, format="json",
                                              HTTP_IDEMPOTENCY_KEY="k-1")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


def test_a_retry_replays_its_booking_after_the_slot_it_started_in_has_passed(world):
    """A booking of the slot running now, retried with its key once the next slot has begun (the answer
    was lost on the way back): the client must get its booking back, not a refusal that says it has none."""
    from unittest import mock

    from django.utils import timezone

    from reservations.timeutil import slot_floor

    client = world.client("alpha-lead")
    now = slot_floor(timezone.now(), 60) + timedelta(minutes=59, seconds=59)
    body = {"pool": "h100", "node_count": 1, "start": iso(slot_floor(now, 60)),
            "end": iso(slot_floor(now, 60) + timedelta(hours=2))}
    with mock.patch("django.utils.timezone.now", return_value=now):
        first = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="now-1")
    assert first.status_code == 201, first.json()
    with mock.patch("django.utils.timezone.now", return_value=now + timedelta(seconds=2)):
        retry = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="now-1")
    # was: 400 invalid, "start: Cannot start in the past" — while the first request's booking holds the node
    assert retry.status_code == 201, retry.json()
    assert retry.json()["id"] == first.json()["id"] and retry.json()["nodes"] == first.json()["nodes"]
    assert Reservation.objects.count() == 1


def test_a_retry_replays_its_booking_after_the_pool_lost_a_node(world, t0):
    """The whole pool booked with a key; staff retire a node; the retry is the same request: it replays."""
    from reservations.services import node_update

    client = world.client("alpha-lead")
    body = {"pool": "h100", "node_count": 4, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    first = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="all-4")
    assert first.status_code == 201, first.json()
    spare = Allocation.objects.filter(reservation_id=first.json()["id"]).first().node
    node_update(actor=world.users["staff"], node=spare, state="retired")
    retry = client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="all-4")
    # was: 400 invalid, "node_count: The h100 pool has only 3 nodes."
    assert retry.status_code == 201, retry.json()
    assert retry.json()["id"] == first.json()["id"]
    # Another request under the key is judged as any request is: refused, nothing booked.
    changed = client.post("/api/v1/reservations/", {**body, "name": "other"}, format="json",
                          HTTP_IDEMPOTENCY_KEY="all-4")
    assert changed.status_code == 400 and changed.json()["code"] == "invalid"
    assert Reservation.objects.count() == 1


def test_failed_booking_does_not_burn_the_idempotency_key(world, t0):
    client = world.client("alpha-lead")
    body = {"pool": "h100", "node_count": 5, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    assert client.post("/api/v1/reservations/", body, format="json", HTTP_IDEMPOTENCY_KEY="k-2").status_code == 400
    assert not IdempotencyKey.objects.exists()


def test_extend_shorten_rename(world, t0):
    rid = book(world, "alpha-lead", t0, n=2).json()["id"]
    client = world.client("alpha-lead")
    r = client.patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=6)), "name": "longer"},
                     format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["end"] == iso(t0 + timedelta(hours=6)) and r.json()["name"] == "longer"
    r = client.patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=2))}, format="json")
    assert r.status_code == 200
    periods = {a.period.upper for a in Allocation.objects.filter(reservation_id=rid)}
    assert periods == {t0 + timedelta(hours=2)}


def test_extend_into_a_conflict_is_refused_and_nothing_changes(world, t0):
    mine = book(world, "alpha-lead", t0, n=3, hours=2).json()
    # beta takes the last node later, then alpha takes... make every node busy after t0+2h.
    assert book(world, "beta-lead", t0, n=1, hours=6).status_code == 201
    assert book(world, "beta-lead", t0, n=3, hours=2, offset=2).status_code == 201
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{mine['id']}/",
                                         {"end": iso(t0 + timedelta(hours=3))}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "capacity_unavailable"
    after = Reservation.objects.get(pk=mine["id"])
    assert after.period.upper == t0 + timedelta(hours=2)
    assert {a.period.upper for a in after.allocations.all()} == {t0 + timedelta(hours=2)}


def test_move_before_start_repicks_nodes_when_its_own_are_taken(world, t0):
    mine = book(world, "alpha-lead", t0, n=1, hours=2).json()
    taken = book(world, "beta-lead", t0, n=3, hours=2, offset=4).json()
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{mine['id']}/", {
        "start": iso(t0 + timedelta(hours=4)), "end": iso(t0 + timedelta(hours=6))}, format="json")
    assert r.status_code == 200, r.json()
    assert set(r.json()["nodes"]).isdisjoint(taken["nodes"])


def test_cancel_frees_capacity_at_once(world, t0):
    rid = book(world, "alpha-lead", t0, n=3).json()["id"]
    assert book(world, "beta-lead", t0, n=2).status_code == 409
    r = world.client("alpha-lead").post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert book(world, "beta-lead", t0, n=2).status_code == 201


def test_changing_a_cancelled_reservation_is_invalid_state(world, t0):
    rid = book(world, "alpha-lead", t0).json()["id"]
    client = world.client("alpha-lead")
    client.post(f"/api/v1/reservations/{rid}/cancel/")
    r = client.patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=8))}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    r = client.post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    assert Reservation.objects.get(pk=rid).period.upper == t0 + timedelta(hours=4)


def test_an_ending_reservation_keeps_its_window_and_cannot_be_cancelled_after_it(world, t0):
    """Ending (its cluster is being torn down): extending would hold nodes nothing runs on, and cancelling
    after the window would turn a completed booking into a cancelled one; renaming is still fine."""
    rid = book(world, "alpha-lead", t0).json()["id"]
    client = world.client("alpha-lead")
    Reservation.objects.filter(pk=rid).update(status="ending")  # torn down early, window still ahead
    r = client.patch(f"/api/v1/reservations/{rid}/", {"end": iso(t0 + timedelta(hours=8))}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state" and "ending" in r.json()["detail"]
    assert client.patch(f"/api/v1/reservations/{rid}/", {"name": "done early"}, format="json").status_code == 200
    # Past its end, with the teardown running: no cancel after the fact.
    past = (t0 - timedelta(days=3), t0 - timedelta(days=2))
    Reservation.objects.filter(pk=rid).update(period=past)
    r = client.post(f"/api/v1/reservations/{rid}/cancel/")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    reservation = Reservation.objects.get(pk=rid)
    assert reservation.status == "ending" and reservation.allocations.filter(active=True).exists()


def test_member_changes_only_own_reservation(world, t0):
    leads = book(world, "alpha-lead", t0).json()["id"]
    own = book(world, "alpha-member", t0, offset=5).json()["id"]
    member = world.client("alpha-member")
    r = member.post(f"/api/v1/reservations/{leads}/cancel/")
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    assert member.post(f"/api/v1/reservations/{own}/cancel/").status_code == 200
    assert world.client("alpha-lead").post(f"/api/v1/reservations/{leads}/cancel/").status_code == 200


def test_staff_books_for_a_named_tenant(world, t0):
    r = book(world, "staff", t0)
    assert r.status_code == 400 and "tenant" in r.json()["fields"]
    r = book(world, "staff", t0, tenant="beta")
    assert r.status_code == 201 and r.json()["tenant"] == "beta"


def test_maintenance_window_blocks_bookings(world, t0):
    from reservations.services import maintenance_window_create

    for node in world.nodes[:3]:
        maintenance_window_create(actor=world.users["staff"], node=node, start=t0, end=t0 + timedelta(hours=2))
    assert book(world, "alpha-lead", t0, n=2, hours=1).status_code == 409
    r = book(world, "alpha-lead", t0, n=1, hours=1)
    assert r.status_code == 201 and r.json()["nodes"] == [world.nodes[3].hostname]


def test_unavailable_nodes_are_not_given(world, t0):
    for node in world.nodes[1:]:
        r = world.client("staff").patch(f"/api/v1/nodes/{node.pk}/", {"state": "draining"}, format="json")
        assert r.status_code == 200 and r.json()["state"] == "draining"
    assert book(world, "alpha-lead", t0, n=2).status_code == 409
    assert book(world, "alpha-lead", t0, n=1).json()["nodes"] == [world.nodes[0].hostname]


def test_list_filters_and_pagination(world, t0):
    for i in range(3):
        book(world, "alpha-lead", t0, offset=i * 5)
    c = world.client("alpha-lead")
    r = c.get("/api/v1/reservations/", {"page_size": 2})
    assert r.status_code == 200 and r.json()["count"] == 3 and len(r.json()["results"]) == 2
    assert r.json()["next"]
    r = c.get("/api/v1/reservations/", {"start": iso(t0 + timedelta(hours=5)), "end": iso(t0 + timedelta(hours=9))})
    assert [x["start"] for x in r.json()["results"]] == [iso(t0 + timedelta(hours=5))]
    assert c.get("/api/v1/reservations/", {"status": "cancelled"}).json()["count"] == 0
    assert c.get("/api/v1/reservations/", {"pool": "h100"}).json()["count"] == 3


def test_list_uses_a_constant_number_of_queries(world, t0, django_assert_max_num_queries):
    for i in range(6):
        book(world, "alpha-lead", t0, offset=i * 5, n=2)
    c = world.client("alpha-lead")
    with django_assert_max_num_queries(8):
        r = c.get("/api/v1/reservations/")
    assert r.json()["count"] == 6


def test_booking_statements_are_prepared_on_the_connection(world, t0):
    """Server-side binding: the booking path's statements are parsed and planned once per connection."""
    from django.db import connection

    from reservations import services

    for i in range(3):
        assert book(world, "alpha-lead", t0, n=1, hours=1, offset=i).status_code == 201
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements WHERE NOT from_sql")
        prepared = [row[0] for row in cur.fetchall()]
    # The booking statement (its own statements' plans PL/pgSQL keeps per connection too).
    assert any(f"FROM {services.BOOK_FUNCTION}(" in sql for sql in prepared), prepared
    assert any('FROM "tenants_apitoken"' in sql for sql in prepared), prepared  # an ORM-built one too
    # Parameters are bound by the server, not quoted into the text.
    assert all("'alpha'" not in sql for sql in prepared)


def test_prepared_statements_can_be_turned_off_for_old_poolers():
    import subprocess
    import sys

    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'portal.settings.test');"
            "django.setup();"
            "from django.conf import settings; o = settings.DATABASES['default']['OPTIONS'];"
            "print(o['server_side_binding'], o['prepare_threshold'])")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "DB_PREPARE_THRESHOLD": "-1"}).stdout.split()
    assert on == ["True", "2"] and off == ["True", "None"]


def test_booking_reads_the_role_and_pool_size_with_the_tenant_and_pool(world, t0):
    """No separate membership or node-count round trip on the booking path; the statements stay few."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    book(world, "alpha-lead", t0)  # warm: the token's last_used_at touch happens on the first request
    with CaptureQueriesContext(connection) as captured:
        r = book(world, "alpha-lead", t0, offset=4)
    assert r.status_code == 201, r.json()
    statements = [q["sql"].lstrip() for q in captured.captured_queries]
    assert not any(s.startswith('SELECT "tenants_membership"') for s in statements), statements
    assert not any(s.startswith("SELECT COUNT(") for s in statements), statements
    # token, pool (+ size), tenant (+ role), then the booking statement: the quota lock, the role and burst flag
    # again under it with the peak, free nodes, node locks, insert (if the nodes are still available), audit (the
    # tests run events inline, so no outbox row) in one call.
    reads_and_writes = [s[:60] for s in statements if s.split()[0].upper() in ("SELECT", "WITH", "INSERT")]
    assert len(reads_and_writes) == 4, reads_and_writes


def test_role_annotation_answers_only_for_the_user_it_was_read_for(world):
    from tenants.models import Tenant
    from tenants.selectors import role_of

    lead, outsider = world.users["alpha-lead"], world.users["beta-lead"]
    tenant = Tenant.objects.with_role_of(lead).get(slug="alpha")
    assert role_of(user=lead, tenant=tenant) == "lead"
    assert role_of(user=outsider, tenant=tenant) is None  # not the annotated user: asks the database
    as_outsider = Tenant.objects.with_role_of(outsider).get(slug="alpha")
    assert as_outsider.role_of_user is None and role_of(user=outsider, tenant=as_outsider) is None


def test_a_tenant_that_has_booked_keeps_its_slug(world, t0):
    """The backends know a tenant's bookings by its slug (Slurm reservation names and accounts, Kubernetes
    namespaces and taints): once it has booked, a rename would strand them or hand them to a new tenant
    taking the old slug. Its name still changes; a tenant that never booked may still be renamed."""
    from tenants.models import Tenant

    staff = world.client("staff")
    assert book(world, "alpha-lead", t0).status_code == 201
    r = staff.patch("/api/v1/tenants/alpha/", {"slug": "acme"}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state" and "slug" in r.json()["detail"]
    assert Tenant.objects.filter(slug="alpha").exists() and not Tenant.objects.filter(slug="acme").exists()
    assert staff.patch("/api/v1/tenants/alpha/", {"slug": "alpha", "name": "Alpha Team"},
                       format="json").status_code == 200  # the same slug is no change
    assert Tenant.objects.get(slug="alpha").name == "Alpha Team"
    r = staff.patch("/api/v1/tenants/beta/", {"slug": "beta-two"}, format="json")
    assert r.status_code == 200 and r.json()["slug"] == "beta-two"  # beta never booked
