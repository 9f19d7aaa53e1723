"""GET/PATCH /api/v1/clusters/ and the cluster page: tenant scope, roles, and no secret in any listing."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client

from portal.core.models import AuditLog
from provisioning import services
from provisioning.models import ClusterCredential, VirtualCluster

from .conftest import book

pytestmark = pytest.mark.django_db


@pytest.fixture
def clusters(world, t0):
    """Alpha: one ready cluster and one pending; beta: one ready."""
    out = {}
    for who, offset in (("alpha-member", 0), ("beta-lead", 0), ("alpha-lead", 6)):
        book(world, who, t0 + timedelta(hours=offset))
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    for cluster in VirtualCluster.objects.select_related("reservation", "tenant"):
        if cluster.reservation.period.lower == t0:
            services.cluster_provision(cluster_id=cluster.pk)
            out[cluster.tenant.slug] = cluster
        else:
            out["alpha2"] = cluster
    for cluster in out.values():
        cluster.refresh_from_db()
    return out


def private_key_of(cluster) -> str:
    from provisioning import crypto

    credential = ClusterCredential.objects.current().get(cluster=cluster, kind="ssh_key")
    return crypto.decrypt(credential.ciphertext).decode()


def test_list_shows_only_the_users_tenants_and_staff_sees_all(world, clusters):
    alpha = world.client("alpha-viewer").get("/api/v1/clusters/")
    assert alpha.status_code == 200
    assert {c["tenant"] for c in alpha.json()["results"]} == {"alpha"}
    assert alpha.json()["count"] == 2
    staff = world.client("staff").get("/api/v1/clusters/").json()
    assert staff["count"] == 3
    filtered = world.client("alpha-lead").get("/api/v1/clusters/?status=ready").json()
    assert [c["id"] for c in filtered["results"]] == [clusters["alpha"].pk]
    bad = world.client("alpha-lead").get("/api/v1/clusters/?status=bogus")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid"
    # ?reservation=<id> (a query string, so digits in a string); another tenant's id finds nothing.
    own = clusters["alpha2"]
    by_reservation = world.client("alpha-lead").get(f"/api/v1/clusters/?reservation={own.reservation_id}")
    assert by_reservation.status_code == 200, by_reservation.json()
    assert [c["id"] for c in by_reservation.json()["results"]] == [own.pk]
    foreign = world.client("alpha-lead").get(f"/api/v1/clusters/?reservation={clusters['beta'].reservation_id}")
    assert foreign.status_code == 200 and foreign.json()["count"] == 0
    for value, message in (("abc", "valid integer"), ("0", "greater than or equal to 1"), ("1.5", "valid integer")):
        bad = world.client("alpha-lead").get(f"/api/v1/clusters/?reservation={value}")
        assert bad.status_code == 400 and message in bad.json()["fields"]["reservation"], (value, bad.json())


def test_detail_has_phases_with_times_connection_and_credentials_without_secrets(world, clusters):
    cluster = clusters["alpha"]
    body = world.client("alpha-viewer").get(f"/api/v1/clusters/{cluster.pk}/").json()
    assert body["status"] == "ready" and body["tenant"] == "alpha" and body["pool"] == "h100"
    assert [p["phase"] for p in body["phases"]] == [
        "pending", "allocating_nodes", "configuring_network", "attaching_storage", "installing_drivers",
        "running_acceptance_tests", "ready"]
    assert all(p["at"].endswith("Z") for p in body["phases"])
    assert body["connection"]["slurm_account"] == "alpha"
    assert body["network"]["vlan_id"] and body["network"]["cidr"]
    assert body["storage"]["size_gib"] == 1024
    assert body["spec"]["cuda_version"] == "12.8"
    assert len(body["nodes"]) == 1
    [credential] = body["credentials"]
    assert credential["kind"] == "ssh_key" and credential["fingerprint"].startswith("SHA256:")
    assert credential["public_part"].startswith("ssh-ed25519 ")
    # A viewer may not download (403 there), so no link is offered: see the test below.
    assert credential["download_url"] is None
    text = str(body)
    assert "PRIVATE KEY" not in text
    assert ClusterCredential.objects.get(cluster=cluster).ciphertext not in text


def test_other_tenants_clusters_are_404_with_the_envelope(world, clusters):
    beta = clusters["beta"]
    for who in ("alpha-lead", "alpha-viewer"):
        for url in (f"/api/v1/clusters/{beta.pk}/", f"/api/v1/clusters/{beta.pk}/credentials/ssh_key/"):
            response = world.client(who).get(url)
            assert response.status_code == 404, (who, url)
            assert response.json() == {"code": "not_found", "detail": "Not found.", "fields": {}}
        for method, url, body in (("patch", f"/api/v1/clusters/{beta.pk}/", {"cuda_version": "12.6"}),
                                  ("post", f"/api/v1/clusters/{beta.pk}/teardown/", {})):
            response = getattr(world.client(who), method)(url, body, format="json")
            assert response.status_code == 404
    assert world.client(None).get("/api/v1/clusters/").status_code == 401


def test_credentials_download_for_leads_and_members_only(world, clusters):
    cluster = clusters["alpha"]
    url = f"/api/v1/clusters/{cluster.pk}/credentials/ssh_key/"
    expected = private_key_of(cluster)
    for who in ("alpha-lead", "alpha-member"):
        response = world.client(who).get(url)
        assert response.status_code == 200, who
        assert response.content.decode() == expected
        assert expected.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        assert response["Content-Disposition"] == f'attachment; filename="alpha-r{cluster.reservation_id}-id_ed25519"'
        assert response["Cache-Control"] == "no-store"
    for who in ("alpha-viewer", "staff"):
        response = world.client(who).get(url)
        assert response.status_code == 403 and response.json()["code"] == "permission_denied"
    assert world.client("alpha-lead").get(f"/api/v1/clusters/{cluster.pk}/credentials/kubeconfig/").status_code == 404
    assert world.client("alpha-lead").get(f"/api/v1/clusters/{cluster.pk}/credentials/passwd/").status_code == 404
    downloads = AuditLog.objects.filter(action="cluster.credential_download")
    assert downloads.count() == 2 and {a.actor.username for a in downloads} == {"alpha-lead", "alpha-member"}


def test_download_url_is_given_only_to_those_who_may_download(world, clusters):
    """download_url stays in every credential's shape, but is null for a role the download refuses (a
    viewer, platform staff): a link offered to them only led to a 403."""
    cluster = clusters["alpha"]
    url = f"/api/v1/clusters/{cluster.pk}/credentials/ssh_key/"
    for who, offered in (("alpha-lead", True), ("alpha-member", True), ("alpha-viewer", False), ("staff", False)):
        client = world.client(who)
        detail = client.get(f"/api/v1/clusters/{cluster.pk}/").json()
        listed = next(c for c in client.get("/api/v1/clusters/").json()["results"] if c["id"] == cluster.pk)
        for body in (detail, listed):
            [credential] = body["credentials"]
            assert "download_url" in credential, who
            assert credential["download_url"] == (url if offered else None), who
        assert client.get(url).status_code == (200 if offered else 403), who


def test_a_head_request_for_a_credential_is_answered_but_recorded_as_no_download(world, clusters):
    """HEAD (a link checker, a download manager probing the size, curl -I) gets GET's status and headers but
    no body: nothing is downloaded, so nothing may be audited as a credential download. Its refusals stay
    the same as GET's (a viewer 403, another tenant 404) and are not recorded either."""
    cluster = clusters["alpha"]
    api = f"/api/v1/clusters/{cluster.pk}/credentials/ssh_key/"
    page = f"/clusters/{cluster.pk}/credentials/ssh_key/"
    for response in (world.client("alpha-member").head(api), page_client(world, "alpha-member").head(page)):
        assert response.status_code == 200
        assert response.content == b""
        assert response["Content-Disposition"] == f'attachment; filename="alpha-r{cluster.reservation_id}-id_ed25519"'
        assert response["Cache-Control"] == "no-store"
    assert world.client("alpha-viewer").head(api).status_code == 403
    assert page_client(world, "alpha-viewer").head(page).status_code == 403
    assert world.client("beta-lead").head(api).status_code == 404
    assert not AuditLog.objects.filter(action="cluster.credential_download").exists()
    # A GET still downloads, and is recorded once.
    assert world.client("alpha-member").get(api).content.decode() == private_key_of(cluster)
    assert AuditLog.objects.filter(action="cluster.credential_download").count() == 1


def test_spec_patch_while_pending(world, clusters):
    pending = clusters["alpha2"]
    url = f"/api/v1/clusters/{pending.pk}/"
    ok = world.client("alpha-lead").patch(url, {"mig_profile": "3g.40gb", "shared_storage_gib": 512}, format="json")
    assert ok.status_code == 200, ok.json()
    assert ok.json()["spec"]["mig_profile"] == "3g.40gb" and ok.json()["spec"]["shared_storage_gib"] == 512

    bad = world.client("alpha-lead").patch(url, {"mig_profile": "9g.1gb", "default_memory_per_gpu_gib": 0},
                                           format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid"
    assert set(bad.json()["fields"]) == {"default_memory_per_gpu_gib"}  # min_value caught by the serializer
    bad = world.client("alpha-lead").patch(url, {"mig_profile": "9g.1gb"}, format="json")
    assert bad.status_code == 400 and "mig_profile" in bad.json()["fields"]
    assert world.client("alpha-viewer").patch(url, {"cuda_version": "12.6"}, format="json").status_code == 403
    pending.refresh_from_db()
    assert pending.mig_profile == "3g.40gb"

    # The tenant's storage quota lowered below the cluster's volume since (found by fuzzing): changing
    # another field still works, and only a storage change is judged against the new quota.
    world.tenants["alpha"].storage_quota_tib = 0
    world.tenants["alpha"].save(update_fields=["storage_quota_tib"])
    ok = world.client("alpha-lead").patch(url, {"cuda_version": "12.6"}, format="json")
    assert ok.status_code == 200 and ok.json()["spec"]["shared_storage_gib"] == 512, ok.json()
    bad = world.client("alpha-lead").patch(url, {"shared_storage_gib": 256}, format="json")
    assert bad.status_code == 400 and set(bad.json()["fields"]) == {"shared_storage_gib"}

    ready = clusters["alpha"]
    late = world.client("alpha-lead").patch(f"/api/v1/clusters/{ready.pk}/", {"cuda_version": "12.6"}, format="json")
    assert late.status_code == 409 and late.json()["code"] == "invalid_state"


def test_retry_is_staff_only_and_teardown_needs_a_running_cluster(world, clusters):
    cluster = clusters["alpha"]
    response = world.client("alpha-lead").post(f"/api/v1/clusters/{cluster.pk}/retry/", {}, format="json")
    assert response.status_code == 403
    response = world.client("staff").post(f"/api/v1/clusters/{cluster.pk}/retry/", {}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "invalid_state"
    # Provisioned a day ahead: the reservation is provisioning, so the lead may tear it down early.
    response = world.client("alpha-lead").post(f"/api/v1/clusters/{cluster.pk}/teardown/", {}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "tearing_down"
    assert response.json()["reservation_status"] == "ending"


def test_list_query_count_does_not_grow_with_clusters(world, clusters, django_assert_max_num_queries):
    with django_assert_max_num_queries(12):
        assert world.client("staff").get("/api/v1/clusters/").json()["count"] == 3


# --- the HTML page -----------------------------------------------------------------------------


def page_client(world, who) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


def test_cluster_page_shows_phases_connection_and_downloads_for_members(world, clusters):
    cluster = clusters["alpha"]
    html = page_client(world, "alpha-member").get(f"/clusters/{cluster.pk}/").content.decode()
    assert '<a class="brand" href="/">GPU Portal</a>' in html  # the portal's own layout
    for text in ("Allocating nodes", "Running acceptance tests", "Ready", "Slurm account",
                 f"/clusters/{cluster.pk}/credentials/ssh_key/", "Tear down now"):
        assert text in html, text
    assert "PRIVATE KEY" not in html
    viewer = page_client(world, "alpha-viewer").get(f"/clusters/{cluster.pk}/").content.decode()
    assert "/credentials/ssh_key/" not in viewer and "Tear down now" not in viewer
    refused = page_client(world, "alpha-viewer").get(f"/clusters/{cluster.pk}/credentials/ssh_key/")
    assert refused.status_code == 403 and refused["Content-Type"].startswith("text/html")
    refused_html = refused.content.decode()
    assert 'role="alert"' in refused_html and f'href="/clusters/{cluster.pk}/"' in refused_html
    assert "PRIVATE KEY" not in refused_html
    download = page_client(world, "alpha-member").get(f"/clusters/{cluster.pk}/credentials/ssh_key/")
    assert download.status_code == 200 and download.content.decode() == private_key_of(cluster)
    assert page_client(world, "beta-lead").get(f"/clusters/{cluster.pk}/").status_code == 404
    listing = page_client(world, "alpha-viewer").get("/clusters/").content.decode()
    assert f'href="/clusters/{cluster.pk}/"' in listing and f'href="/clusters/{clusters["beta"].pk}/"' not in listing
    partial = page_client(world, "alpha-viewer").get(f"/clusters/{cluster.pk}/", HTTP_HX_REQUEST="true")
    assert partial.content.decode().lstrip().startswith('<section class="card" id="cluster-status"')
    assert Client().get(f"/clusters/{cluster.pk}/").status_code == 302


def test_the_cluster_pages_connection_details_are_labelled_in_words(world, clusters):
    """The Connection table showed the backend's keys as labels ("login_host", "ssh_user", "slurm_account"),
    on the cluster page and in the reservation page's cluster section."""
    import re

    cluster = clusters["alpha"]
    assert {"login_host", "ssh_user", "slurm_account"} <= set(cluster.connection)
    client = page_client(world, "alpha-member")
    for url in (f"/clusters/{cluster.pk}/", f"/reservations/{cluster.reservation_id}/"):
        html = client.get(url).content.decode()
        table = html[html.index('<table class="kv">'):]
        labels = re.findall(r"<th[^>]*>(.*?)</th>", table[:table.index("</table>")])
        assert labels and not [label for label in labels if "_" in label], (url, labels)
        for words in ("Login host", "SSH user", "Slurm account"):
            assert words in labels, (url, labels)
        assert f"<code>{cluster.connection['login_host']}</code>" in html  # the values themselves unchanged


def test_the_cluster_page_and_its_polled_fragment_are_cached_apart(world, clusters):
    """/clusters/<pk>/ answers the whole page, or (HX-Request) the status fragment it polls every 3 s, at one URL.
    Without Vary: HX-Request a browser keeps one cached copy for both: Back to the page showed the last poll's
    bare fragment without the portal's layout (htmx's documented caching pitfall)."""
    from django.utils.cache import cc_delim_re

    cluster = clusters["alpha"]
    client = page_client(world, "alpha-member")
    for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
        response = client.get(f"/clusters/{cluster.pk}/", **headers)
        assert response.status_code == 200
        assert "hx-request" in {h.strip().lower() for h in cc_delim_re.split(response.get("Vary", ""))}


def test_teardown_button_posts_and_staff_can_retry_from_the_page(world, clusters, settings):
    cluster = clusters["alpha"]
    response = page_client(world, "alpha-member").post(f"/clusters/{cluster.pk}/teardown/")
    assert response.status_code == 302
    cluster.refresh_from_db()
    assert cluster.status == "tearing_down"
    assert page_client(world, "alpha-member").get(f"/clusters/{cluster.pk}/teardown/").status_code == 405


def test_the_reservation_page_and_dashboard_show_the_cluster(world, clusters):
    cluster = clusters["alpha"]
    html = page_client(world, "alpha-member").get(f"/reservations/{cluster.reservation_id}/").content.decode()
    assert f'href="/clusters/{cluster.pk}/"' in html and "Running acceptance tests" in html
    assert f"/clusters/{cluster.pk}/credentials/ssh_key/" in html and "PRIVATE KEY" not in html
    viewer = page_client(world, "alpha-viewer").get(f"/reservations/{cluster.reservation_id}/").content.decode()
    assert "Running acceptance tests" in viewer and "/credentials/ssh_key/" not in viewer
    dashboard = page_client(world, "alpha-viewer").get("/").content.decode()
    assert f'<a class="badge cl-ready" href="/clusters/{cluster.pk}/"' in dashboard


def test_admin_lists_clusters_with_phases_and_never_a_secret(world, clusters):
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser(username="root", password="pw-Long-enough-1")
    client = Client()
    client.force_login(admin)
    cluster = clusters["alpha"]
    listing = client.get("/admin/provisioning/virtualcluster/")
    assert listing.status_code == 200 and f">{cluster.pk}<" in listing.content.decode()
    page = client.get(f"/admin/provisioning/virtualcluster/{cluster.pk}/change/").content.decode()
    assert "running_acceptance_tests" in page and "SHA256:" in page
    assert ClusterCredential.objects.get(cluster=cluster).ciphertext not in page and "PRIVATE KEY" not in page
    response = client.post("/admin/provisioning/virtualcluster/", {
        "action": "retry_clusters", "_selected_action": [cluster.pk]}, follow=True)
    assert "only a failed cluster can be retried" in response.content.decode()
    response = client.post("/admin/provisioning/virtualcluster/", {
        "action": "teardown_clusters", "_selected_action": [cluster.pk]}, follow=True)
    assert "1 cluster tearing down." in response.content.decode()  # was "1 cluster(s) tearing down."


def test_a_storage_change_leaves_room_for_the_tenants_overlapping_clusters(world, t0):
    """A member's volume within the quota on its own could take the room of a lead's overlapping cluster,
    which then failed (and its booking with it) when provisioned (found in a review). The change is judged
    against what the tenant's other clusters in that window hold; a booking that does not overlap does not
    count; a cancelled booking's cluster can no longer change."""
    from reservations.services import reservation_cancel

    mine = book(world, "alpha-member", t0)
    lead = book(world, "alpha-lead", t0)
    later = book(world, "alpha-lead", t0 + timedelta(days=3))
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    services.cluster_create_for_reservation(reservation_id=later.pk)  # pending, three days later
    mine_c, lead_c = (VirtualCluster.objects.get(reservation=r) for r in (mine, lead))
    quota = world.tenants["alpha"].storage_quota_tib * 1024
    assert lead_c.shared_storage_gib > 0
    member = world.client("alpha-member")
    r = member.patch(f"/api/v1/clusters/{mine_c.pk}/", {"shared_storage_gib": quota}, format="json")
    assert r.status_code == 400 and set(r.json()["fields"]) == {"shared_storage_gib"}, r.json()
    left = quota - lead_c.shared_storage_gib  # the later booking's cluster does not overlap: not counted
    assert f"at most {left} GiB" in r.json()["fields"]["shared_storage_gib"]
    assert member.patch(f"/api/v1/clusters/{mine_c.pk}/", {"shared_storage_gib": left},
                        format="json").status_code == 200
    reservation_cancel(actor=world.users["alpha-member"], reservation=mine)
    r = member.patch(f"/api/v1/clusters/{mine_c.pk}/", {"cuda_version": "12.6"}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"


def test_retry_is_offered_on_the_page_only_where_it_would_be_accepted(world, clusters):
    """A cluster that failed while provisioning, of a booking whose window is over, cannot be retried
    (cluster_retry: there is nothing to provision); the page offered staff the button all the same."""
    from psycopg.types.range import Range

    from reservations.models import Reservation

    cluster = clusters["alpha"]
    now = cluster.reservation.start - timedelta(days=3)
    Reservation.objects.filter(pk=cluster.reservation_id).update(
        status="failed", period=Range(now - timedelta(hours=3), now - timedelta(hours=1), "[)"))
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="failed", failed_during="provisioning")
    staff = page_client(world, "staff")
    page = staff.get(f"/clusters/{cluster.pk}/").content.decode()
    assert "Retry (staff)" not in page
    refused = staff.post(f"/clusters/{cluster.pk}/retry/", follow=True).content.decode()
    assert "has ended; there is nothing to provision" in refused
    # A failed teardown can be retried after the window, and is offered.
    VirtualCluster.objects.filter(pk=cluster.pk).update(failed_during="teardown")
    assert "Retry (staff)" in staff.get(f"/clusters/{cluster.pk}/").content.decode()


def test_a_spec_patch_naming_a_field_that_cannot_change_is_refused_not_ignored(world, clusters):
    """PATCH {"orchestrator": "kubernetes"} (or a typo of a spec field) answered 200 with the spec unchanged and
    an audit entry for a change that never happened: the serializer dropped what it did not know before
    cluster_configure, whose own rule is 'cannot be changed'. Now 400 naming the field; nothing changes."""
    pending = clusters["alpha2"]
    url = f"/api/v1/clusters/{pending.pk}/"
    audits = AuditLog.objects.filter(action="cluster.configure").count()
    for body in ({"orchestrator": "kubernetes"}, {"cuda_version": "12.6", "shared_storage": 10}):
        response = world.client("alpha-lead").patch(url, body, format="json")
        assert response.status_code == 400, (body, response.json())
        unknown = next(k for k in body if k not in ("cuda_version",))
        assert response.json()["code"] == "invalid" and unknown in response.json()["fields"], response.json()
    pending.refresh_from_db()
    assert pending.orchestrator == "slurm" and pending.cuda_version == "12.8"
    assert AuditLog.objects.filter(action="cluster.configure").count() == audits


def test_read_only_pages_answer_only_get_and_head(world, clusters):
    """The portal's read-only pages and the credential download answered any method: OPTIONS (which passes the
    CSRF check, as a safe method) on the credential URL returned the key and was audited as a download, and
    PUT or DELETE to a page answered 200 with the page. They now answer 405 naming GET and HEAD, and nothing
    is downloaded or recorded."""
    cluster = clusters["alpha"]
    client = page_client(world, "alpha-member")  # the test client skips the CSRF check: the view answers
    credential = f"/clusters/{cluster.pk}/credentials/ssh_key/"
    pages = ["/", "/calendar/", f"/reservations/{cluster.reservation_id}/",
             f"/reservations/{cluster.reservation_id}/panel/", "/availability/", "/availability/grid/", "/team/",
             "/clusters/", f"/clusters/{cluster.pk}/", credential]
    for url in pages:
        assert client.get(url).status_code == 200, url
        for method in ("options", "put", "delete", "patch"):
            response = getattr(client, method)(url)
            assert response.status_code == 405, (method, url, response.status_code)
            assert response["Allow"] == "GET, HEAD", (method, url)
            assert b"BEGIN OPENSSH PRIVATE KEY" not in response.content
    browser = Client(enforce_csrf_checks=True)  # as a browser meets it: OPTIONS, a safe method, passes CSRF
    browser.force_login(world.users["alpha-member"])
    response = browser.options(credential)
    assert response.status_code == 405 and b"BEGIN OPENSSH PRIVATE KEY" not in response.content
    staff = page_client(world, "staff")
    assert staff.get("/fleet/").status_code == 200 and staff.options("/fleet/").status_code == 405
    account = client.options("/account/")  # a page with a form: GET and POST
    assert account.status_code == 405 and account["Allow"] == "GET, POST"
    assert AuditLog.objects.filter(action="cluster.credential_download").count() == 1  # the one GET above


def test_each_credential_link_says_which_credential_it_downloads(world, clusters):
    """A Kubernetes cluster holds several credentials (an SSH key and a kubeconfig), and every link read just
    "download": a screen reader's list of links gave "download, download" with nothing to tell them apart."""
    import re

    from django.db import transaction

    cluster = clusters["alpha"]
    with transaction.atomic():
        services._store_secret(cluster, "kubeconfig", "apiVersion: v1\nkind: Config\n")
    for path in (f"/clusters/{cluster.pk}/", f"/reservations/{cluster.reservation_id}/"):
        html = page_client(world, "alpha-member").get(path).content.decode()
        links = re.findall(r'<a\b([^>]*href="/clusters/\d+/credentials/[^"]+/"[^>]*)>(.*?)</a>', html, re.S)
        names = [(re.search(r'aria-label="([^"]*)"', attrs) or re.search(r"(.*)", re.sub(r"<[^>]+>", " ", text)))
                 .group(1) for attrs, text in links]
        names = [" ".join(n.split()) for n in names]
        assert len(names) == 2, (path, names)
        assert len(set(names)) == 2 and all(n.lower() != "download" for n in names), (path, names)
        assert any("SSH key" in n for n in names) and any("Kubeconfig" in n for n in names), (path, names)


def test_every_time_on_the_cluster_pages_names_its_zone(world, clusters):
    """The cluster list and page showed a window as "2026-12-03 19:00 → 2026-12-03 21:00 JST" (the start with no
    zone) and each phase's time as a bare "19:00:05": a reader could not tell which zone they were in."""
    from zoneinfo import ZoneInfo

    from tests.zoned import unzoned_times

    cluster = clusters["alpha"]
    start = cluster.reservation.start.astimezone(ZoneInfo("Asia/Tokyo"))
    client = page_client(world, "alpha-member")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    for path in ("/clusters/", f"/clusters/{cluster.pk}/"):
        html = client.get(path).content.decode()
        assert f"{start:%a %-d %b %H:%M} JST →" in html, path  # the site's one format, as on every other page
        text = re.sub(r"<[^>]*>", " ", html)
        assert not re.search(r"\d{4}-\d\d-\d\d", text), (path, re.findall(r".{0,60}\d{4}-\d\d-\d\d.{0,20}", text))
        assert not unzoned_times(html), (path, unzoned_times(html))
    status = client.get(f"/clusters/{cluster.pk}/", HTTP_HX_REQUEST="true").content.decode()
    assert status.count(" JST") >= 2 and not unzoned_times(status), unzoned_times(status)


def test_the_schema_types_a_clusters_and_a_reservations_nested_objects_as_they_are_answered(world, clusters):
    # A cluster's spec, network, storage and credentials, and a reservation's cluster, were documented as objects
    # of anything: a generated client got untyped dictionaries (nothing said storage.size_gib is an integer, a
    # credential's download_url may be null, or a reservation's cluster carries orchestrator and cuda_version),
    # and reservation_status was any string where a reservation's status is StatusEnum.
    import yaml
    from openapi_schema_validator import OAS30Validator

    spec = yaml.safe_load(world.client("staff").get("/api/schema/").content)
    schemas = spec["components"]["schemas"]

    def target(prop):
        ref = prop.get("$ref") or next(r["$ref"] for r in prop.get("allOf", []) + prop.get("oneOf", [])
                                       if "$ref" in r)
        return schemas[ref.rsplit("/", 1)[1]]

    cluster = schemas["Cluster"]["properties"]
    assert set(target(cluster["spec"])["properties"]) == {
        "orchestrator", "orchestrator_version", "cuda_version", "mig_profile", "default_memory_per_gpu_gib",
        "shared_storage_gib"}
    assert target(cluster["network"])["properties"]["vlan_id"]["nullable"] is True
    assert cluster["storage"]["nullable"] is True and cluster["storage"]["properties"]["size_gib"]["type"] == "integer"
    credential = schemas[cluster["credentials"]["items"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert credential["download_url"]["nullable"] is True
    assert cluster["reservation_status"] == {"$ref": "#/components/schemas/StatusEnum"}
    booked = target(schemas["Reservation"]["properties"]["cluster"])
    assert set(booked["properties"]) == set(booked["required"]) == {"orchestrator", "cuda_version"}
    # What the server answers validates against it, for each reader.
    def errors(path, body):
        schema = spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        validator = OAS30Validator({**schema, "components": spec["components"]})
        return [(e.message, list(e.absolute_path)) for e in validator.iter_errors(body)]

    for who in ("alpha-lead", "alpha-viewer", "staff"):
        client = world.client(who)
        assert errors("/api/v1/clusters/", client.get("/api/v1/clusters/").json()) == []
        assert errors("/api/v1/clusters/{id}/", client.get(f"/api/v1/clusters/{clusters['alpha'].pk}/").json()) == []
        assert errors("/api/v1/reservations/", client.get("/api/v1/reservations/").json()) == []


def test_the_cluster_status_writes_its_times_as_the_site_does_with_their_date(world, clusters):
    """The cluster status said "since 2026-12-06 16:58:08 CET" where every other page writes "Sun 6 Dec 16:58 CET",
    and each phase's time was a bare "16:58:08 CET": a cluster whose phases ran across midnight (a retry the next
    morning) showed times that read as if they were on one day. Each phase time now carries its date."""
    from zoneinfo import ZoneInfo

    from provisioning.models import ClusterTransition
    from tests.zoned import unzoned_times

    tokyo = ZoneInfo("Asia/Tokyo")
    cluster = clusters["alpha"]
    first = ClusterTransition.objects.filter(cluster=cluster).order_by("at", "id").first()
    ClusterTransition.objects.filter(pk=first.pk).update(at=first.at - timedelta(days=1))
    client = page_client(world, "alpha-member")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    status = client.get(f"/clusters/{cluster.pk}/", HTTP_HX_REQUEST="true").content.decode()
    assert not unzoned_times(status), unzoned_times(status)
    assert f"since {cluster.phase_started_at.astimezone(tokyo):%a %-d %b %H:%M:%S} JST" in status, status
    for t in ClusterTransition.objects.filter(cluster=cluster):
        assert f"{t.at.astimezone(tokyo):%a %-d %b %H:%M:%S} JST" in status, (t.phase, status)
    assert not re.search(r"\d{4}-\d\d-\d\d", status), status
