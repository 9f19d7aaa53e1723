"""Playwright (sync API) driving the system Chromium against pytest-django's live server.

One browser per session; a fresh context (cookies, time zone, viewport) per test.
"""

from __future__ import annotations

import os

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests make in
# between are still plain synchronous code, so Django's async-safety guard must stand down.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

from datetime import UTC, date, datetime, timedelta  # noqa: E402

import pytest  # noqa: E402
from django.utils import timezone  # noqa: E402
from playwright.sync_api import Page, sync_playwright  # noqa: E402

CHROMIUM = os.environ.get("PORTAL_CHROMIUM", "/usr/bin/chromium")
PASSWORD = "pw-Long-enough-1"  # the world's users (tests/conftest.py)
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def new_page(browser):
    """Return a function making a page in a fresh context; all are closed after the test."""
    contexts = []

    def make(*, tz: str = "UTC", viewport: dict | None = None, locale: str = "en-GB") -> Page:
        context = browser.new_context(viewport=viewport or DESKTOP, timezone_id=tz, locale=locale)
        context.set_default_timeout(15_000)
        contexts.append(context)
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        return page

    yield make
    for context in contexts:
        context.close()
    if contexts:
        _wait_for_the_server_to_finish()


def _wait_for_the_server_to_finish(timeout: float = 20) -> None:
    """Wait until no other session of the test database is inside a statement or a transaction.

    A closed page does not stop the live server: a request it sent just before (a calendar refetch, a
    panel) is still running in a server thread. The test database's flush after the test then took
    its table locks in the other order and PostgreSQL broke the deadlock by aborting the flush, which
    left the rows behind for the next test. Read over a connection of its own: a test without database
    access has its Django connection blocked.
    """
    import time

    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("server_side_binding", None)
    params.pop("prepare_threshold", None)
    # Quiet for a while, not at one glance: a request between two of its statements (autocommit) reads as idle,
    # and one the browser sent last may reach the server a moment after the look (seen under load: the flush
    # deadlocked with a request that began its next statement just after the server had looked quiet).
    quiet_for = 0.25
    with psycopg.connect(**params, autocommit=True) as conn:
        deadline = time.monotonic() + timeout
        quiet_since = None
        while time.monotonic() < deadline:
            busy = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND state IN ('active', 'idle in transaction') AND backend_type = 'client backend'").fetchone()[0]
            now = time.monotonic()
            quiet_since = None if busy else (quiet_since or now)
            if quiet_since is not None and now - quiet_since >= quiet_for:
                return
            time.sleep(0.05)


@pytest.fixture
def sign_in(live_server):
    """Sign in through the real form (CSRF and all) and land on the dashboard."""

    def _sign_in(page: Page, username: str, password: str = PASSWORD) -> Page:
        page.goto(f"{live_server.url}/accounts/login/")
        page.get_by_label("Username").fill(username)
        page.get_by_label("Password").fill(password)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{live_server.url}/")
        return page

    return _sign_in


@pytest.fixture
def day() -> date:
    """A whole day two days ahead (UTC): every booking in it lies safely in the future."""
    return (timezone.now() + timedelta(days=2)).date()


def at(d: date, hour: int, tz=UTC) -> datetime:
    return datetime(d.year, d.month, d.day, hour, tzinfo=tz)


def open_day(page: Page, live_server, d: date, *, pool: str = "h100") -> None:
    page.goto(f"{live_server.url}/calendar/?view=timeGridDay&date={d.isoformat()}&pool={pool}")
    page.wait_for_selector("#calendar[data-ready='1']")


def drag(page: Page, d: date, start: str, end: str) -> None:
    """Drag down the day column from the slot at start to the slot at end (both inclusive, HH:MM)."""
    col = page.locator(f".fc-timegrid-col[data-date='{d.isoformat()}']").bounding_box()
    top = page.locator(f"td.fc-timegrid-slot-lane[data-time='{start}:00']")
    bottom = page.locator(f"td.fc-timegrid-slot-lane[data-time='{end}:00']")
    top.scroll_into_view_if_needed()
    a, b = top.bounding_box(), bottom.bounding_box()
    x = col["x"] + col["width"] / 2
    page.mouse.move(x, a["y"] + a["height"] / 2)
    page.mouse.down()
    page.mouse.move(x, (a["y"] + b["y"]) / 2 + a["height"] / 2, steps=4)
    page.mouse.move(x, b["y"] + b["height"] / 2, steps=4)
    page.mouse.up()


def seed_pages_demo(feed_secret: str = "demo-feed-secret") -> tuple[date, object]:
    """The demo fleet (seed_demo) plus every kind of row the pages show: a nearly full a100 day 30 days
    ahead (15 of 16 nodes taken, so asking for 2 conflicts), a maintenance window tomorrow and a failed
    node. Returns that far day and research's booking on it."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from reservations import services
    from reservations.models import Node, Pool
    from tenants.models import Tenant

    call_command("seed_demo", stdout=open(os.devnull, "w"))  # noqa: SIM115 - devnull
    Tenant.objects.filter(slug="research").update(ical_token=feed_secret)
    research, finetune = Tenant.objects.get(slug="research"), Tenant.objects.get(slug="finetune")
    a100 = Pool.objects.get(name="a100-80gb")
    far = (timezone.now() + timedelta(days=30)).date()
    users = {u.username: u for u in get_user_model().objects.all()}
    services.reservation_create(actor=users["finetune-lead"], tenant=finetune, pool=a100, node_count=12,
                                start=at(far, 9), end=at(far, 13), name="finetune sweep")
    mine = services.reservation_create(actor=users["research-lead"], tenant=research, pool=a100, node_count=3,
                                       start=at(far, 9), end=at(far, 13), name="eval sweep")
    tomorrow = timezone.now().date() + timedelta(days=1)
    h100_002 = Node.objects.get(hostname="h100-sxm-002")
    if not h100_002.allocations.filter(active=True, period__overlap=(at(tomorrow, 2), at(tomorrow, 8))).exists():
        services.maintenance_window_create(actor=users["admin"], node=h100_002, start=at(tomorrow, 2),
                                           end=at(tomorrow, 8), note="firmware update")
    services.node_update(actor=users["admin"], node=Node.objects.get(hostname="a100-80gb-016"), state="failed",
                         reason="XID 79: GPU fell off the bus")
    return far, mine
