"""Usage statements: GPU-hours per tenant and pool in a UTC month, against a brute-force oracle; the page,
its CSV and the REST endpoint, and who may read which tenant's."""

from __future__ import annotations

import csv
import io
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from portal.core.timefmt import format_utc
from reservations.choices import Billing, ReservationStatus
from reservations.models import Allocation, Node, Pool, Reservation
from reservations.selectors import usage_for_period
from reservations.services import reservation_cancel
from reservations.usage import Month, parse_month

from .conftest import iso, now_clear_of_the_hour

pytestmark = pytest.mark.django_db

NOV = Month(2026, 11)
HOUR = timedelta(hours=1)


def _pool(name="usage", nodes=240, gpus=8, rate="2.5000") -> tuple[Pool, list[Node]]:
    pool = Pool.objects.create(name=name, gpu_model="H100", gpus_per_node=gpus, on_demand_rate=Decimal(rate))
    made = Node.objects.bulk_create([Node(hostname=f"{name}-{i:03d}", pool=pool) for i in range(nodes)])
    return pool, made


def _reservation(tenant, pool, nodes: list[Node], start, end, *, status=ReservationStatus.COMPLETED,
                 billing=Billing.COMMITTED, cancelled_at=None, cut: datetime | None = None,
                 spare: Node | None = None) -> Reservation:
    """A reservation written as the services leave it: allocations active unless cancelled or failed; with
    cut, its first node was swapped at that moment (for spare, or for nothing: degraded)."""
    reservation = Reservation.objects.create(
        tenant=tenant, pool=pool, node_count=len(nodes), period=DateTimeTZRange(start, end, "[)"), status=status,
        billing=billing, burst_part_nodes=len(nodes) if billing == Billing.BURST else 0, cancelled_at=cancelled_at)
    active = status not in (ReservationStatus.CANCELLED, ReservationStatus.FAILED)
    for i, node in enumerate(nodes):
        if cut is not None and i == 0:  # as node_replace_allocations leaves it: cut, released, noted
            Allocation.objects.create(reservation=reservation, node=node, period=DateTimeTZRange(start, cut, "[)"),
                                      active=False, replaced_at=cut, note=f"replaced at {format_utc(cut)}: XID 79")
            continue
        Allocation.objects.create(reservation=reservation, node=node, period=DateTimeTZRange(start, end, "[)"),
                                  active=active)
    if cut is not None and spare is not None:
        Allocation.objects.create(reservation=reservation, node=spare, period=DateTimeTZRange(cut, end, "[)"),
                                  active=active)
    return reservation


def _hours(lo, hi, start, end) -> Decimal:
    lo, hi = max(lo, start), min(hi, end)
    return Decimal(max(0, (hi - lo).total_seconds())) / 3600


def _oracle(specs, start, end, now) -> dict[tuple[str, str], dict[str, Decimal]]:
    out: dict[tuple[str, str], dict[str, Decimal]] = {}
    for spec in specs:
        if spec["status"] == ReservationStatus.FAILED:
            continue
        if spec["status"] == ReservationStatus.CANCELLED:
            if spec["cancelled_at"] <= spec["start"]:
                continue
            spans = [(spec["start"], min(spec["end"], spec["cancelled_at"]))] * spec["nodes"]
        else:
            spans = [(spec["start"], spec["end"])] * spec["nodes"]
            if spec["cut"] is not None:
                spans[0] = (spec["start"], spec["cut"])
                if spec["spare"]:
                    spans.append((spec["cut"], spec["end"]))
        key = (spec["tenant"].slug, spec["pool"].name)
        line = out.setdefault(key, {k: Decimal(0) for k in ("cu", "bu", "ca", "ba")})
        gpus = spec["pool"].gpus_per_node
        burst = spec["billing"] == Billing.BURST
        for lo, hi in spans:
            line["bu" if burst else "cu"] += _hours(lo, hi, start, min(end, now)) * gpus
            line["ba" if burst else "ca"] += _hours(lo, hi, max(start, now), end) * gpus
    return {k: {n: v.quantize(Decimal("0.01")) for n, v in line.items()} for k, line in out.items()
            if any(line.values())}


def test_usage_matches_a_brute_force_oracle(world):
    rng = random.Random(7)
    pools = [_pool("usage-a", gpus=8, rate="2.5000"), _pool("usage-b", gpus=4, rate="0.9000")]
    free = {pool.pk: list(nodes) for pool, nodes in pools}
    tenants = [world.tenants["alpha"], world.tenants["beta"]]
    now = NOV.start + timedelta(days=17, hours=5, minutes=20)
    specs = []
    for _ in range(60):
        pool, _nodes = rng.choice(pools)
        start = NOV.start + timedelta(minutes=30 * rng.randrange(-20 * 48, 40 * 48))
        end = start + timedelta(minutes=30 * rng.randrange(1, 4 * 48))
        status = rng.choice([ReservationStatus.COMPLETED, ReservationStatus.ACTIVE, ReservationStatus.CONFIRMED,
                             ReservationStatus.ENDING, ReservationStatus.CANCELLED, ReservationStatus.FAILED])
        count = rng.randrange(1, 4)
        nodes = [free[pool.pk].pop() for _ in range(count)]
        cancelled_at = start + (end - start) * rng.uniform(-0.5, 1.5) if status == ReservationStatus.CANCELLED else None
        cut = spare = None
        if status != ReservationStatus.CANCELLED and rng.random() < 0.3:
            cut = start + (end - start) * rng.uniform(0.1, 0.9)
            spare = free[pool.pk].pop() if rng.random() < 0.6 else None
        spec = {"tenant": rng.choice(tenants), "pool": pool, "start": start, "end": end, "status": status,
                "billing": rng.choice([Billing.COMMITTED, Billing.BURST]), "nodes": count,
                "cancelled_at": cancelled_at, "cut": cut, "spare": spare is not None}
        _reservation(spec["tenant"], pool, nodes, start, end, status=status, billing=spec["billing"],
                     cancelled_at=cancelled_at, cut=cut, spare=spare)
        specs.append(spec)

    got = {(line.tenant.slug, line.pool.name): {"cu": line.committed_used, "bu": line.burst_used,
                                                "ca": line.committed_ahead, "ba": line.burst_ahead}
           for line in usage_for_period(start=NOV.start, end=NOV.end, tenant_ids=None, now=now)}
    want = _oracle(specs, NOV.start, NOV.end, now)
    assert set(got) == set(want)
    for key, line in want.items():
        for name, value in line.items():
            assert abs(got[key][name] - value) <= Decimal("0.02"), (key, name, got[key][name], value)
    # One tenant only: the same figures for that tenant, nothing of the other's.
    alpha = {(line.tenant.slug, line.pool.name) for line in usage_for_period(
        start=NOV.start, end=NOV.end, tenant_ids=[world.tenants["alpha"].pk], now=now)}
    assert alpha == {key for key in want if key[0] == "alpha"}


def test_the_rules_one_by_one(world):
    pool, nodes = _pool(gpus=8, rate="3.0000")
    alpha = world.tenants["alpha"]
    d = NOV.start + timedelta(days=2)
    _reservation(alpha, pool, nodes[0:2], d, d + 10 * HOUR)  # 2 nodes x 10 h x 8 = 160 committed
    _reservation(alpha, pool, nodes[2:3], d, d + 5 * HOUR, billing=Billing.BURST)  # 40 burst, cost 120
    _reservation(alpha, pool, nodes[3:4], d, d + 5 * HOUR, status=ReservationStatus.FAILED)  # nothing
    _reservation(alpha, pool, nodes[4:5], d, d + 5 * HOUR, status=ReservationStatus.CANCELLED,
                 cancelled_at=d - HOUR)  # cancelled before it began: nothing
    _reservation(alpha, pool, nodes[5:6], d, d + 5 * HOUR, status=ReservationStatus.CANCELLED,
                 cancelled_at=d + 2 * HOUR)  # ran 2 h: 16
    _reservation(alpha, pool, nodes[6:7], NOV.start - 3 * HOUR, NOV.start + 2 * HOUR)  # 2 h inside November: 16
    _reservation(alpha, pool, nodes[7:8], d, d + 4 * HOUR, cut=d + HOUR)  # degraded after 1 h, no spare: 8
    (line,) = usage_for_period(start=NOV.start, end=NOV.end, tenant_ids=[alpha.pk], now=NOV.end + HOUR)
    assert line.committed_used == Decimal("200.00")  # 160 + 16 (cancelled after 2 h) + 16 (from Nov 1) + 8
    assert line.burst_used == Decimal("40.00") and line.burst_cost_used == Decimal("120.00")
    assert line.committed_ahead == line.burst_ahead == Decimal("0.00")


def test_a_node_swapped_by_the_service_counts_up_to_the_swap(world):
    """The rules above hold for a swap as node_replace_allocations leaves it: the failed node's allocation
    cut at the swap and released (inactive), the spare's from there; the hours the failed node served count
    (they were not counted at all), and a booking moved whole before its start counts once."""
    from reservations.services import node_replace_allocations

    pool, nodes = _pool(name="usage-swap", nodes=6, gpus=8)
    alpha = world.tenants["alpha"]
    # The running booking lies inside this month, and the one ahead in the next: in a month's last hours a
    # six-hour booking ran into the next month (and into the booking ahead: an exclusion violation).
    now = now_clear_of_the_hour()
    month = Month(now.year, now.month)
    start = max(month.start, now - 3 * HOUR).replace(microsecond=0)
    end = min(start + 6 * HOUR, month.end)
    running = Reservation.objects.create(tenant=alpha, pool=pool, node_count=1, period=DateTimeTZRange(start, end),
                                         status=ReservationStatus.ACTIVE)
    Allocation.objects.create(reservation=running, node=nodes[0], period=DateTimeTZRange(start, end))
    later = month.end + 2 * HOUR  # next month: counted in neither line below
    ahead = Reservation.objects.create(tenant=alpha, pool=pool, node_count=1,
                                       period=DateTimeTZRange(later, later + HOUR), status=ReservationStatus.CONFIRMED)
    Allocation.objects.create(reservation=ahead, node=nodes[0], period=DateTimeTZRange(later, later + HOUR))
    Node.objects.filter(pk=nodes[0].pk).update(state="failed")
    outcomes = node_replace_allocations(node=Node.objects.get(pk=nodes[0].pk), reason="XID 79")
    assert sorted(o["result"] for o in outcomes) == ["replaced", "replaced"]
    cut = Allocation.objects.get(reservation=running, node=nodes[0]).period.upper

    (line,) = usage_for_period(start=month.start, end=month.end, tenant_ids=[alpha.pk], now=cut)
    assert line.committed_used == (Decimal((cut - start).total_seconds()) / 3600 * 8).quantize(Decimal("0.01"))
    assert line.committed_ahead == (Decimal((end - cut).total_seconds()) / 3600 * 8).quantize(Decimal("0.01"))
    (line,) = usage_for_period(start=month.end, end=month.next.end, tenant_ids=[alpha.pk], now=cut)
    assert line.committed_ahead == Decimal("8.00")  # the booking moved whole: its hour once, on the spare


def test_cancelling_records_when(world, t0):
    from reservations.services import reservation_create

    reservation = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                     node_count=1, start=t0, end=t0 + HOUR)
    assert reservation.cancelled_at is None
    before = timezone.now()
    reservation = reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)
    reservation.refresh_from_db()
    assert before <= reservation.cancelled_at <= timezone.now()


def test_parse_month():
    assert parse_month("2026-11") == NOV and NOV.start == datetime(2026, 11, 1, tzinfo=UTC)
    assert NOV.end == datetime(2026, 12, 1, tzinfo=UTC) and str(Month(2026, 12).next) == "2027-01"
    assert str(Month(2027, 1).previous) == "2026-12"
    for bad in ("2026-13", "2026-00", "26-11", "2026-1", "x", "1999-12", "2026-11-01"):
        with pytest.raises(Exception) as info:
            parse_month(bad)
        assert getattr(info.value, "fields", {}).get("month"), bad


def _november(world):
    pool, nodes = _pool(gpus=8, rate="2.0000")
    d = NOV.start + timedelta(days=3)
    _reservation(world.tenants["alpha"], pool, nodes[0:1], d, d + 10 * HOUR, billing=Billing.BURST)  # 80 burst
    _reservation(world.tenants["beta"], pool, nodes[1:3], d, d + 10 * HOUR)  # 160 committed
    return pool


def test_the_page_for_a_lead_shows_their_tenant_only(web, world):
    _november(world)
    response = web("alpha-lead").get("/usage/?month=2026-11")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-usage="alpha/usage"' in page and 'data-usage="beta/usage"' not in page
    assert "80.00" in page and "160.00" in page and "Beta" not in page.split("<main", 1)[1]
    assert 'href="?month=2026-10"' in page and 'href="?month=2026-12"' in page


@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer"])
def test_members_and_viewers_are_refused(web, world, who):
    _november(world)
    assert web(who).get("/usage/?month=2026-11").status_code == 403
    assert web(who).get("/usage.csv?month=2026-11").status_code == 403
    assert world.client(who).get("/api/v1/usage/?month=2026-11").status_code == 403
    assert "/usage/" not in web(who).get("/").content.decode()  # not in their navigation


def test_staff_see_every_tenant_or_one(web, world):
    _november(world)
    staff = web("staff")
    page = staff.get("/usage/?month=2026-11").content.decode()
    assert 'data-usage="alpha/usage"' in page and 'data-usage="beta/usage"' in page
    page = staff.get("/usage/?month=2026-11&tenant=beta").content.decode()
    assert 'data-usage="alpha/usage"' not in page and 'data-usage="beta/usage"' in page
    assert "No GPU-hours" in staff.get("/usage/?month=2026-11&tenant=no-such").content.decode()


def test_a_bad_month_is_a_400_page(web, world):
    response = web("alpha-lead").get("/usage/?month=2026-13")
    assert response.status_code == 400 and "YYYY-MM" in response.content.decode()
    assert web("alpha-lead").get("/usage.csv?month=nope").status_code == 400


def test_csv(web, world):
    _november(world)
    response = web("staff").get("/usage.csv?month=2026-11")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert 'filename="gpu-usage-2026-11.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["tenant"], r["burst_gpu_hours"], r["burst_cost"], r["committed_gpu_hours"]) for r in rows] == [
        ("alpha", "80.00", "160.00", "0.00"), ("beta", "0.00", "0.00", "160.00")]
    lead_rows = list(csv.DictReader(io.StringIO(web("beta-lead").get("/usage.csv?month=2026-11").content.decode())))
    assert [r["tenant"] for r in lead_rows] == ["beta"]


def test_the_api(world):
    _november(world)
    body = world.client("alpha-lead").get("/api/v1/usage/?month=2026-11").json()
    assert body["month"] == "2026-11" and body["start"] == "2026-11-01T00:00:00Z" and body["end"] == iso(NOV.end)
    assert [(r["tenant"], r["pool"], r["burst_gpu_hours"], r["burst_cost"]) for r in body["results"]] == [
        ("alpha", "usage", "80.00", "160.00")]
    # A tenant the lead does not lead is unknown to them; staff may name any.
    r = world.client("alpha-lead").get("/api/v1/usage/?month=2026-11&tenant=beta")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and "tenant" in r.json()["fields"]
    body = world.client("staff").get("/api/v1/usage/?month=2026-11&tenant=beta").json()
    assert [r["tenant"] for r in body["results"]] == ["beta"]
    assert len(world.client("staff").get("/api/v1/usage/?month=2026-11").json()["results"]) == 2
    r = world.client("alpha-lead").get("/api/v1/usage/?month=2026-1")
    assert r.status_code == 400 and "month" in r.json()["fields"]
    r = world.client("alpha-lead").get("/api/v1/usage/?month=2026-13")
    assert r.status_code == 400 and "month" in r.json()["fields"]


def test_a_bad_month_says_so_in_a_plain_sentence(web, world):
    """The usage page and its CSV showed the API's message with its field-name prefix ("month: a calendar
    month as YYYY-MM…"); a reader gets a plain sentence."""
    import re

    response = web("alpha-lead").get("/usage/?month=2026-13")
    page = response.content.decode()
    alert = re.search(r'<p class="error" role="alert">(.*?)</p>', page, re.S).group(1).strip()
    assert response.status_code == 400 and not alert.startswith("month:"), alert
    assert alert[0].isupper() and alert.endswith(".") and "YYYY-MM" in alert and "2026-11" in alert, alert
    csv_text = web("alpha-lead").get("/usage.csv?month=nope").content.decode().strip()
    assert csv_text == alert, csv_text


def test_a_booking_whose_teardown_failed_still_counts_what_it_held(world):
    """A booking that ran its window and whose cluster's teardown then failed (ending → failed, its
    allocations released at that moment) counted nothing — nor once staff retried the teardown and it
    completed: the tenant's whole run vanished from the statement. It counts what it held, up to the
    release; one failed while provisioning (it never ran) still counts nothing."""
    from reservations.services import reservation_set_status

    pool, nodes = _pool(name="usage-teardown", nodes=4, gpus=8, rate="2.0000")
    alpha = world.tenants["alpha"]
    now = timezone.now().replace(microsecond=0)
    start, end = now - 5 * HOUR, now - HOUR
    ran = _reservation(alpha, pool, nodes[0:2], start, end, status=ReservationStatus.ENDING,
                       billing=Billing.BURST)
    never = _reservation(alpha, pool, nodes[2:3], start, end, status=ReservationStatus.PROVISIONING)
    assert reservation_set_status(reservation_id=ran.pk, status=ReservationStatus.FAILED,
                                  expected=(ReservationStatus.ENDING,), reason="cluster failed: tearing_down")
    assert reservation_set_status(reservation_id=never.pk, status=ReservationStatus.FAILED,
                                  expected=(ReservationStatus.PROVISIONING,), reason="cluster failed: pending")
    month_start, month_end = start - timedelta(days=40), end + timedelta(days=40)

    def burst_and_committed():
        lines = usage_for_period(start=month_start, end=month_end, tenant_ids=[alpha.pk], now=timezone.now())
        return [(line.burst_used, line.burst_cost_used, line.committed_used) for line in lines]

    assert burst_and_committed() == [(Decimal("64.00"), Decimal("128.00"), Decimal("0.00"))]  # 2 x 4 h x 8
    # Staff retry the teardown; it succeeds and the booking completes: still its hours, once.
    assert reservation_set_status(reservation_id=ran.pk, status=ReservationStatus.COMPLETED,
                                  expected=(ReservationStatus.FAILED,), reason="teardown retried by staff")
    assert burst_and_committed() == [(Decimal("64.00"), Decimal("128.00"), Decimal("0.00"))]


def test_a_degraded_booking_cancelled_later_counts_only_the_nodes_it_held(world):
    """A running booking lost a node with no spare (degraded: the node's allocation cut and released at the
    swap), then was cancelled: the statement counted node_count nodes up to the cancel, billing the hours
    it went without the node. It counts each node it held for as long as it held it."""
    pool, nodes = _pool(name="usage-degraded", nodes=4, gpus=8, rate="1.0000")
    alpha = world.tenants["alpha"]
    d = NOV.start + timedelta(days=5)
    _reservation(alpha, pool, nodes[0:2], d, d + 10 * HOUR, status=ReservationStatus.CANCELLED,
                 cancelled_at=d + 6 * HOUR, cut=d + 2 * HOUR, billing=Billing.BURST)
    # and one whose node was swapped for a spare, then cancelled: still one node's hours at a time
    _reservation(alpha, pool, nodes[2:3], d, d + 10 * HOUR, status=ReservationStatus.CANCELLED,
                 cancelled_at=d + 6 * HOUR, cut=d + 2 * HOUR, spare=nodes[3])
    (line,) = usage_for_period(start=NOV.start, end=NOV.end, tenant_ids=[alpha.pk], now=NOV.end)
    assert line.burst_used == Decimal("64.00")  # (2 h + 6 h) x 8, not 2 x 6 h x 8 = 96
    assert line.burst_cost_used == Decimal("64.00")
    assert line.committed_used == Decimal("48.00")  # 2 h on the failed node + 4 h on the spare, x 8


def test_a_burst_booking_is_billed_for_its_nodes_above_the_guarantee_as_the_preview_said(world, t0):
    """The booking preview prices a burst booking's nodes above the guarantee ("Burst — 1 node above the
    guarantee", cost = that node's GPU-hours × the rate), but the statement billed every node of the booking
    at the on-demand rate: booking 2 nodes with 1 over the guarantee was charged twice what was shown."""
    from reservations.selectors import booking_preview
    from reservations.services import reservation_create

    alpha, lead, pool = world.tenants["alpha"], world.users["alpha-lead"], world.pool  # 3 guaranteed + 1 burst
    reservation_create(actor=lead, tenant=alpha, pool=pool, node_count=2, start=t0, end=t0 + 4 * HOUR)
    preview = booking_preview(tenant=alpha, pool=pool, node_count=2, start=t0, end=t0 + 4 * HOUR)
    assert preview.billing == Billing.BURST and preview.burst_part_nodes == 1
    assert preview.burst_gpu_hours == Decimal("32.00") and preview.burst_cost == Decimal("80.00")
    booked = reservation_create(actor=lead, tenant=alpha, pool=pool, node_count=2, start=t0, end=t0 + 4 * HOUR)
    assert booked.billing == Billing.BURST

    (line,) = usage_for_period(start=t0 - HOUR, end=t0 + 5 * HOUR, tenant_ids=[alpha.pk], now=t0 + 5 * HOUR)
    assert (line.burst_used, line.burst_cost_used) == (preview.burst_gpu_hours, preview.burst_cost)
    assert line.committed_used == Decimal("96.00")  # 3 nodes within the guarantee x 4 h x 8


def test_a_running_booking_extended_then_shortened_counts_the_window_it_holds(world):
    """Through the services on a running booking: an extension and a later shortening move what is booked
    ahead; what was used up to now does not change, and the statement follows the allocations."""
    from reservations.services import reservation_update
    from reservations.timeutil import slot_floor

    alpha, lead, pool = world.tenants["alpha"], world.users["alpha-lead"], world.pool
    now = now_clear_of_the_hour()  # the shortening below ends it at the next hour: refused once that has begun
    start = slot_floor(now, 60) - 2 * HOUR
    running = _reservation(alpha, pool, list(pool.nodes.order_by("pk")[:1]), start, start + 4 * HOUR,
                           status=ReservationStatus.ACTIVE)
    lo, hi = start - HOUR, start + 10 * HOUR

    def used_and_ahead(at):
        (line,) = usage_for_period(start=lo, end=hi, tenant_ids=[alpha.pk], now=at)
        return line.committed_used + line.burst_used, line.committed_ahead + line.burst_ahead

    at = timezone.now()
    used = (Decimal((at - start).total_seconds()) / 3600 * 8).quantize(Decimal("0.01"))
    reservation_update(actor=lead, reservation=running, end=start + 6 * HOUR)
    assert used_and_ahead(at) == (used, Decimal("48.00") - used)  # 6 h x 8 in all
    reservation_update(actor=lead, reservation=running, end=start + 3 * HOUR)
    assert used_and_ahead(at) == (used, Decimal("24.00") - used)
    assert Allocation.objects.get(reservation=running).period.upper == start + 3 * HOUR


def test_the_statement_takes_the_same_queries_for_one_line_as_for_many(web, world):
    """No per-line or per-booking query: the page, its CSV and the API read a month of many bookings in many
    pools with as many statements as one booking."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def counts():
        out = []
        for get in (lambda: web("staff").get("/usage/?month=2026-11"),
                    lambda: web("staff").get("/usage.csv?month=2026-11"),
                    lambda: world.client("staff").get("/api/v1/usage/?month=2026-11")):
            get()  # warm: sessions, the signed-in user
            with CaptureQueriesContext(connection) as ctx:
                assert get().status_code == 200
            out.append(len(ctx.captured_queries))
        return out

    pool, nodes = _pool(name="usage-q0", nodes=2)
    _reservation(world.tenants["alpha"], pool, nodes[:1], NOV.start, NOV.start + HOUR)
    one = counts()
    for p in range(1, 6):
        pool, nodes = _pool(name=f"usage-q{p}", nodes=30)
        for i, node in enumerate(nodes):
            tenant = world.tenants["alpha" if i % 2 else "beta"]
            start = NOV.start + timedelta(hours=5 * i)
            _reservation(tenant, pool, [node], start, start + 4 * HOUR,
                         billing=Billing.BURST if i % 3 == 0 else Billing.COMMITTED)
    assert counts() == one


def test_a_rate_or_gpu_count_changed_later_does_not_change_a_past_statement(web, world):
    """Burst hours were priced at the pool's on-demand rate when the statement was read, and GPU-hours counted
    with the pool's GPUs per node then: a rate raised in December re-priced November's issued statement (page,
    CSV and API alike). A booking keeps the rate and GPUs per node it was booked at; one booked after the change
    is billed at the new rate, on a line of its own."""
    from reservations.services import pool_update

    pool = _november(world)  # alpha: 10 h x 1 node x 8 GPUs burst at 2.00; beta: 160 committed

    def statement():
        page = web("staff").get("/usage/?month=2026-11").content.decode()
        rows = list(csv.DictReader(io.StringIO(web("staff").get("/usage.csv?month=2026-11").content.decode())))
        api = world.client("staff").get("/api/v1/usage/?month=2026-11").json()["results"]
        return page.split("<main", 1)[1], rows, api

    before = statement()
    assert [(r["tenant"], r["gpus_per_node"], r["on_demand_rate"], r["burst_gpu_hours"], r["burst_cost"],
             r["committed_gpu_hours"]) for r in before[1]] == [
        ("alpha", "8", "2.0000", "80.00", "160.00", "0.00"), ("beta", "8", "2.0000", "0.00", "0.00", "160.00")]
    pool_update(actor=world.users["staff"], pool=pool, on_demand_rate=Decimal("9.0000"), gpus_per_node=4)
    assert statement() == before

    d = NOV.start + timedelta(days=20)  # booked at the new numbers: 2 h x 1 node x 4 GPUs at 9.00
    _reservation(world.tenants["alpha"], pool, [pool.nodes.order_by("pk")[5]], d, d + 2 * HOUR,
                 billing=Billing.BURST)
    lines = usage_for_period(start=NOV.start, end=NOV.end, tenant_ids=[world.tenants["alpha"].pk], now=NOV.end)
    assert [(line.gpus_per_node, line.rate, line.burst_used, line.burst_cost_used) for line in lines] == [
        (8, Decimal("2.0000"), Decimal("80.00"), Decimal("160.00")),
        (4, Decimal("9.0000"), Decimal("8.00"), Decimal("72.00"))]


def test_an_extension_after_a_rate_change_keeps_the_rate_booked(world, t0):
    """The booking was priced when made; extending it after the pool's rate changed bills all its hours at
    the rate it was booked at (docs/architecture.md, Usage statements)."""
    from reservations.services import pool_update, reservation_create, reservation_update

    alpha, lead, pool = world.tenants["alpha"], world.users["alpha-lead"], world.pool
    pool.refresh_from_db()
    booked = reservation_create(actor=lead, tenant=alpha, pool=pool, node_count=1, start=t0, end=t0 + 2 * HOUR)
    assert (booked.on_demand_rate, booked.gpus_per_node) == (pool.on_demand_rate, pool.gpus_per_node)
    pool_update(actor=world.users["staff"], pool=pool, on_demand_rate=pool.on_demand_rate + 7, gpus_per_node=2)
    reservation_update(actor=lead, reservation=booked, end=t0 + 4 * HOUR)
    (line,) = usage_for_period(start=t0, end=t0 + 5 * HOUR, tenant_ids=[alpha.pk], now=t0)
    assert (line.gpus_per_node, line.rate) == (booked.gpus_per_node, booked.on_demand_rate)
    assert line.committed_ahead == 4 * booked.gpus_per_node
