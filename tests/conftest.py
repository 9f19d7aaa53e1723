"""Shared fixtures: a small fleet, two tenants with every role, token-authenticated clients."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from reservations.models import Node, Pool
from reservations.timeutil import slot_floor
from tenants.models import Membership, Quota, Tenant
from tenants.services import token_issue


@dataclass
class World:
    pool: Pool
    nodes: list[Node]
    tenants: dict[str, Tenant]
    users: dict[str, object] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def client(self, who: str | None) -> APIClient:
        client = APIClient()
        if who is not None:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.tokens[who]}")
        return client


def make_world(*, nodes: int = 4, max_nodes: int = 3, burst_nodes: int = 1, burst_enabled: bool = True) -> World:
    User = get_user_model()
    pool = Pool.objects.create(name="h100", gpu_model="H100-SXM", gpus_per_node=8, on_demand_rate="2.5")
    node_objs = [Node.objects.create(hostname=f"h100-{i:03d}", pool=pool) for i in range(1, nodes + 1)]
    world = World(pool=pool, nodes=node_objs, tenants={})
    for slug in ("alpha", "beta"):
        tenant = Tenant.objects.create(slug=slug, name=f"Team {slug.title()}", burst_enabled=burst_enabled)
        world.tenants[slug] = tenant
        Quota.objects.create(tenant=tenant, pool=pool, max_nodes=max_nodes, burst_nodes=burst_nodes)
        for role in ("lead", "member", "viewer"):
            user = User.objects.create_user(username=f"{slug}-{role}", password="pw-Long-enough-1")
            Membership.objects.create(user=user, tenant=tenant, role=role)
            world.users[f"{slug}-{role}"] = user
    staff = User.objects.create_user(username="staff", password="pw-Long-enough-1", is_staff=True)
    world.users["staff"] = staff
    for name, user in world.users.items():
        world.tokens[name] = token_issue(user=user)[1]
    return world


# The longest margin now_clear_of_the_hour takes: it may sleep that long, and a test has pytest-timeout's 300 s
# (pyproject.toml) for everything, its fixtures included. A scenario that needs longer books a longer window.
CLEAR_OF_THE_HOUR_MAX_MARGIN_S = 120.0


def now_clear_of_the_hour(margin_s: float = 60.0) -> datetime:
    """Return now, first sleeping into the next hourly slot if under margin_s are left of this one.

    A scenario that books from the slot running now (slot_floor(now, 60)) must finish inside it:
    once the hour rolls over that start is in the past, and booking rightly refuses it.
    """
    if margin_s > CLEAR_OF_THE_HOUR_MAX_MARGIN_S:
        raise ValueError(f"a margin of {margin_s} s may sleep past the test's timeout "
                         f"(at most {CLEAR_OF_THE_HOUR_MAX_MARGIN_S} s)")
    now = timezone.now()
    left = (slot_floor(now, 60) + timedelta(hours=1) - now).total_seconds()
    if left < margin_s:
        time.sleep(left + 0.1)
        now = timezone.now()
    return now


def forget_throttle_budgets(*users) -> None:
    """Start these users on a fresh API rate budget.

    Budgets live in Redis under the user's id, and a new test database hands out the same ids
    again: an earlier session's low-rate test may have spent this id's budget a minute ago.
    """
    import redis
    from django.conf import settings

    conn = redis.Redis.from_url(settings.REDIS_URL)
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    for user in users:
        for name in conn.scan_iter(f"{prefix}:throttle:user:*:{user.pk}"):
            conn.delete(name)


def forget_anon_throttle_budgets(address: str) -> None:
    """Start this client address on a fresh anonymous API rate budget (every rate's key for it).

    Budgets outlive the test in Redis: a test that throttles an address on purpose would otherwise
    find it already throttled when the suite runs again within the minute.
    """
    import redis
    from django.conf import settings

    conn = redis.Redis.from_url(settings.REDIS_URL)
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    for name in conn.scan_iter(f"{prefix}:throttle:anon:*:{address}"):
        conn.delete(name)


@pytest.fixture(autouse=True)
def _no_relay_run_queued():
    """Each test starts with no outbox relay run marked as queued: a flag an earlier test set (its wake-up
    message never consumed) would otherwise keep this test's commits from queueing one for up to
    RELAY_QUEUED_TTL_MS (portal.core.events)."""
    from portal.core import events

    events._relay_started()
    yield


@pytest.fixture
def eager():
    """Run Celery tasks in-process (an event's subscriber queues a task; it runs before the call returns),
    propagating their errors."""
    from celery import current_app

    conf = current_app.conf
    before = (conf.task_always_eager, conf.task_eager_propagates)
    conf.task_always_eager, conf.task_eager_propagates = True, True
    yield
    conf.task_always_eager, conf.task_eager_propagates = before


@pytest.fixture
def world(db) -> World:
    return make_world()


@pytest.fixture
def web(world):
    """Return a function that gives a browser-session test client signed in as one of the world's users."""
    from django.test import Client

    def client_for(who: str, **kwargs) -> Client:
        client = Client(**kwargs)
        client.force_login(world.users[who])
        return client

    return client_for


@pytest.fixture
def t0():
    """A slot-aligned instant a day ahead: the start of most test bookings."""
    return slot_floor(timezone.now(), 60) + timedelta(days=1)


def feed_path(tenant, user) -> str:
    """The user's personal calendar-feed path for the tenant (tenants.selectors.ical_feed_token)."""
    from tenants.models import Membership
    from tenants.selectors import ical_feed_token

    membership = Membership.objects.get(tenant=tenant, user=user)
    return f"/ical/{tenant.slug}/{ical_feed_token(tenant=tenant, membership_id=membership.pk)}.ics"


def wait_for_lock_waiter(table: str, timeout: float = 10) -> None:
    """Wait until another session is queued on a lock while running a statement that names table."""
    import time

    from .racing import lock_waiters

    deadline = time.time() + timeout
    while time.time() < deadline:
        if lock_waiters(table):
            return
        time.sleep(0.02)
    raise AssertionError(f"nothing queued on a lock while touching {table}")


def iso(dt) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def next_fall_back(tz) -> date:
    """The next day (two or more days ahead, within a year) on which tz's clocks go back."""
    from django.utils import timezone

    day = timezone.now().date() + timedelta(days=2)
    for _ in range(366):
        if datetime.combine(day, datetime.min.time(), tzinfo=tz).utcoffset() > \
                datetime.combine(day, datetime.min.time(), tzinfo=tz).replace(hour=12).utcoffset():
            return day
        day += timedelta(days=1)
    raise AssertionError(f"{tz} has no fall-back day in the next year")


@pytest.fixture
def captured_events():
    """Record every domain event dispatched (after commit) during the test: [(name, payload)]."""
    from portal.core import events

    seen: list[tuple[str, dict]] = []

    def handler(name, payload):
        seen.append((name, payload))

    events.subscribe("*", handler)
    yield seen
    events.unsubscribe("*", handler)


@contextmanager
def availability_statements():
    """Record the SQL that reservations.selectors.availability runs (a raw psycopg cursor, out of Django's sight)."""
    from reservations import selectors

    seen: list[str] = []
    real = selectors.availability_rows

    class Recorder:
        def __init__(self, cursor):
            self.cursor = cursor

        def execute(self, sql, params=None):
            seen.append(sql)
            return self.cursor.execute(sql, params)

        def fetchall(self):
            return self.cursor.fetchall()

    with mock.patch.object(selectors, "availability_rows", lambda cursor, **kw: real(Recorder(cursor), **kw)):
        yield seen
