"""Secrets at rest: ciphertext in the database, rotation keeps old secrets readable."""

import pytest
from cryptography.fernet import Fernet
from django.db import connection
from django.test import override_settings

from portal.core import crypto
from tenants.models import Tenant

pytestmark = pytest.mark.django_db


def test_webhook_url_is_ciphertext_in_the_database():
    url = "https://hooks.slack.com/services/T000/B000/very-secret"
    tenant = Tenant.objects.create(slug="sec", name="Sec", slack_webhook_url=url)
    with connection.cursor() as cur:
        cur.execute("SELECT slack_webhook_url FROM tenants_tenant WHERE id = %s", [tenant.pk])
        stored = cur.fetchone()[0]
    assert "very-secret" not in stored and stored.startswith("gAAAA")
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == url


def test_key_rotation_keeps_old_secrets_readable():
    from django.conf import settings

    old_keys = list(settings.PORTAL_FERNET_KEYS)
    token = crypto.encrypt("s3cret")
    new_key = Fernet.generate_key().decode()
    with override_settings(PORTAL_FERNET_KEYS=[new_key, *old_keys]):
        assert crypto.decrypt(token) == "s3cret"
        rotated = crypto.rotate(token)
        assert rotated != token
    with override_settings(PORTAL_FERNET_KEYS=[new_key]):
        assert crypto.decrypt(rotated) == "s3cret"
        with pytest.raises(crypto.InvalidToken):
            crypto.decrypt(token)


def test_mask_shows_only_the_tail():
    assert crypto.mask("https://hooks.slack.com/services/abcd") == "••••••••abcd"
    assert crypto.mask("") == ""


def test_rotate_command_re_encrypts_webhook_urls_under_the_new_key():
    import io

    from django.conf import settings
    from django.core.management import call_command

    url = "https://hooks.slack.com/services/T1/B1/rotate-me"
    tenant = Tenant.objects.create(slug="rot", name="Rot", slack_webhook_url=url)
    new_key = Fernet.generate_key().decode()
    with override_settings(PORTAL_FERNET_KEYS=[new_key, *settings.PORTAL_FERNET_KEYS]):
        out = io.StringIO()
        call_command("rotate_credentials", stdout=out)
        assert out.getvalue() == "re-encrypted 0 credentials and 1 other secret\n"
    with override_settings(PORTAL_FERNET_KEYS=[new_key]):  # the old key is gone: still readable
        assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == url


def test_a_secret_no_key_decrypts_reads_as_empty_and_survives_a_save(caplog):
    """A key dropped too early must not make every load of the row fail (the tenant's pages, feed and
    bookings answered 500), nor may saving the row destroy the ciphertext: with the key back, it reads again."""
    url = "https://hooks.slack.com/services/T000/B000/keep-me"
    tenant = Tenant.objects.create(slug="lost", name="Lost", slack_webhook_url=url)
    with override_settings(PORTAL_FERNET_KEYS=[Fernet.generate_key().decode()]):
        loaded = Tenant.objects.get(pk=tenant.pk)
        assert loaded.slack_webhook_url == "" and isinstance(loaded.slack_webhook_url, crypto.UnreadableSecret)
        assert "cannot be decrypted" in caplog.text
        loaded.name = "Lost and found"
        loaded.save()  # a full save writes every column, the unreadable one included
    again = Tenant.objects.get(pk=tenant.pk)
    assert again.name == "Lost and found" and again.slack_webhook_url == url
