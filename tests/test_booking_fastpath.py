"""The booking body's fast path (reservations/api/fastpath.py) agrees with ReservationCreateSerializer: for any
body it answers None (the serializer judges it) or exactly the serializer's validated data; it never takes
a body the serializer refuses."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from rest_framework.exceptions import ValidationError

from portal.core.api import validated
from portal.core.exceptions import DomainError
from reservations.api import fastpath
from reservations.api import views as reservation_views
from reservations.api.serializers import ReservationCreateSerializer
from reservations.choices import NodeState
from reservations.models import Node, Pool, Reservation
from tenants.models import Tenant

from .conftest import iso

pytestmark = pytest.mark.django_db

USERS = ("alpha-lead", "alpha-member", "alpha-viewer", "beta-lead", "staff")


@pytest.fixture
def fleet(world):
    """The world, plus a tenant nobody belongs to and a second pool with a retired node."""
    Tenant.objects.create(slug="gamma", name="Team Gamma")
    a100 = Pool.objects.create(name="a100", gpu_model="A100", gpus_per_node=4, on_demand_rate="1.5")
    Node.objects.create(hostname="a100-001", pool=a100)
    Node.objects.create(hostname="a100-002", pool=a100, state=NodeState.RETIRED)
    return world


def judged_by_serializer(body, user):
    """validated()'s answer as the view would get it: the validated data, or None where it refused."""
    try:
        return validated(ReservationCreateSerializer, SimpleNamespace(data=body, user=user))
    except (ValidationError, DomainError):
        return None


def comparable(value):
    """A value with everything the booking could read of it: a model instance's class, pk and every attribute
    it carries (annotations included); a value's type and, for a datetime, its tzinfo."""
    if isinstance(value, dict):
        return (dict, list(value), {k: comparable(v) for k, v in value.items()})
    if hasattr(value, "_state"):
        return (type(value), value.pk, {k: v for k, v in vars(value).items() if k != "_state"})
    if isinstance(value, datetime):
        return (datetime, value, value.tzinfo, value.isoformat())
    return (type(value), value)


def assert_agrees(body, user):
    fast = fastpath.booking_body(body, user)
    if currently_in_test_context():
        event("fast path" if fast is not None else "left to the serializer")
    if fast is None:
        return None
    slow = judged_by_serializer(body, user)
    assert slow is not None, f"the fast path took a body the serializer refuses: {body!r}"
    assert comparable(fast) == comparable(slow)
    return fast


def test_the_fast_path_reads_every_field_the_serializer_declares():
    assert tuple(ReservationCreateSerializer._declared_fields) == fastpath.HANDLED


# Values for each field: the plainly valid and their near misses.
START = datetime(2031, 3, 4, 9, 0, tzinfo=UTC)
DATETIME_TEXTS = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9998, 12, 30),
                 timezones=st.one_of(st.just(UTC), st.timezones())).map(lambda d: d.isoformat()),
    st.datetimes(min_value=datetime(1965, 1, 1), max_value=datetime(9001, 1, 1)).map(lambda d: d.isoformat()),
    st.sampled_from([
        iso(START), iso(START + timedelta(hours=4)), "2031-03-04T11:00:00+02:00", "2031-03-04T09:00:00.123456Z",
        "2031-03-04T09:00Z", "2031-03-04 09:00:00Z", " 2031-03-04T09:00:00Z ", "2031-03-04T09:00:00Z\x00",
        "2031-03-04T09:00:00Z\n", "\t2031-03-04T09:00:00Z", "2031-03-04T09:00:00", "2031-03-04",
        "2031-03-04T09:00:00 02:00",
        "2031-13-04T09:00:00Z", "2031-03-04T25:00:00Z", "1969-12-31T23:59:59Z", "1970-01-01T00:00:00Z",
        "8999-12-31T23:59:59Z", "9000-01-01T00:00:00Z", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00",
        "2031-03-04T09:00:00+24:00", "2031-03-04T09:00:00\u2003Z", "\u20032031-03-04T09:00:00Z\u0085", "",
        "2031-03-04T09:00:00+0200", "20310304T090000Z", "２０３１-03-04T09:00:00Z",
    ]),
    st.text(max_size=30),
    st.sampled_from([None, 0, 1_900_000_000, 1.5, True, [], {}]),
)
NODE_COUNTS = st.one_of(
    st.integers(min_value=-3, max_value=100_003),
    st.sampled_from([0, 1, 2, 100_000, 100_001, 2**63, -(2**63), 10**40, True, False, 1.0, 2.5, "2", " 2",
                     "", None, [], {}, float("inf")]),
)
NAMES = st.one_of(
    st.text(max_size=210),
    st.text(alphabet=st.characters(codec="utf-8", max_codepoint=0x3000), max_size=205).map(lambda t: f"  {t}\t"),
    st.sampled_from(["", " ", "\t\n", "pretrain", " pretrain ", "x" * 200, " " + "x" * 200 + "\n", "x" * 201,
                     "a\x00b", "\x00", "a\x01b", "a\x7fb", "\ud800", "a\udfffb", "\u2003job\u2003", "\x85job\x85",
                     "job\x1f", 5, 0, 1.5, True, None, [], {}]),
)
CLUSTERS = st.one_of(
    st.fixed_dictionaries({}, optional={
        "orchestrator": st.sampled_from(["slurm", "kubernetes", "Slurm", "", " slurm", "k8s", 1, None, True, []]),
        "cuda_version": st.sampled_from(["12.2", "12.8", "13.0", "12.9", 12.8, 13, "13.0 ", None]),
        "orchestrater": st.just("kubernetes"),
    }),
    st.sampled_from([None, [], "slurm", 1, True]),
)
SLUGS = ["alpha", "beta", "gamma", "nope", "", "ALPHA", " alpha", "alpha ", "alpha\x00", "al\npha", 1, 0, True,
         None, [], {}]
POOLS = ["h100", "a100", "zzz", "", "H100", "h100 ", "h100\x00", 5, None, [], {"name": "h100"}]

VALUES = {
    "tenant": st.sampled_from(SLUGS),
    "pool": st.sampled_from(POOLS),
    "node_count": NODE_COUNTS,
    "start": DATETIME_TEXTS,
    "end": DATETIME_TEXTS,
    "name": NAMES,
    "cluster": CLUSTERS,
    "status": st.just("confirmed"),
    "Tenant": st.just("alpha"),
    "node_cont": st.just(1),
}
BODIES = st.fixed_dictionaries({}, optional=VALUES)
ONE_FIELD = st.sampled_from(list(VALUES)).flatmap(lambda key: VALUES[key].map(lambda value: {key: value}))
# Mostly near misses of a valid body: a valid one with one or two fields replaced or one left out (else nearly
# every body is refused for several reasons at once, and the fast path's accepting side is barely exercised).
VALID = {"tenant": "alpha", "pool": "h100", "node_count": 2, "start": iso(START),
         "end": iso(START + timedelta(hours=4))}
NEAR_MISSES = st.builds(
    lambda base, replaced, dropped: {k: v for k, v in {**base, **replaced}.items() if k not in dropped},
    st.fixed_dictionaries({**{k: st.just(v) for k, v in VALID.items()},
                           "tenant": st.sampled_from(["alpha", "alpha", "alpha", "beta", "gamma"]),
                           "pool": st.sampled_from(["h100", "a100"])},
                          optional={"name": st.one_of(st.sampled_from(["", "job", " job\t", "x" * 200, "x" * 201,
                                                                       f" {'x' * 200}\n", f" {'x' * 201}\n"]),
                                                      NAMES),
                                    "cluster": st.one_of(st.sampled_from([{}, {"orchestrator": "kubernetes"},
                                                                          {"cuda_version": "12.2"}]), CLUSTERS)}),
    st.one_of(st.just({}), ONE_FIELD, ONE_FIELD, st.tuples(ONE_FIELD, ONE_FIELD).map(lambda t: {**t[0], **t[1]})),
    st.one_of(st.just([]), st.lists(st.sampled_from(list(VALID)), max_size=1)),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(BODIES, NEAR_MISSES), who=st.sampled_from(USERS))
def test_the_fast_path_answers_none_or_exactly_the_serializers_validated_data(fleet, body, who):
    assert_agrees(body, fleet.users[who])


@pytest.mark.parametrize("who", USERS)
@pytest.mark.parametrize("body", [
    VALID,
    {**VALID, "pool": "a100", "node_count": 1, "name": "  pretrain\t", "cluster": {}},
    {**VALID, "start": "2031-03-04T11:00:00+02:00", "end": "2031-03-04T20:30:00.5-05:30", "name": ""},
    {**VALID, "tenant": "beta", "cluster": {"orchestrator": "kubernetes"}, "name": "x" * 200},
    {**VALID, "node_count": 100_000, "cluster": {"cuda_version": "13.0", "orchestrator": "slurm"}},
])
def test_plainly_valid_bodies_take_the_fast_path(fleet, body, who):
    user = fleet.users[who]
    expected = judged_by_serializer(body, user)
    fast = assert_agrees(body, user)
    # Valid for the serializer ⇔ taken here: every one of these names the tenant, in the user's scope or not.
    assert (fast is None) == (expected is None)
    if fast is not None:
        assert fast["tenant"].role_of_user == (who.split("-")[1] if who.startswith(body["tenant"]) else None)
        assert fast["pool"].bookable_nodes == (1 if body["pool"] == "a100" else 4)


@pytest.mark.parametrize("body", [
    {k: v for k, v in VALID.items() if k != "tenant"},  # the tenant worked out by the serializer's validate()
    {**VALID, "name": "a\x01b"},  # a control character DRF's CharField keeps: left to the serializer
    {**VALID, "cluster": {"cuda_version": 12.8}},  # a number ChoiceField reads as its text
    {**VALID, "node_count": True},
    {**VALID, "extra": 1},
])
def test_bodies_the_fast_path_leaves_to_the_serializer(fleet, body):
    assert fastpath.booking_body(body, fleet.users["alpha-lead"]) is None


def test_the_fast_path_reads_the_tenant_and_pool_in_two_statements(fleet):
    user = fleet.users["alpha-lead"]
    fastpath.booking_body(VALID, user)  # the statements compiled (no query), as the thread's first booking does
    with CaptureQueriesContext(connection) as queries:
        assert fastpath.booking_body(VALID, user) is not None
    assert len(queries) == 2


def test_a_valid_booking_runs_no_serializer_and_no_more_queries(fleet, monkeypatch, t0):
    built = []
    original = ReservationCreateSerializer.__init__

    def counting(self, *args, **kwargs):
        built.append(kwargs.get("data"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(ReservationCreateSerializer, "__init__", counting)
    client = fleet.client("alpha-lead")

    def book(day):
        body = {**VALID, "start": iso(t0 + timedelta(days=day)), "end": iso(t0 + timedelta(days=day, hours=4))}
        with CaptureQueriesContext(connection) as queries:
            r = client.post("/api/v1/reservations/", body, format="json")
        assert r.status_code == 201, r.json()
        return len(queries)

    book(0)  # warm: the compiled lookups and anything else a thread's first booking reads once
    fast_queries = book(1)
    assert built == []
    monkeypatch.setattr(reservation_views, "booking_body", lambda data, user: None)
    slow_queries = book(2)
    assert len(built) == 1
    assert fast_queries <= slow_queries
    assert Reservation.objects.count() == 3


def test_a_refused_body_is_still_judged_by_the_serializer(fleet, monkeypatch):
    built = []
    original = ReservationCreateSerializer.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ReservationCreateSerializer, "__init__", counting)
    r = fleet.client("alpha-lead").post("/api/v1/reservations/", {**VALID, "node_count": "2"}, format="json")
    assert r.status_code == 400 and "node_count" in r.json()["fields"]
    assert built == [1]
    assert Reservation.objects.count() == 0
