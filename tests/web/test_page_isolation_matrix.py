"""The browser side of the isolation matrix (the REST side is tests/test_isolation.py).

Every page, htmx partial, JSON feed and download the portal serves, fetched by alpha's lead, member and
viewer while beta holds a booking, a ready cluster, a health check, a webhook with a delivery, audit
entries, members and an API token. Two rules:

- beta's objects, asked for by id, slug or hostname (GET and POST), answer exactly as an id that does not
  exist: a 404 for whoever may use such an object of their own, never a 403 that confirms it is there,
  and nothing beta owns changes;
- no answer alpha gets (a page, a filter naming beta, an error) names beta, its booking, or the
  hostnames of the nodes beta holds.
"""

from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import urlencode

import pytest
from django.test import Client

from notifications import services as notify
from provisioning import services as prov
from provisioning.health.models import HealthCheck
from provisioning.models import VirtualCluster
from reservations.models import Reservation
from tenants.models import ApiToken, Membership
from tests.conftest import feed_path, iso

pytestmark = pytest.mark.django_db

WHO = ("alpha-lead", "alpha-member", "alpha-viewer")
HTMX = {"HTTP_HX_REQUEST": "true"}
MISSING = 987654


@pytest.fixture
def scene(world, t0, settings):
    """alpha books one node, beta two (disjoint nodes); both clusters provisioned; beta gets the rest."""
    settings.PORTAL_SIMULATED_PHASE_SECONDS = "0"
    settings.PORTAL_PROVISIONING_FAULTS = ""
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    settings.PORTAL_PROVISION_LEAD_MINUTES = "30"
    settings.PORTAL_BASE_URL = "https://portal.example.com"
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = ""
    settings.PORTAL_DEMO_WEBHOOK_URL = ""
    from reservations.services import reservation_create

    def book(who, nodes, name):
        tenant = world.tenants[who.split("-")[0]]
        return reservation_create(actor=world.users[who], tenant=tenant, pool=world.pool, node_count=nodes,
                                  start=t0, end=t0 + timedelta(hours=2), name=name)

    for slug in ("alpha", "beta"):  # both tenants publish a calendar feed
        world.tenants[slug].ical_token = f"{slug}-feed-secret-0123456789"
        world.tenants[slug].save(update_fields=["ical_token"])
    alpha = book("alpha-lead", 1, "alpha-run")
    beta = book("beta-lead", 2, "beta-secret-run")
    prov.lifecycle_tick(now=t0 - timedelta(minutes=10))
    clusters = {c.tenant.slug: c for c in VirtualCluster.objects.select_related("tenant")}
    for cluster in clusters.values():
        prov.cluster_provision(cluster_id=cluster.pk)
        cluster.refresh_from_db()
    beta_nodes = list(beta.allocations.values_list("node__hostname", flat=True))
    beta_node = beta.allocations.select_related("node").first().node
    check = HealthCheck.objects.create(node=beta_node, reservation=beta, level="quick", trigger="on_demand",
                                       status="done", verdict="pass", summary="beta-secret check",
                                       requested_by=world.users["beta-lead"])
    channel, _secret = notify.webhook_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"],
                                             url="https://ci.beta.example/hook", name="beta-ci", events=None)
    (delivery,) = notify.event_fanout(event="reservation.confirmed", payload={"reservation_id": beta.pk})
    # beta's webhook is broken and its delivery failed: what a lead's pages warn about, for beta's leads only.
    from notifications.models import Channel, Delivery
    from notifications.selectors import url_fingerprint

    Channel.objects.filter(pk=channel.pk).update(broken_at=t0 - timedelta(days=1),
                                                 broken_url_fp=url_fingerprint(channel.target_url()))
    Delivery.objects.filter(pk=delivery.pk).update(status="failed", last_error="http_500", attempts=1)
    token = ApiToken.objects.filter(user=world.users["beta-lead"]).first()
    return {
        "alpha": alpha, "beta": beta, "cluster": clusters["beta"], "alpha_cluster": clusters["alpha"],
        "check": check, "channel": channel, "delivery": delivery, "token": token,
        "membership": Membership.objects.get(user=world.users["beta-member"]),
        "beta_nodes": beta_nodes, "beta_node": beta_node,
    }


def _client(world, who) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


BETA = re.compile(r"(?<![a-z0-9])beta(?![a-z0-9])")


def assert_no_trace_of_beta(scene, response, where, *, asked: str = ""):
    """No mention of beta (its slug, name, booking, nodes) beyond what the request itself typed: a query
    string echoed in a link, a text box or a hidden field holding the value sent."""
    body = response.content.decode("utf-8", "replace").lower()
    if asked:
        query = asked.split("?", 1)[1] if "?" in asked else ""
        body = body.replace(query.replace("&", "&amp;").lower(), "").replace(query.lower(), "")
        body = re.sub(r'(<input [^>]*name="(q|tenant)" value=)"beta"', r"\1", body)
    found = BETA.search(body)
    if found:
        pytest.fail(f"{where}: {body[max(0, found.start() - 120):found.end() + 40]!r}")
    for hostname in scene["beta_nodes"]:
        assert hostname not in body, (where, hostname)


def _sans_csrf(response) -> str:
    return re.sub(r"[A-Za-z0-9]{64}", "", response.content.decode())  # the CSRF token, new in each response


# --- every page and feed, with filters that name beta ----------------------------------------------


def page_urls(world, scene, t0) -> list[tuple[str, dict]]:
    beta = scene["beta"]
    window = urlencode({"start": iso(t0 - timedelta(days=1)), "end": iso(t0 + timedelta(days=2))})
    names = [("tenant", "beta"), ("tenant", str(world.tenants["beta"].pk)), ("node", scene["beta_nodes"][0]),
             ("reservation", str(beta.pk)), ("cluster", str(scene["cluster"].pk)), ("q", "beta")]
    urls = ["/", "/calendar/", f"/calendar/events.json?{window}", f"/calendar/availability.json?{window}&pool=h100",
            "/reservations/", "/reservations/new/", "/availability/", "/availability/grid/", "/usage/",
            "/usage.csv", "/account/", "/team/", "/audit/", "/clusters/", "/notifications/",
            "/notifications/deliveries/", "/fleet/", "/health/", f"/clusters/{scene['alpha_cluster'].pk}/",
            f"/reservations/{scene['alpha'].pk}/", f"/reservations/{scene['alpha'].pk}/panel/",
            f"/health/clusters/{scene['alpha_cluster'].pk}/", f"/health/clusters/{scene['alpha_cluster'].pk}/results/",
            f"/reservations/new/?{urlencode({'pool': 'h100', 'start': iso(t0), 'end': iso(t0 + timedelta(hours=2))})}"]
    out = []
    for url in urls:
        out.append((url, {}))
        sep = "&" if "?" in url else "?"
        out.append((url + sep + urlencode(names), {}))
        out.append((url + sep + "all=1&" + urlencode(names[:1]), HTMX))
    return out


@pytest.mark.parametrize("who", WHO)
def test_no_page_partial_or_feed_shows_anything_of_another_tenant(world, scene, t0, who):
    client = _client(world, who)
    for url, headers in page_urls(world, scene, t0):
        response = client.get(url, **headers)
        assert response.status_code in (200, 302, 403), (url, response.status_code)
        assert_no_trace_of_beta(scene, response, url, asked=url)
    alpha_feed = client.get(feed_path(world.tenants["alpha"], world.users[who]))
    assert alpha_feed.status_code == 200
    assert_no_trace_of_beta(scene, alpha_feed, "alpha's feed")


# --- beta's objects by id, slug or hostname: as unknown as an id that does not exist -----------------


def object_requests(world, scene, who):
    """(label, method, url for beta's object, the same url for an object that does not exist, data)."""
    beta, cluster, check = scene["beta"], scene["cluster"], scene["check"]
    channel, delivery, token, membership = scene["channel"], scene["delivery"], scene["token"], scene["membership"]
    end = iso(beta.end + timedelta(hours=1))
    rows = [
        ("reservation", "get", f"/reservations/{beta.pk}/", f"/reservations/{MISSING}/", {}),
        ("panel", "get", f"/reservations/{beta.pk}/panel/", f"/reservations/{MISSING}/panel/", {}),
        ("extend", "post", f"/reservations/{beta.pk}/extend/", f"/reservations/{MISSING}/extend/", {"end": end}),
        ("cancel-page", "get", f"/reservations/{beta.pk}/cancel/", f"/reservations/{MISSING}/cancel/", {}),
        ("cancel", "post", f"/reservations/{beta.pk}/cancel/", f"/reservations/{MISSING}/cancel/",
         {"confirm": "yes"}),
        ("cluster", "get", f"/clusters/{cluster.pk}/", f"/clusters/{MISSING}/", {}),
        ("cluster-teardown", "post", f"/clusters/{cluster.pk}/teardown/", f"/clusters/{MISSING}/teardown/", {}),
        ("cluster-retry", "post", f"/clusters/{cluster.pk}/retry/", f"/clusters/{MISSING}/retry/", {}),
        ("credential", "get", f"/clusters/{cluster.pk}/credentials/ssh_key/",
         f"/clusters/{MISSING}/credentials/ssh_key/", {}),
        ("credential-kubeconfig", "get", f"/clusters/{cluster.pk}/credentials/kubeconfig/",
         f"/clusters/{MISSING}/credentials/kubeconfig/", {}),
        ("check", "get", f"/health/checks/{check.pk}/", f"/health/checks/{MISSING}/", {}),
        ("cluster-health", "get", f"/health/clusters/{cluster.pk}/", f"/health/clusters/{MISSING}/", {}),
        ("cluster-health-results", "get", f"/health/clusters/{cluster.pk}/results/",
         f"/health/clusters/{MISSING}/results/", {}),
        ("cluster-health-run", "post", f"/health/clusters/{cluster.pk}/run/", f"/health/clusters/{MISSING}/run/",
         {"level": "quick"}),
        ("node-health", "get", f"/health/nodes/{scene['beta_node'].hostname}/", "/health/nodes/no-such-node/", {}),
        ("node-check", "post", f"/health/nodes/{scene['beta_node'].hostname}/check/",
         "/health/nodes/no-such-node/check/", {"level": "quick"}),
        ("webhook-edit", "post", f"/notifications/webhooks/{channel.pk}/", f"/notifications/webhooks/{MISSING}/",
         {f"w{channel.pk}-name": "pwned", f"w{channel.pk}-url": "https://evil.example/x"}),
        ("webhook-rotate-page", "get", f"/notifications/webhooks/{channel.pk}/rotate/",
         f"/notifications/webhooks/{MISSING}/rotate/", {}),
        ("webhook-rotate", "post", f"/notifications/webhooks/{channel.pk}/rotate/",
         f"/notifications/webhooks/{MISSING}/rotate/", {"confirm": "yes"}),
        ("webhook-delete", "post", f"/notifications/webhooks/{channel.pk}/delete/",
         f"/notifications/webhooks/{MISSING}/delete/", {}),
        ("channel-test", "post", f"/notifications/channels/{channel.pk}/test/",
         f"/notifications/channels/{MISSING}/test/", {}),
        ("channel-clear", "post", f"/notifications/channels/{channel.pk}/clear/",
         f"/notifications/channels/{MISSING}/clear/", {}),
        ("delivery-retry", "post", f"/notifications/deliveries/{delivery.pk}/retry/",
         f"/notifications/deliveries/{MISSING}/retry/", {}),
        ("member-role", "post", f"/team/members/{membership.pk}/role/", f"/team/members/{MISSING}/role/",
         {"role": "viewer"}),
        ("member-remove", "post", f"/team/members/{membership.pk}/remove/", f"/team/members/{MISSING}/remove/", {}),
        ("token-revoke", "post", f"/account/tokens/{token.pk}/revoke/", f"/account/tokens/{MISSING}/revoke/", {}),
        ("ical-with-own-token", "get",
         feed_path(world.tenants["alpha"], world.users[who]).replace("/ical/alpha/", "/ical/beta/"),
         feed_path(world.tenants["alpha"], world.users[who]).replace("/ical/alpha/", "/ical/nosuch/"), {}),
        # The admin: signed-in tenant users are sent to its sign-in page, whatever the object.
        ("admin-reservation", "get", f"/admin/reservations/reservation/{beta.pk}/change/",
         f"/admin/reservations/reservation/{MISSING}/change/", {}),
        ("admin-tenant", "get", f"/admin/tenants/tenant/{world.tenants['beta'].pk}/change/",
         f"/admin/tenants/tenant/{MISSING}/change/", {}),
        ("admin-cluster", "get", f"/admin/provisioning/virtualcluster/{cluster.pk}/change/",
         f"/admin/provisioning/virtualcluster/{MISSING}/change/", {}),
    ]
    return rows


def _ask(client, method, url, data, headers):
    """The response, and for a redirect the messages the page it leads to shows."""
    response = getattr(client, method)(url, data, **headers)
    if response.status_code != 302:
        return response, None
    return response, [str(m) for m in client.get(response["Location"]).context["messages"]]


def beta_state(scene):
    beta = Reservation.objects.get(pk=scene["beta"].pk)
    channel = type(scene["channel"]).objects.filter(pk=scene["channel"].pk).values().first()
    return (beta.status, beta.name, beta.period, VirtualCluster.objects.get(pk=scene["cluster"].pk).status,
            channel, Membership.objects.filter(pk=scene["membership"].pk).values_list("role", flat=True).first(),
            ApiToken.objects.filter(pk=scene["token"].pk).values_list("revoked", flat=True).first(),
            HealthCheck.objects.filter(node=scene["beta_node"]).count())


# The team and account pages' forms answer a member or token that is not the tenant's or user's (beta's, or none)
# with a redirect back and the same words ("No such member of this tenant."), as checked above; the admin sends
# every tenant user to its sign-in page.
TEAM_FORMS = {"member-role", "member-remove", "token-revoke", "admin-reservation", "admin-tenant", "admin-cluster"}

# Pages only staff use: every tenant user is refused whatever the hostname, so the refusal says nothing.
STAFF_ONLY = {"node-health", "node-check"}


@pytest.mark.parametrize("who", WHO)
def test_another_tenants_objects_answer_as_ones_that_do_not_exist(world, scene, who):
    client = _client(world, who)
    before = beta_state(scene)
    for label, method, url, missing_url, data in object_requests(world, scene, who):
        for headers in ({}, HTMX):
            response, said = _ask(client, method, url, data, headers)
            missing, said_missing = _ask(client, method, missing_url, data, headers)
            assert response.status_code == missing.status_code, (label, headers, response.status_code,
                                                                 missing.status_code)
            if response.status_code == 302:  # refused with a message on the page it leads to: the same message
                assert (response["Location"].replace(url, missing_url), said) == (missing["Location"], said_missing), \
                    label
                continue
            # The same page too, word for word, but for the address asked for.
            assert _sans_csrf(response).replace(url, missing_url) == _sans_csrf(missing), label
            expected = 403 if label in STAFF_ONLY else 404
            if response.status_code != 404:
                # Only a refusal that holds whatever the id (a role that may not use such objects at all).
                assert response.status_code == expected or response.status_code == 403, (label, response.status_code)
            assert_no_trace_of_beta(scene, response, label)
    if who == "alpha-lead":  # a lead may use every such object of their own: beta's must be a 404 to them
        for label, method, url, _missing, data in object_requests(world, scene, who):
            if label not in STAFF_ONLY | TEAM_FORMS:
                assert getattr(client, method)(url, data).status_code == 404, label
    assert beta_state(scene) == before


@pytest.mark.parametrize("who", WHO)
def test_switching_to_or_booking_for_another_tenant_is_refused_without_naming_it(world, scene, t0, who):
    client = _client(world, who)
    switched = client.post("/tenant/switch/", {"tenant": "beta", "next": "/"})
    assert_no_trace_of_beta(scene, switched, "switch")
    page = client.get("/reservations/")  # still alpha's
    assert_no_trace_of_beta(scene, page, "after switch")
    count = Reservation.objects.filter(tenant=world.tenants["beta"]).count()
    start = t0 + timedelta(hours=5)
    data = {"tenant": "beta", "pool": "h100", "node_count": 1, "start": iso(start),
            "end": iso(start + timedelta(hours=1)), "name": "pwned"}
    for url in ("/reservations/new/", "/reservations/preview/"):
        response = client.post(url, data)
        assert_no_trace_of_beta(scene, response, url, asked="?")
        unknown = client.post(url, {**data, "tenant": "nosuch"})
        assert response.status_code == unknown.status_code, url
        assert _sans_csrf(response).replace("beta", "X") == _sans_csrf(unknown).replace("nosuch", "X"), url
    assert Reservation.objects.filter(tenant=world.tenants["beta"]).count() == count
    added = client.post("/team/members/", {"username": "beta-viewer", "role": "viewer"})
    assert_no_trace_of_beta(scene, added, "team-add")


def test_refusals_caused_by_another_tenants_booking_do_not_name_it(world, scene, t0):
    """alpha runs into beta's time: extending onto the node beta books next, booking more nodes than beta
    leaves free. The refusal says no (409), and never whose booking or which of its nodes is in the way."""
    from reservations.services import reservation_create

    alpha_node = scene["alpha"].allocations.get().node
    later = reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"], pool=world.pool,
                               node_count=4, start=t0 + timedelta(hours=2), end=t0 + timedelta(hours=4),
                               name="beta-secret-later")
    assert later.allocations.filter(node=alpha_node).exists()
    client = _client(world, "alpha-lead")
    extend = client.post(f"/reservations/{scene['alpha'].pk}/extend/", {"end": iso(t0 + timedelta(hours=3))})
    assert extend.status_code == 409, extend.status_code
    assert_no_trace_of_beta(scene, extend, "extend")
    data = {"tenant": "alpha", "pool": "h100", "node_count": 3, "start": iso(t0),
            "end": iso(t0 + timedelta(hours=1)), "name": "too-many"}
    for url in ("/reservations/new/", "/reservations/preview/"):
        for headers in ({}, HTMX):
            response = client.post(url, data, **headers)
            assert response.status_code in (200, 400, 409), (url, response.status_code)
            assert_no_trace_of_beta(scene, response, url)
            assert "beta-secret-later" not in response.content.decode()


def test_the_probe_finds_beta_where_it_is_shown(world, scene, t0):
    """A control for the checks above: staff's fleet timeline does show beta's booking, so the probe
    would see a page that leaked it."""
    response = _client(world, "staff").get("/fleet/")
    with pytest.raises(pytest.fail.Exception):
        assert_no_trace_of_beta(scene, response, "fleet as staff")
    beta_lead = _client(world, "beta-lead")  # beta's own lead is warned of its broken webhook and failed delivery
    alerts = beta_lead.get("/notifications/").content.decode()
    assert 'data-broken="1" data-failed="1"' in alerts and "beta-ci" in alerts
    assert f'data-delivery="{scene["delivery"].pk}"' in beta_lead.get("/notifications/deliveries/").content.decode()


@pytest.mark.parametrize("current", ["alpha", "beta"])
def test_a_viewer_of_beta_who_leads_alpha_gets_none_of_betas_lead_only_pages(world, scene, current):
    """A lead of one tenant and viewer of another has the viewer's rights in the second, whichever tenant the
    switcher shows: beta's audit, usage, channels and deliveries stay closed to them (they are beta's leads')."""
    from portal.core.models import AuditLog

    Membership.objects.create(user=world.users["alpha-lead"], tenant=world.tenants["beta"], role="viewer")
    assert AuditLog.objects.filter(tenant_id=world.tenants["beta"].pk).exists()
    client = _client(world, "alpha-lead")
    client.post("/tenant/switch/", {"tenant": current, "next": "/"})
    before = beta_state(scene)
    audit = client.get(f"/audit/?tenant={world.tenants['beta'].pk}")
    assert audit.status_code == 200
    assert {row["entry"].tenant_id for row in audit.context["rows"]} <= {world.tenants["alpha"].pk}
    assert [t for t, _name in audit.context["tenants"]] == [world.tenants["alpha"].pk]
    usage = client.get("/usage/?tenant=beta")
    assert usage.status_code == (200 if current == "alpha" else 403)
    if current == "alpha":
        assert [line.tenant.slug for line in usage.context["lines"]] in ([], ["alpha"])
    deliveries = client.get("/notifications/deliveries/")
    assert f'data-delivery="{scene["delivery"].pk}"' not in deliveries.content.decode()
    channel, delivery = scene["channel"], scene["delivery"]
    for url in (f"/notifications/webhooks/{channel.pk}/rotate/", f"/notifications/webhooks/{channel.pk}/delete/",
                f"/notifications/channels/{channel.pk}/test/", f"/notifications/channels/{channel.pk}/clear/",
                f"/notifications/deliveries/{delivery.pk}/retry/"):
        refused = client.post(url, {"confirm": "yes"}).status_code
        missing = client.post(url.replace(str(channel.pk), str(MISSING)).replace(str(delivery.pk), str(MISSING)),
                              {"confirm": "yes"}).status_code
        assert refused == missing == (404 if current == "alpha" else 403), (url, refused, missing)
    assert client.get(f"/clusters/{scene['cluster'].pk}/credentials/ssh_key/").status_code == 403  # a viewer's
    assert beta_state(scene) == before
