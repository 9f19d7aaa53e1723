"""Pages, API lists and admin lists: query counts that do not grow with the data; list orders read from an index."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from reservations.models import Node
from tests.conftest import make_world
from tests.query_world import grow

pytestmark = pytest.mark.django_db


def _client(world, who: str, *, superuser: bool = False) -> Client:
    user = world.users[who]
    if superuser:
        user.is_superuser = True
        user.save()
    client = Client()
    client.force_login(user)
    return client


def _count(client, url: str) -> int:
    client.get(url)  # warm the session and per-process caches
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return len(ctx.captured_queries)


# --- 1. N+1 on the cluster admin changelist ---------------------------------------------------------


def test_cluster_admin_changelist_runs_the_same_queries_for_3_and_30_clusters():
    world = make_world()
    client = _client(world, "staff", superuser=True)
    grow(world, 3)
    small = _count(client, "/admin/provisioning/virtualcluster/")
    grow(world, 27)
    big = _count(client, "/admin/provisioning/virtualcluster/")
    assert big == small, f"{small} queries for 3 clusters, {big} for 30 (Reservation.__str__ loads tenant and pool)"


def test_pool_admin_changelist_runs_the_same_queries_for_2_and_12_pools():
    from reservations.models import Pool

    world = make_world()
    client = _client(world, "staff")

    def pools(names):
        for name in names:
            pool = Pool.objects.create(name=name, gpu_model="A100", gpus_per_node=8)
            Node.objects.bulk_create([Node(hostname=f"{name}-{i}", pool=pool) for i in range(3)])

    pools(["p1"])
    small = _count(client, "/admin/reservations/pool/")
    pools([f"p{i}" for i in range(2, 12)])
    big = _count(client, "/admin/reservations/pool/")
    assert big == small, f"{small} queries for 2 pools, {big} for 12 (a COUNT of nodes per pool row)"
    assert "<td class=\"field-node_total\">3</td>" in client.get("/admin/reservations/pool/").content.decode()


# --- 2. N+1 on the dashboard's cluster badges ------------------------------------------------------


def test_dashboard_runs_the_same_queries_for_3_and_20_upcoming_reservations():
    world = make_world()
    client = _client(world, "alpha-lead")
    grow(world, 3)
    small = _count(client, "/")
    grow(world, 17)
    big = _count(client, "/")
    assert big == small, f"{small} queries with 3 upcoming reservations, {big} with 20 (one per cluster badge)"


# --- 3-5. list orderings with no index: a sort of the whole table on every page ----------------------


def _plan(client, url: str, table: str) -> str:
    """EXPLAIN (seq scans and sorts priced out) of the page query the URL runs on table."""
    client.get(url)
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    sql = next(q["sql"] for q in ctx.captured_queries
               if q["sql"].startswith("SELECT") and f'FROM "{table}"' in q["sql"]
               and re.search(r"ORDER BY [^()]*(LIMIT \d+)?$", q["sql"]) and "COUNT(" not in q["sql"])
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("SET LOCAL enable_sort = off")
        cur.execute("EXPLAIN " + sql)
        return "\n".join(r[0] for r in cur.fetchall())


@pytest.mark.parametrize("url,table", [
    ("/api/v1/health-checks/", "health_healthcheck"),
    ("/admin/health/healthcheck/", "health_healthcheck"),
    ("/api/v1/reservations/", "reservations_reservation"),
    ("/admin/reservations/reservation/", "reservations_reservation"),
    ("/api/v1/clusters/", "provisioning_virtualcluster"),
    ("/clusters/", "provisioning_virtualcluster"),
])
def test_staff_lists_read_their_order_from_an_index(url, table):
    world = make_world()
    grow(world, 5)
    client = _client(world, "staff", superuser=True)
    plan = _plan(client, url, table)
    assert "Sort" not in plan and f"Seq Scan on {table}" not in plan, (
        f"{url} sorts all of {table} for one page:\n{plan}")


# --- 6. the fleet timeline renders every node ------------------------------------------------------


def test_fleet_timeline_shows_a_bounded_page_of_nodes():
    world = make_world()
    Node.objects.bulk_create([Node(hostname=f"bulk-{i:04d}", pool=world.pool) for i in range(150)])
    client = _client(world, "staff")
    body = client.get("/fleet/").content.decode()
    shown = body.count('data-node="')
    assert shown <= 100, f"/fleet/ rendered {shown} node rows in one response"
    seen = set(re.findall(r'data-node="([^"]+)"', body))
    page = 2
    while len(seen) < 154 and page < 10:
        seen |= set(re.findall(r'data-node="([^"]+)"', client.get(f"/fleet/?page={page}").content.decode()))
        page += 1
    assert len(seen) == 154  # every node is still reachable


# --- 7. a duplicate index on the biggest table -----------------------------------------------------


def test_allocation_table_has_no_duplicate_indexes():
    with connection.cursor() as cur:
        cur.execute("""SELECT regexp_replace(indexdef, 'INDEX \\S+ ON', 'INDEX ON'), array_agg(indexname)
                       FROM pg_indexes WHERE tablename = 'reservations_allocation' GROUP BY 1 HAVING count(*) > 1""")
        dupes = cur.fetchall()
    assert dupes == [], dupes


# --- 8. the cluster list loads what it does not show ----------------------------------------------


def test_cluster_list_page_loads_no_transitions_credentials_or_nodes():
    world = make_world()
    grow(world, 5)
    client = _client(world, "alpha-lead")
    client.get("/clusters/")
    with CaptureQueriesContext(connection) as ctx:
        client.get("/clusters/")
    unused = [q["sql"][:120] for q in ctx.captured_queries
              if re.search(r'FROM "(provisioning_clustertransition|provisioning_clustercredential'
                           r'|reservations_allocation)"', q["sql"])]
    assert unused == []


# --- 9. the dashboard's quota card: two queries per pool the tenant has a quota in ------------------


def test_dashboard_quota_usage_is_not_two_queries_per_pool():
    from reservations.models import Pool
    from tenants.models import Quota

    world = make_world()
    client = _client(world, "alpha-lead")
    small = _count(client, "/")
    for i in range(8):
        pool = Pool.objects.create(name=f"extra-{i}", gpu_model="L40S", gpus_per_node=4)
        Quota.objects.create(tenant=world.tenants["alpha"], pool=pool, max_nodes=1)
    big = _count(client, "/")
    assert big == small, f"{small} queries with 1 quota, {big} with 9 (tenant_peak_usage twice per quota)"


def test_the_one_statement_peaks_agree_with_tenant_peak_usage_per_pool():
    from datetime import timedelta

    from django.utils import timezone

    from reservations import selectors

    world = make_world()
    grow(world, 6)
    tenant = world.tenants["alpha"]
    now = timezone.now()
    for end in (now + timedelta(seconds=1), now + timedelta(days=14)):
        got = selectors.tenant_peak_usage_by_pool(tenant_id=tenant.pk, start=now, end=end)
        want = selectors.tenant_peak_usage(tenant_id=tenant.pk, pool_id=world.pool.pk, start=now, end=end)
        assert got.get(world.pool.pk, 0) == want == 6


# --- the tenant page's member and quota rows ----------------------------------------------------------


def test_tenant_admin_page_runs_the_same_queries_for_3_and_13_members_and_quotas():
    from django.contrib.auth import get_user_model

    from reservations.models import Pool
    from tenants.models import Membership, Quota

    world = make_world()
    client = _client(world, "staff")
    tenant = world.tenants["alpha"]
    url = f"/admin/tenants/tenant/{tenant.pk}/change/"

    def more(names):
        for name in names:
            user = get_user_model().objects.create_user(f"user-{name}")
            Membership.objects.create(tenant=tenant, user=user, role="member")
            pool = Pool.objects.create(name=name, gpu_model="A100", gpus_per_node=8)
            Quota.objects.create(tenant=tenant, pool=pool, max_nodes=1)

    small = _count(client, url)
    more([f"p{i}" for i in range(10)])
    big = _count(client, url)
    assert big == small, f"{small} queries for 3 members and 1 quota, {big} for 13 and 11 (per inline row)"
    page = client.get(url).content.decode()
    assert "user-p9" in page and ">p9</option>" in page  # the rows still name their user and list the pools


# --- a quota's history page ----------------------------------------------------------------------------


def test_quota_history_page_runs_the_same_queries_for_3_and_13_versions():
    from tenants import services
    from tenants.models import Quota

    world = make_world()
    client = _client(world, "staff")
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    url = f"/admin/tenants/quota/{quota.pk}/history/"

    def edits(n):
        for _ in range(n):
            quota.refresh_from_db()
            services.quota_update(actor=world.users["staff"], quota=quota, max_nodes=quota.max_nodes + 1)

    edits(2)
    small = _count(client, url)
    edits(10)
    big = _count(client, url)
    assert big == small, f"{small} queries for 3 versions, {big} for 13 (each row's name loads its tenant and pool)"
    page = client.get(url).content.decode()
    assert page.count("alpha/h100: ") >= 13  # each version is still named by its tenant and pool, with its numbers
    assert "alpha/h100: 15+1" in page and "alpha/h100: 3+1" in page


# --- usage: the period's allocations read off an index, not a scan of the whole booking history ------------


def test_usage_reads_the_periods_allocations_from_an_index():
    from datetime import timedelta

    from django.utils import timezone

    from reservations.selectors import USAGE_SQL

    world = make_world()
    grow(world, 5)
    now = timezone.now()
    with connection.cursor() as cur:
        # A history of released allocations long before the month (what the statement must not read), and
        # statistics that say so: the plan then follows the data, not whether autovacuum has analysed yet.
        cur.execute(
            "INSERT INTO reservations_allocation (reservation_id, node_id, period, kind, active, note, created_at)"
            " SELECT a.reservation_id, a.node_id, tstzrange(%(t)s + g * interval '2 hours',"
            " %(t)s + g * interval '2 hours' + interval '1 hour'), 'reservation', false, '', now()"
            " FROM reservations_allocation a, generate_series(1, 1000) g WHERE a.active",
            {"t": now - timedelta(days=400)})
        cur.execute("ANALYZE reservations_allocation")
        cur.execute("ANALYZE reservations_reservation")
    params = {"start": now - timedelta(days=30), "end": now + timedelta(days=1), "now": now, "tenants": None}
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN " + USAGE_SQL, params)
        plan = "\n".join(r[0] for r in cur.fetchall())
    # The staff usage report, its CSV, the usage API and /metrics run this statement: a scan of the
    # allocations with no condition on their period reads every allocation ever booked to sum one month.
    lines = plan.splitlines()
    scans = [i for i, line in enumerate(lines) if re.search(r"Scan .*on reservations_allocation a\b", line)]
    assert scans, plan
    for i in scans:
        assert re.search(r"(Index|Recheck) Cond: .*period && ", lines[i + 1]), plan


# --- the admin's date hierarchy: no DISTINCT over a whole history table on every visit ------------------------


@pytest.mark.parametrize("url,table", [
    ("/admin/core/auditlog/", "core_auditlog"),
    ("/admin/notifications/delivery/", "notifications_delivery"),
    ("/admin/health/healthcheck/", "health_healthcheck"),
])
def test_admin_date_hierarchy_probes_periods_instead_of_reading_every_row(url, table):
    from datetime import timedelta

    from django.utils import timezone

    world = make_world()
    grow(world, 4)
    client = _client(world, "staff", superuser=True)
    now = timezone.now()
    # Rows over three years, one of them two months apart: each level lists what has rows.
    shifts = {0: timedelta(0), 1: timedelta(days=400), 2: timedelta(days=800), 3: timedelta(days=860)}
    with connection.cursor() as cur:
        cur.execute(f"SELECT id FROM {table} ORDER BY id")  # noqa: S608 — a test's constant table name
        for i, (pk,) in enumerate(cur.fetchall()):
            cur.execute(f"UPDATE {table} SET created_at = %s WHERE id = %s", [now - shifts[i % 4], pk])  # noqa: S608
    client.get(url)
    with CaptureQueriesContext(connection) as ctx:
        body = client.get(url).content.decode()
    full = [q["sql"][:160] for q in ctx.captured_queries if "DISTINCT DATE_TRUNC" in q["sql"]]
    assert full == [], f"{url} reads every row of {table} for its date hierarchy: {full}"
    years = sorted({(now - s).astimezone(timezone.get_current_timezone()).year for s in shifts.values()})
    for year in years:
        assert f"created_at__year={year}" in body, (year, url)
    old = (now - timedelta(days=800)).astimezone(timezone.get_current_timezone())
    body = client.get(f"{url}?created_at__year={old.year}").content.decode()
    months = {(now - s).astimezone(timezone.get_current_timezone()) for s in shifts.values()}
    want = sorted({m.month for m in months if m.year == old.year})
    links = re.findall(r'href="\?([^"]*created_at__month=[^"]*)"', body)
    got = sorted({int(re.search(r"created_at__month=(\d+)", link).group(1)) for link in links})
    assert want and got == want, (got, want)


# --- the admin's "all values" list filters: no DISTINCT over a whole history table -------------------------------


@pytest.mark.parametrize("url,table,column,values", [
    ("/admin/core/auditlog/", "core_auditlog", "action", ["reservation.created", "reservation.zz-test"]),
    ("/admin/core/auditlog/", "core_auditlog", "object_type", ["reservations.reservation", "zz.test"]),
    ("/admin/notifications/delivery/", "notifications_delivery", "event", ["reservation.created", "zz.test"]),
])
def test_admin_value_filters_walk_the_index_instead_of_reading_every_row(url, table, column, values):
    world = make_world()
    grow(world, 4)
    client = _client(world, "staff", superuser=True)
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {table} SET {column} = %s WHERE id = (SELECT max(id) FROM {table})",  # noqa: S608
                    [values[-1]])
    client.get(url)
    with CaptureQueriesContext(connection) as ctx:
        body = client.get(url).content.decode()
    full = [q["sql"][:160] for q in ctx.captured_queries
            if re.search(rf'SELECT DISTINCT "{table}"."{column}"', q["sql"])]
    assert full == [], f"{url} reads every row of {table} to list its {column} filter: {full}"
    with connection.cursor() as cur:
        cur.execute(f"SELECT DISTINCT {column} FROM {table} ORDER BY 1")  # noqa: S608 — the oracle, in the test
        present = [row[0] for row in cur.fetchall()]
    assert set(values) <= set(present)
    choices = re.findall(rf'href="\?{column}=([^"&]+)"', body)
    assert choices == present, (choices, url)  # every value present is still a choice, in order, and only those


# --- a status filter on the reservation lists: the page comes off an index on (status, period) ------------------


@pytest.mark.parametrize("url", [
    "/api/v1/reservations/?status=active",
    "/admin/reservations/reservation/?status__exact=active",
])
def test_reservation_lists_filtered_by_status_read_the_status_from_an_index(url):
    world = make_world()
    grow(world, 5)
    client = _client(world, "staff", superuser=True)
    plan = _plan(client, url, "reservations_reservation")
    # With the order's index alone, a page of active bookings walks past every completed one before them:
    # the whole history, on every request.
    assert "Sort" not in plan and "Seq Scan on reservations_reservation" not in plan, plan
    assert re.search(r"Index Cond: .*status\)?::text = 'active'", plan), plan


# --- /metrics: each node's latest verdict read off an index, not a sort of every check ever run -----------------


def test_metrics_node_health_reads_each_nodes_latest_check_from_an_index():
    world = make_world()
    grow(world, 5)
    client = _client(world, "staff", superuser=True)
    client.get("/metrics")
    with CaptureQueriesContext(connection) as ctx:
        assert client.get("/metrics").status_code == 200
    sql = next(q["sql"] for q in ctx.captured_queries if "latest" in q["sql"] and "health_healthcheck" in q["sql"])
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN " + sql)
        plan = "\n".join(r[0] for r in cur.fetchall())
    # Prometheus scrapes this every few seconds: a DISTINCT ON over the whole check history each time.
    lines = plan.splitlines()
    scans = [i for i, line in enumerate(lines) if re.search(r"Scan .*on health_healthcheck\b", line)]
    assert scans, plan
    for i in scans:
        assert re.search(r"Index Cond: .*node_id = ", lines[i + 1]), plan


# --- the calendar's side panel: its poll reads what its digests need, and nothing for a timeline it does not show ---


def _tables(ctx) -> list[str]:
    return [re.search(r'FROM "(\w+)"', q["sql"]).group(1) for q in ctx.captured_queries]


def test_the_panels_poll_reads_only_what_its_digests_need(t0):
    """An open side panel polls every 3 s (per user, per panel): each poll ran the reservation page's whole context,
    the booking's audit trail included (6 queries), for a 204 most of the time, and for a panel that shows no
    timeline. Nothing changed now reads the session, the user, their memberships, the booking (its cluster in the
    same query) and its held nodes; the panel and a poll that answers never read the audit log."""
    import html

    from reservations import services
    from reservations.models import Reservation

    world = make_world()
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=2, start=t0, end=t0 + timedelta(hours=2), name="watched")
    client = _client(world, "alpha-lead")
    htmx = {"HTTP_HX_REQUEST": "true"}
    client.get(f"/reservations/{r.pk}/panel/", **htmx)
    with CaptureQueriesContext(connection) as panel:
        body = client.get(f"/reservations/{r.pk}/panel/", **htmx).content.decode()
    url = html.unescape(re.search(rf'<div id="panel-live-{r.pk}"[^>]*hx-get="([^"]*)"', body).group(1))
    with CaptureQueriesContext(connection) as same:
        assert client.get(url, **htmx).status_code == 204
    assert _tables(same) == ["django_session", "auth_user", "tenants_membership", "reservations_reservation",
                             "reservations_allocation"], [q["sql"][:120] for q in same.captured_queries]
    assert "core_auditlog" not in _tables(panel), _tables(panel)
    Reservation.objects.filter(pk=r.pk).update(status="provisioning")
    with CaptureQueriesContext(connection) as moved:
        assert client.get(url, **htmx).status_code == 200
    assert "core_auditlog" not in _tables(moved), _tables(moved)
