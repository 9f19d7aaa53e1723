"""GET /api/v1/reservations/?start=…&end=… reads the bookings in the window from an index, not the whole history.

The filter was upper(period) > start with the list ordered by period: no index serves that condition, so
PostgreSQL walked the (period, id) index from the oldest booking on and threw away every finished one (59,290
rows, 38 ms at 72k reservations). As overlaps with [start, ∞) and (−∞, end), the same rows are found from a GiST
index on period."""
import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from reservations.models import Reservation

from .conftest import iso
from .plans import rows_read

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)
HISTORY = 3000


def _history(world, t0):
    """A long history of finished one-hour bookings (all before t0 − 2 days) and a few around and after t0."""
    tenant, pool = world.tenants["alpha"], world.pool
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO reservations_reservation (tenant_id, pool_id, node_count, period, name, status, status_reason,"
            " missing_nodes, billing, orchestrator, cuda_version, created_at, updated_at)"
            " SELECT %s, %s, 1, tstzrange(%s - g * interval '1 hour', %s - (g - 1) * interval '1 hour'), '',"
            " 'completed', '', 0, 'committed', 'slurm', '12.4', now(), now() FROM generate_series(2, %s) g",
            [tenant.pk, pool.pk, t0 - 48 * H, t0 - 48 * H, HISTORY + 1])
    client = world.client("alpha-lead")
    for offset, hours in ((0, 2), (1, 1), (3, 4), (10, 2)):
        body = {"pool": "h100", "node_count": 1, "start": iso(t0 + offset * H), "end": iso(t0 + (offset + hours) * H)}
        assert client.post("/api/v1/reservations/", body, format="json").status_code == 201
    with connection.cursor() as cur:
        cur.execute("ANALYZE reservations_reservation")


def _ids(client, url):
    ids, page = [], url
    while page:
        r = client.get(page)
        assert r.status_code == 200, r.content
        ids += [row["id"] for row in r.json()["results"]]
        page = r.json()["next"]
    return ids


def _list_statements(client, url):
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return [q["sql"] for q in ctx.captured_queries if re.search(r'FROM "reservations_reservation"', q["sql"])]


@pytest.mark.parametrize("who", ["staff", "alpha-lead"])
@pytest.mark.parametrize("window", ["start", "start_end", "end"])
def test_the_window_filter_reads_no_finished_history(world, t0, who, window):
    _history(world, t0)
    start, end = t0 + 2 * H, t0 + 5 * H
    query = {"start": f"start={iso(start)}", "start_end": f"start={iso(start)}&end={iso(end)}",
             "end": f"end={iso(t0 - 48 * H - (HISTORY - 3) * H)}"}[window]
    url = f"/api/v1/reservations/?{query}"
    client = world.client(who)
    # Results unchanged: the bookings whose period meets the window, in (period, id) order.
    want = Reservation.objects.all()
    if "start" in window:
        want = want.filter(period__endswith__gt=start)
    if "end" in window:
        want = want.filter(period__startswith__lt=end if window == "start_end" else t0 - 48 * H - (HISTORY - 3) * H)
    ids = _ids(client, url)
    assert ids == list(want.order_by("period", "id").values_list("id", flat=True))
    assert 0 < len(ids) <= 4
    statements = _list_statements(client, url)
    assert len(statements) == 2  # the count and the page
    for sql in statements:
        with connection.cursor() as cur:
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
            plan = cur.fetchone()[0]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        read = rows_read(plan[0]["Plan"], "reservations_reservation")
        assert read < 100, f"{url} read {read} reservation rows for a window holding at most 4:\n{sql}\n{plan}"
