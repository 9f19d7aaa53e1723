"""Availability computed by PostgreSQL agrees with a brute-force oracle on random fleets (hypothesis).

The fleets have allocations on and off the slot grid; one-slot steps are answered from the per-slot
summary (migration 0006), wider steps by the sweep, and both must give the oracle's answer.
"""

from datetime import datetime, timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservations import selectors
from reservations.models import Allocation, Node, Pool
from reservations.selectors import availability
from reservations.services import slot_usage_compact

from .conftest import availability_statements, iso

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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=fleet)
def test_availability_matches_oracle(db, t0, case):
    Allocation.objects.all().delete()
    Node.objects.all().delete()
    Pool.objects.all().delete()
    pool = Pool.objects.create(name="p", gpu_model="H100", gpus_per_node=8, slot_minutes=case["slot"])
    nodes = [Node.objects.create(hostname=f"n{i}", pool=pool, state=s) for i, s in enumerate(case["states"])]
    other = Pool.objects.create(name="q", gpu_model="A100", gpus_per_node=8)
    stranger = Node.objects.create(hostname="q0", pool=other)
    placed = []  # (node index, start h, end h, active) kept only if the constraint accepted it
    for node_i, start_h, hours, active, lo_min, hi_min in case["allocs"]:
        node = nodes[node_i % len(nodes)]
        s = t0 + timedelta(hours=start_h, minutes=lo_min)
        e = t0 + timedelta(hours=start_h + hours, minutes=hi_min)
        clash = any(p[0] == node.pk and p[3] and active and p[1] < e and s < p[2] for p in placed)
        if clash:
            continue
        Allocation.objects.create(node=node, period=DateTimeTZRange(s, e, "[)"), kind="maintenance", active=active)
        placed.append((node.pk, s, e, active))
    Allocation.objects.create(node=stranger, period=DateTimeTZRange(t0, t0 + timedelta(days=3), "[)"),
                              kind="maintenance")
    if case["compact"]:
        slot_usage_compact()

    slot = timedelta(minutes=case["slot"])
    step = slot * case["step"]
    start = t0 + slot * case["offset"]
    end = start + step * case["span"]
    with availability_statements() as seen:
        got = [(sl.start, sl.end, sl.free_nodes) for sl in availability(pool=pool, start=start, end=end, step=step)]
    # A step of one slot is answered from the per-slot summary alone; wider steps take the sweep.
    assert (seen == [selectors.AVAILABILITY_SUMMARY_SQL]) == (case["step"] == 1)

    expected = []
    cur = start
    while cur < end:
        nxt = min(cur + step, end)
        free = sum(
            1 for n in nodes
            if n.state == "available"
            and not any(p[0] == n.pk and p[3] and p[1] < nxt and cur < p[2] for p in placed)
        )
        expected.append((cur, nxt, free))
        cur = nxt
    assert got == expected


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


@pytest.mark.parametrize("slot_minutes", [1, 5, 15, 60, 1440])
def test_availability_with_only_the_pool_given_answers_for_any_slot_length(world, slot_minutes):
    """start, end and step are optional: what they default to is a valid request for every pool."""
    from django.conf import settings as django_settings

    pool = Pool.objects.create(name=f"fine-{slot_minutes}", gpu_model="L4", gpus_per_node=1, slot_minutes=slot_minutes)
    Node.objects.create(hostname=f"fine-{slot_minutes}-1", pool=pool)
    r = world.client("alpha-viewer").get("/api/v1/availability/", {"pool": pool.name})
    # was: 400 invalid "step: At most 2000 slots a request; widen the step." for a pool of 1- or 5-minute
    # slots: the default window (7 days) at the default step (the pool's slot) was over the limit itself
    assert r.status_code == 200, r.json()
    slots = r.json()["slots"]
    week = 7 * 24 * 60 // slot_minutes
    assert len(slots) == min(week, django_settings.PORTAL_AVAILABILITY_MAX_SLOTS)
    assert all(s["free_nodes"] == 1 for s in slots)
    # A window given in full is still the client's: too many slots at the step is refused, naming step.
    start = slots[0]["start"]
    end = datetime.fromisoformat(start) + timedelta(minutes=slot_minutes * 2001)
    too_long = world.client("alpha-viewer").get("/api/v1/availability/",
                                                {"pool": pool.name, "start": start, "end": iso(end)})
    assert too_long.status_code == 400 and too_long.json()["fields"].keys() == {"step"}
