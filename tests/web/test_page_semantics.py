"""What a screen reader is told by the pages (Django test client, the rendered HTML): every column header says
what its column is, every page has one top-level heading, a page's named regions have names of their own."""

from __future__ import annotations

from datetime import timedelta
from html.parser import HTMLParser

import pytest

pytestmark = pytest.mark.django_db


class _Headers(HTMLParser):
    """The text (visible or screen-reader only) of each <th> in the document."""

    def __init__(self):
        super().__init__()
        self.headers: list[str] = []
        self._open = False

    def handle_starttag(self, tag, attrs):
        if tag == "th":
            self.headers.append("")
            self._open = True

    def handle_endtag(self, tag):
        if tag == "th":
            self._open = False

    def handle_data(self, data):
        if self._open:
            self.headers[-1] += data


def _column_headers(html: str) -> list[str]:
    parser = _Headers()
    parser.feed(html)
    return [h.strip() for h in parser.headers]


def test_the_delivery_logs_button_column_has_a_header_a_screen_reader_can_say(world, web):
    """The delivery log's last column (a failed message's Retry button) had an empty header: a screen reader
    read the button's cell with no column name (axe: empty-table-header). It is "Action" to a screen reader."""
    html = web("alpha-lead").get("/notifications/deliveries/").content.decode()
    headers = _column_headers(html)
    assert headers and all(headers), headers
    assert headers[-1] == "Action", headers


class _Regions(HTMLParser):
    """Each named region (a <section> or role="region" with aria-label or aria-labelledby): its label or the ids
    it is labelled by; and the text of every element with an id."""

    def __init__(self):
        super().__init__()
        self.regions: list[tuple[str, str]] = []  # ("label", text) or ("ids", "a b")
        self.text: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" or a.get("role") == "region":
            if a.get("aria-label"):
                self.regions.append(("label", a["aria-label"]))
            elif a.get("aria-labelledby"):
                self.regions.append(("ids", a["aria-labelledby"]))
        if tag in {"br", "img", "input", "meta", "link", "hr", "wbr"}:
            return
        self._open.append((tag, a.get("id")))
        if a.get("id"):
            self.text[a["id"]] = ""

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, ident in self._open:
            if ident:
                self.text[ident] += data


def _region_names(html: str) -> list[str]:
    parser = _Regions()
    parser.feed(html)
    return [" ".join(value.split()) if kind == "label"
            else " ".join(" ".join(parser.text.get(i, "") for i in value.split()).split())
            for kind, value in parser.regions]


@pytest.fixture
def provisioned(world, book, t0, settings):
    """alpha's booking (tomorrow) with its cluster provisioned on the simulated backend."""
    from provisioning import services as prov
    from provisioning.models import VirtualCluster
    from tests.provisioning.conftest import FAST

    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    booking = book("alpha-lead", t0, hours=2)
    prov.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=booking)
    prov.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "ready" and cluster.connection
    return booking, cluster


def test_a_pages_named_regions_each_have_their_own_name(world, web, book, t0, provisioned):
    """The dashboard's upcoming reservations, the reservation list, the usage table, the members table and a
    cluster's history: the card (a named region) and the table's scroll box inside it (a named region too, so a
    keyboard can scroll it) had the same name, so a screen reader's landmark list said "Active and upcoming
    reservations" twice, one inside the other (axe: landmark-unique). The scroll box says it is the table."""
    _, cluster = provisioned
    client = web("alpha-lead")
    problems = []
    for path in ("/", "/reservations/", "/usage/", "/team/", f"/clusters/{cluster.pk}/"):
        response = client.get(path)
        assert response.status_code == 200, path
        names = _region_names(response.content.decode())
        assert names and all(names), (path, names)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            problems.append((path, repeated, names))
    assert not problems, f"regions named alike: {problems}"


class _Headings(HTMLParser):
    def __init__(self):
        super().__init__()
        self.levels: list[int] = []

    def handle_starttag(self, tag, attrs):
        if len(tag) == 2 and tag[0] == "h" and tag[1] in "123456":
            self.levels.append(int(tag[1]))


def _heading_levels(html: str) -> list[int]:
    parser = _Headings()
    parser.feed(html)
    return parser.levels


def test_every_page_has_one_top_heading_and_no_skipped_level(world, web, provisioned):
    """A screen-reader user moves through a page by its headings. The booking page (/reservations/new/) had
    none at level 1 (axe: page-has-heading-one), and a cluster's page went from its h1 straight to the
    status card's "Connection" at level 3 (axe: heading-order)."""
    booking, cluster = provisioned
    client = web("alpha-lead")
    problems = []
    for path in ("/", "/calendar/", "/reservations/", "/reservations/new/", f"/reservations/{booking.pk}/",
                 "/availability/", "/usage/", "/team/", "/account/", "/notifications/", "/notifications/deliveries/",
                 "/clusters/", f"/clusters/{cluster.pk}/"):
        response = client.get(path)
        assert response.status_code == 200, path
        levels = _heading_levels(response.content.decode())
        skips = [(a, b) for a, b in zip(levels, levels[1:], strict=False) if b > a + 1]
        if levels.count(1) != 1 or levels[0] != 1 or skips:
            problems.append((path, levels))
    assert not problems, problems


def test_the_booking_forms_heading_is_the_pages_h1_on_its_page_and_an_h2_in_the_calendars_panel(world, web):
    """On its own page the form's heading is the page's h1, also when htmx swaps in the form again (a refusal
    with its reasons); in the calendar's side panel, under the calendar's h1, it stays an h2."""
    client = web("alpha-lead")
    refused = {"tenant": "alpha", "pool": world.pool.name, "node_count": "1", "name": "x",
               "start": "2030-01-01T10:00", "end": "2030-01-01T09:00"}
    for current, level in (("/reservations/new/?pool=h100", 1), ("/calendar/?pool=h100", 2)):
        hx = {"HX-Request": "true", "HX-Current-URL": f"http://testserver{current}"}
        for response in (client.get("/reservations/new/", headers=hx),
                         client.post("/reservations/new/", refused, headers=hx)):
            html = response.content.decode()
            assert f'<h{level} id="booking-title">New booking</h{level}>' in html, (current, html[:400])
            assert _heading_levels(html).count(1) == (1 if level == 1 else 0), current


class _Controls(HTMLParser):
    """The text (visible and screen-reader only) of each <button> and each link styled as a button (a.btn)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self._depth = 0
        self._tag = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "button" or (tag == "a" and "btn" in (a.get("class") or "").split()):
            self.names.append("")
            self._tag = tag
            self._depth = 1
        elif self._depth and tag == self._tag:
            self._depth += 1

    def handle_endtag(self, tag):
        if self._depth and tag == self._tag:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.names[-1] += data


def test_each_webhooks_buttons_say_which_webhook_they_act_on(world, web):
    """With two webhooks the notifications page had two "Save", two "Send test message", two "Rotate secret…"
    and two "Delete" buttons: a screen reader's list of buttons could not tell them apart (the team page's
    Save and Remove buttons name their member). Each names its webhook."""
    from notifications import services as notify

    for name in ("ci", ""):
        notify.webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                              url=f"https://{name or 'other'}.example.com/hooks/gpu-portal", name=name)
    parser = _Controls()
    parser.feed(web("alpha-lead").get("/notifications/").content.decode())
    names = [" ".join(n.split()) for n in parser.names]
    for action in ("Save", "Send test message", "Rotate secret…", "Delete"):
        mine = [n for n in names if n == action or n.startswith(action + " webhook")]
        assert len(mine) == 2 and len(set(mine)) == 2, (action, names)
