"""Credentials: ciphertext at rest, rotating keys, and the plaintext never in logs or listings."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import serialization
from django.core.management import call_command
from django.db import connection

from provisioning import crypto, services
from provisioning.models import ClusterCredential, VirtualCluster

from .conftest import book

pytestmark = pytest.mark.django_db

OLD_KEY = Fernet.generate_key().decode()
NEW_KEY = Fernet.generate_key().decode()


@pytest.fixture
def cluster(world, t0, settings):
    settings.PORTAL_FERNET_KEYS = [OLD_KEY]
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    return cluster


def raw_rows() -> list[tuple]:
    """Every column of every credential row, as PostgreSQL stores it."""
    with connection.cursor() as cur:
        cur.execute("SELECT * FROM provisioning_clustercredential")
        return cur.fetchall()


def test_the_database_holds_only_a_fernet_token(cluster):
    credential = ClusterCredential.objects.get(cluster=cluster)
    plaintext = crypto.decrypt(credential.ciphertext).decode()
    assert plaintext.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    # The key loads, and its public half is the one shown to the tenant.
    private = serialization.load_ssh_private_key(plaintext.encode(), password=None)
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    assert credential.public_part.startswith(public.decode())
    assert credential.ciphertext.startswith("gAAAAA")  # Fernet version byte 0x80, base64
    body = "-".join(plaintext.splitlines()[1:-1])
    for row in raw_rows():
        assert not any(isinstance(value, str) and ("PRIVATE KEY" in value or body[:40] in value) for value in row)
    assert "PRIVATE" not in str(credential) and "PRIVATE" not in repr(credential)


def test_rotation_keeps_old_secrets_readable_then_moves_them_to_the_new_key(cluster, settings):
    credential = ClusterCredential.objects.get(cluster=cluster)
    plaintext = crypto.decrypt(credential.ciphertext)

    settings.PORTAL_FERNET_KEYS = [NEW_KEY, OLD_KEY]  # new key first, old one still listed
    assert crypto.decrypt(ClusterCredential.objects.get(pk=credential.pk).ciphertext) == plaintext
    new_secret = crypto.encrypt("made after the key change")
    settings.PORTAL_FERNET_KEYS = [NEW_KEY]
    assert crypto.decrypt(new_secret) == b"made after the key change"  # new secrets use the new key
    with pytest.raises(crypto.SecretUnreadable):  # … but the old row needs the old key until rotated
        crypto.decrypt(ClusterCredential.objects.get(pk=credential.pk).ciphertext)

    settings.PORTAL_FERNET_KEYS = [NEW_KEY, OLD_KEY]
    call_command("rotate_credentials")
    rotated = ClusterCredential.objects.get(pk=credential.pk)
    assert rotated.rotated_at is not None and rotated.ciphertext != credential.ciphertext
    settings.PORTAL_FERNET_KEYS = [NEW_KEY]  # the old key can go now
    assert crypto.decrypt(rotated.ciphertext) == plaintext
    settings.PORTAL_FERNET_KEYS = [OLD_KEY]
    with pytest.raises(crypto.SecretUnreadable):
        crypto.decrypt(rotated.ciphertext)


def test_plaintext_never_reaches_the_logs_or_the_api_listings(world, t0, settings, caplog):
    settings.PORTAL_FERNET_KEYS = [OLD_KEY]
    caplog.set_level(logging.DEBUG)
    settings.PORTAL_PROVISIONING_FAULTS = "installing_drivers=error:1"  # a failure path logs too
    reservation = book(world, "alpha-member", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with pytest.raises(services.RetryLater):
        services.cluster_provision(cluster_id=cluster.pk)
    VirtualCluster.objects.filter(pk=cluster.pk).update(next_attempt_at=None)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    listing = world.client("alpha-member").get("/api/v1/clusters/").content.decode()
    detail = world.client("alpha-member").get(f"/api/v1/clusters/{cluster.pk}/").content.decode()
    download = world.client("alpha-member").get(f"/api/v1/clusters/{cluster.pk}/credentials/ssh_key/")
    services.lifecycle_tick(now=t0 + timedelta(hours=3))
    services.cluster_teardown(cluster_id=cluster.pk)

    secret = download.content.decode()
    assert secret.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    key_body = "".join(secret.splitlines()[1:-1])
    for text in (caplog.text, listing, detail):
        assert "PRIVATE KEY" not in text
        assert key_body[:32] not in text
    assert "attempt failed" in caplog.text  # the logs did capture the run


def test_one_secret_no_key_decrypts_does_not_stop_the_rotation_of_the_others(cluster, settings, world, caplog):
    """A credential whose key was dropped too early made rotate_credentials crash with SecretUnreadable and
    roll its whole batch back: no other credential (nor any webhook secret) was re-encrypted, so dropping the
    old key afterwards, as the procedure says, made every one of them unreadable. The readable ones are
    rotated; the unreadable ones are left as stored and named, and the command exits non-zero."""
    import io

    from django.core.management.base import CommandError

    from tenants.models import Tenant

    lost_key = Fernet.generate_key().decode()
    good = ClusterCredential.objects.get(cluster=cluster)
    plaintext = crypto.decrypt(good.ciphertext)
    lost_token = Fernet(lost_key.encode()).encrypt(b"made with a key since dropped").decode()
    ClusterCredential.objects.filter(pk=good.pk).update(ciphertext=lost_token)  # the lowest id: first in its batch
    moved = ClusterCredential.objects.create(cluster=cluster, kind="kubeconfig", ciphertext=good.ciphertext)
    tenant = Tenant.objects.create(slug="hooks", name="Hooks", slack_webhook_url="https://hooks.slack.com/services/x")

    settings.PORTAL_FERNET_KEYS = [NEW_KEY, OLD_KEY]
    out = io.StringIO()
    with pytest.raises(CommandError, match=rf"^1 credential no key decrypts \(left as stored\): #{good.pk}$"):
        call_command("rotate_credentials", stdout=out)
    assert out.getvalue() == "re-encrypted 1 credential and 1 other secret\n"  # was "1 credential(s) and …"
    assert (f"1 cluster credential cannot be decrypted with PORTAL_FERNET_KEYS and was not re-encrypted: #{good.pk}"
            in caplog.text)  # was "1 cluster credential(s) … and were not re-encrypted"
    settings.PORTAL_FERNET_KEYS = [NEW_KEY]  # the old key can go now
    assert crypto.decrypt(ClusterCredential.objects.get(pk=moved.pk).ciphertext) == plaintext
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == "https://hooks.slack.com/services/x"
    assert ClusterCredential.objects.get(pk=good.pk).ciphertext == lost_token  # kept for its key to come back


@pytest.mark.parametrize("status", ["tearing_down", "deleted", "failed"])
def test_credentials_a_late_repair_produces_are_not_kept_for_a_cluster_torn_down(cluster, world, status):
    """reconcile --fix rebuilding a namespace while the teardown finished hands back a new kubeconfig; a
    torn-down cluster's credentials were wiped and must stay so, or the tenant could download a live one."""
    from provisioning.backends.base import PhaseResult
    from provisioning.models import CredentialKind

    services._release_artefacts(cluster)
    VirtualCluster.objects.filter(pk=cluster.pk).update(status=status)
    services._keep_secrets(cluster.pk, PhaseResult(secrets={"kubeconfig": "apiVersion: v1\nkind: Config\n"}))
    assert not ClusterCredential.objects.current().filter(cluster=cluster).exists()
    with pytest.raises(services.NotFound):
        services.credential_download(actor=world.users["alpha-lead"], cluster=cluster,
                                     kind=CredentialKind.KUBECONFIG)
