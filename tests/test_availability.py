"""Availability computed by PostgreSQL agrees with a brute-force oracle on random fleets (hypothesis).

The fleets have allocations on and off the slot grid; one-slot steps are answered from the per-slot
summary (migration 0006), wider steps by the sweep, and both must give the oracle's answer.
"""

from datetime import timedelta

import pytest
from hypothesis import strategies as st

from .conftest import iso

pytestmark = pytest.mark.django_db

STATES = ["available", "available", "available", "draining", "failed", "maintenance"]


fleet = st.fixed_dictionaries({
    "states": st.lists(st.sampled_from(STATES), min_size=1, max_size=6),
    # (node, start hour, hours, active, minutes past the hour at start and end: off the grid when not 0)
    "allocs": st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30), st.integers(1, 8), st.booleans(),
                                 st.sampled_from([0, 0, 0, 10, 30]), st.sampled_from([0, 0, 0, 20, 45])),
                       max_size=25),
    "slot": st.sampled_from([60, 60, 30]),
    "step": st.sampled_from([1, 1, 2, 3, 6]),  # in slots
    "span": st.integers(1, 36),
    "offset": st.integers(0, 10),  # in slots
    "compact": st.booleans(),
})


def test_availability_api_shape(world, t0):
    world.client("alpha-lead").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 3, "start": iso(t0), "end": iso(t0 + timedelta(hours=2))}, format="json")
    r = world.client("beta-viewer").get("/api/v1/availability/", {
        "pool": "h100", "start": iso(t0 - timedelta(hours=1)), "end": iso(t0 + timedelta(hours=3)), "step": 3600})
    assert r.status_code == 200
    body = r.json()
    assert body["pool"] == "h100" and body["total_nodes"] == 4
    assert [s["free_nodes"] for s in body["slots"]] == [4, 1, 1, 4]
    assert body["slots"][0] == {"start": iso(t0 - timedelta(hours=1)), "end": iso(t0), "free_nodes": 4}


def test_availability_is_one_query_whatever_the_range(world, t0):
    c = world.client("alpha-viewer")
    c.get("/api/v1/pools/")  # the token's first use writes last_used_at; keep that out of the count
    counts = []
    for days in (1, 30):
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as ctx:
            r = c.get("/api/v1/availability/",
                      {"pool": "h100", "start": iso(t0), "end": iso(t0 + timedelta(days=days))})
        assert r.status_code == 200 and len(r.json()["slots"]) == days * 24
        counts.append(len(ctx.captured_queries))
    assert counts[0] == counts[1]
