"""Writes: channels and their secrets, fanning events out into deliveries, and sending them.

Delivery guarantees, and what gives each one:

- **Once per (event, channel)**: ``Delivery.key`` is unique; fan-out is ``get_or_create`` on it,
  so a repeated event, a re-run fan-out task or the reminder sweep finding the same reminder
  adds nothing.
- **Never two senders at once**: a worker sends only after *claiming* the row with one
  conditional UPDATE (status pending/retrying and due, or a sending lease that has expired).
  PostgreSQL re-checks the condition after a concurrent UPDATE commits, so of any number of
  racing workers exactly one gets the row. The lease outlives the POST's deadline, so a live
  sender is never overtaken; a killed one is, once its lease expires.
- **Never lost**: the row exists (committed) before any task is queued; tasks are acked late and
  re-queued when a worker dies; ``deliveries_requeue_stuck`` (beat) re-queues any open row
  nobody is working on, whatever happened to its message (one it re-queued is left to that
  message for SWEEP_HOLD_S, so a queue that is behind does not get a copy a minute).
- **Retries**: 5xx/timeouts back off exponentially with full jitter, 429 waits ``Retry-After``
  (at most the backoff cap), for PORTAL_NOTIFY_MAX_ATTEMPTS tries and at least PORTAL_NOTIFY_RETRY_HOURS
  (24 h) from the first one, so a day-long outage of the receiver loses nothing; a permanent error (any
  other 4xx, Slack's ``channel_not_found`` …) stops at once and flags the channel broken so its lead sees
  it; every attempt is recorded.
- **≤ 1 message per second per webhook URL**, across all workers (``ratelimit``, in Redis).

The network call happens outside any transaction; the outcome is written in a short one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from portal.core import egress
from portal.core.conf import setting
from portal.core.crypto import UnreadableSecret, mask
from portal.core.exceptions import InvalidInput, InvalidState, NotFound, QuotaExceeded
from portal.core.services import audit_record, refuse_stale
from reservations.models import Reservation
from reservations.selectors import tenant_peak_usage
from tenants.models import Quota, Tenant
from tenants.services import (
    slack_webhook_url_check,
    tenant_lead_lock,
    tenant_slack_webhook_clear_locked,
    tenant_slack_webhook_set_locked,
)

from . import ratelimit, selectors, signing, slack, transport
from .choices import (
    SUBSCRIBABLE_EVENTS,
    TENANT_DEFAULT_EVENTS,
    TERMINAL_STATUSES,
    AttemptVerdict,
    ChannelKind,
    DeliveryStatus,
)
from .models import Channel, Delivery, DeliveryAttempt, QuotaAlertState, url_fingerprint
from .selectors import Notice
from .slack import Event

__all__ = [
    "SendResult",
    "platform_channel_ensure",
    "demo_channel_ensure",
    "slack_channel_ensure",
    "slack_channel_added",
    "slack_subscriptions_update",
    "platform_channel_update",
    "webhook_create",
    "webhook_update",
    "webhook_url_check",
    "webhook_rotate_secret",
    "secret_version",
    "channel_delete",
    "channel_clear_broken",
    "channel_send_test",
    "event_fanout",
    "quota_threshold_check",
    "quota_alerts_recheck",
    "quota_alerts_catch_up",
    "reminders_emit",
    "delivery_send",
    "delivery_requeue",
    "deliveries_requeue_stuck",
    "deliveries_prune",
]

logger = logging.getLogger(__name__)

# Celery countdowns stay well below the broker's visibility timeout (an ETA beyond it would be
# re-delivered in a loop); a longer wait simply wakes up, finds it is early, and sleeps again.
MAX_COUNTDOWN_S = 600.0
# A message a little early (clock granularity, countdown rounding) is as good as on time.
DUE_TOLERANCE = timedelta(milliseconds=250)


def _setting(name: str, default: Any) -> Any:
    """settings.NAME, else $NAME, else default (an empty value counts as unset)."""
    value = setting(name, None)
    return default if value in (None, "") else value


def http_timeout() -> float:
    return float(_setting("PORTAL_NOTIFY_HTTP_TIMEOUT", 10.0))


def http_deadline() -> float:
    """The most one POST may take, however its receiver paces the answer (the timeout is per socket read)."""
    deadline = float(_setting("PORTAL_NOTIFY_HTTP_DEADLINE", http_timeout() * 2))
    if not deadline > 0:
        raise ImproperlyConfigured("PORTAL_NOTIFY_HTTP_DEADLINE must be more than 0 seconds.")
    return deadline


def lease_seconds() -> float:
    """How long a claim holds a delivery: longer than any POST can take (its deadline), so a live sender keeps it."""
    return float(_setting("PORTAL_NOTIFY_LEASE_SECONDS", http_deadline() + 10))


def max_attempts() -> int:
    return int(_setting("PORTAL_NOTIFY_MAX_ATTEMPTS", 12))


def _backoff_base() -> float:
    return float(_setting("PORTAL_NOTIFY_BACKOFF_BASE", 2.0))


def _backoff_cap() -> float:
    return float(_setting("PORTAL_NOTIFY_BACKOFF_CAP", 3600.0))


def retry_window() -> timedelta:
    """How long a retryable delivery keeps being tried, from its first attempt (or its last requeue), at least.

    Counted in time, not attempts: with full jitter a dozen attempts spanned anything from seconds to under an
    hour (about 18 minutes on average), so a receiver (or Slack) down longer than that lost the message for good."""
    hours = float(_setting("PORTAL_NOTIFY_RETRY_HOURS", 24.0))
    if hours < 0:
        raise ImproperlyConfigured("PORTAL_NOTIFY_RETRY_HOURS must be 0 or more.")
    return timedelta(hours=hours)


def test_retry_seconds() -> float:
    """How long a test message is tried at the most, from its first attempt: a lead waits on the page for its
    answer, which says whether the receiver works now (a day of retries, as an event's, told them nothing)."""
    seconds = float(_setting("PORTAL_NOTIFY_TEST_RETRY_SECONDS", 60.0))
    if seconds < 0:
        raise ImproperlyConfigured("PORTAL_NOTIFY_TEST_RETRY_SECONDS must be 0 or more.")
    return seconds


def test_max_attempts() -> int:
    """Tries of a test message at the most (within test_retry_seconds)."""
    value = int(_setting("PORTAL_NOTIFY_TEST_MAX_ATTEMPTS", 3))
    if value < 1:
        raise ImproperlyConfigured("PORTAL_NOTIFY_TEST_MAX_ATTEMPTS must be 1 or more.")
    return value


def _min_interval() -> float:
    return float(_setting("PORTAL_NOTIFY_MIN_INTERVAL", 1.0))


def secret_overlap_hours() -> int:
    """How long a rotated webhook's old secret keeps signing beside the new one (0: it stops at once)."""
    return int(_setting("PORTAL_NOTIFY_SECRET_OVERLAP_HOURS", 24))


def max_webhooks() -> int:
    """How many signed webhooks one tenant may have (each is a secret, a URL checked on every send and a delivery
    per event); 0: none."""
    value = int(_setting("PORTAL_NOTIFY_MAX_WEBHOOKS", 20))
    if value < 0:
        raise ImproperlyConfigured("PORTAL_NOTIFY_MAX_WEBHOOKS must be 0 or more.")
    return value


_redis_clients: dict[str, Any] = {}


def _redis():
    url = settings.REDIS_URL
    client = _redis_clients.get(url)
    if client is None:
        client = _redis_clients[url] = ratelimit.client_from_url(url)
    return client


def _enqueue(delivery_ids: list[int], *, countdown: float | None = None) -> None:
    """Queue the send tasks once the rows they name are committed."""
    if not delivery_ids:
        return
    from .tasks import deliver_task

    def send() -> None:
        for pk in delivery_ids:
            try:
                deliver_task.apply_async(args=[pk], countdown=countdown)
            except Exception:  # noqa: BLE001 - any broker error: the row is committed, the sweeper sends it
                logger.warning("could not queue delivery %s; the sweeper will", pk, exc_info=True)

    transaction.on_commit(send)


# --- channels -------------------------------------------------------------------------------


def _validate_url(url: str, field: str = "url") -> str:
    return egress.checked_url(url, field=field, hint="Give a public http(s) URL.")


def webhook_url_check(url: Any) -> str:
    """The endpoint URL as webhook_create / webhook_update would store it, or InvalidInput: for a form to ask
    first."""
    return _validate_url(url)


def _validate_channel_name(name: Any) -> str:
    name = str(name or "").strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidInput("name: control characters (line breaks, tabs …) are not allowed.",
                           fields={"name": "Use plain text on one line."})
    return name[:100]


def _validate_events(events: Any) -> list[str]:
    events = list(events or [])
    unknown = [e for e in events if e not in SUBSCRIBABLE_EVENTS]
    if unknown:
        raise InvalidInput(f"events: unknown {', '.join(map(str, unknown))}.", fields={"events": "Unknown event."})
    # Keep the catalogue's order so the page and the audit log read the same way every time.
    return [e for e in SUBSCRIBABLE_EVENTS if e in events]


def _hears_quota_alerts(channel: Channel | None) -> bool:
    """Whether channel is one that quota alerts go to (an enabled tenant channel subscribed to them)."""
    return bool(channel is not None and not channel.is_platform and channel.enabled
                and Event.QUOTA_THRESHOLD in channel.events)


# What a channel's edit page may say it showed (expected=): checked again under the channel's lock.
_EXPECTABLE = ("name", "events", "enabled")


def _refuse_if_changed(channel: Channel | None, expected: dict[str, Any] | None) -> None:
    """expected ({field: value}, what an edit page showed for the fields it changes): refused (InvalidState) if
    any is no longer so, or the channel is gone. Events compare as a set (the page may post them in any order)."""
    expected = {k: v for k, v in (expected or {}).items() if k in _EXPECTABLE}
    stale = []
    for key, shown in expected.items():
        now = None if channel is None else getattr(channel, key)
        same = channel is not None and (set(now) == set(shown or []) if key == "events" else now == shown)
        if not same:
            stale.append(key)
    refuse_stale(stale, by="another admin, a lead or the API")


def _channel_snapshot(channel: Channel) -> dict[str, Any]:
    return {
        "kind": channel.kind,
        "name": channel.name,
        "url": channel.masked_url(),
        "events": list(channel.events),
        "enabled": channel.enabled,
    }


DENIED = "Only the tenant's lead manages its notifications."


def _lock_rights(*, actor: Any, tenant_id: int | None) -> None:
    """Decide that actor may manage the channels of tenant_id (staff, or one of its leads; the platform's: staff)
    and hold the answer to the end of the transaction: a lead demoted or removed meanwhile waits for this change,
    or this change waits and then finds the actor no longer a lead (PermissionDenied, nothing changed).

    Taken first in the transaction, as tenants services take it: the lead rows, then the tenant row (FOR NO KEY
    UPDATE), then deliveries, then their channels (a delivery's row before its channel's: see _lock_channel).
    Bookings share-lock one membership row and key-share the tenant row, and never lock a channel, so no order
    here can deadlock with them."""
    tenant_lead_lock(actor=actor, tenant_id=tenant_id, denied=DENIED)


def platform_channel_ensure() -> Channel | None:
    """Return the platform Slack channel when PORTAL_PLATFORM_SLACK_WEBHOOK is set, creating its row."""
    if not selectors.platform_url():
        return None
    channel = Channel.objects.filter(tenant__isnull=True, kind=ChannelKind.SLACK).first()
    if channel is not None:
        return channel
    try:
        with transaction.atomic():
            return Channel.objects.create(
                tenant=None, kind=ChannelKind.SLACK, name="platform", events=selectors.platform_default_events()
            )
    except IntegrityError:  # created concurrently by another worker
        return Channel.objects.get(tenant__isnull=True, kind=ChannelKind.SLACK)


def slack_channel_ensure(tenant: Tenant) -> Channel | None:
    """The tenant's Slack channel row (created with every event on first use), if a URL is set."""
    channel = Channel.objects.select_related("tenant").filter(tenant=tenant, kind=ChannelKind.SLACK).first()
    if channel is not None or not tenant.slack_webhook_url:
        return channel
    try:
        with transaction.atomic():
            return Channel.objects.create(
                tenant=tenant, kind=ChannelKind.SLACK, name="slack", events=list(TENANT_DEFAULT_EVENTS)
            )
    except IntegrityError:
        return Channel.objects.get(tenant=tenant, kind=ChannelKind.SLACK)


def slack_channel_added(*, tenant_id: int) -> Channel | None:
    """The tenant's Slack URL was set: make its channel row now and send it the current quota alerts.

    (tenants.services announces it as tenant.slack_webhook_set, whoever set it: page, admin or API.)
    """
    tenant = Tenant.objects.filter(pk=tenant_id).first()
    if tenant is None:
        return None
    channel = slack_channel_ensure(tenant)
    if channel is not None and channel.target_url():
        quota_alerts_catch_up(channel_id=channel.pk)
    return channel


_demo_ready: set[str] = set()


def demo_channel_ensure() -> Channel | None:
    """In a demo (`make run`), point the demo tenant's signed webhook at PORTAL_DEMO_WEBHOOK_URL.

    Idempotent and cheap after the first success in a process. The secret is
    PORTAL_DEMO_WEBHOOK_SECRET when given (so a receiver can verify), else generated.
    """
    url = _setting("PORTAL_DEMO_WEBHOOK_URL", "")
    if not url:
        return None
    slug = _setting("PORTAL_DEMO_TENANT", "research")
    marker = f"{slug}|{url}"
    if marker in _demo_ready:
        return None
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        return None  # not seeded yet; try again on the next event
    secret = _setting("PORTAL_DEMO_WEBHOOK_SECRET", "") or signing.generate_secret()
    with transaction.atomic():
        # The tenant's row first (FOR NO KEY UPDATE, as webhook_create takes it): a lookup that finds no channel
        # locks nothing, so two workers meeting the first event at once both made one, and every event went out
        # twice. Now the second waits for the first's commit and finds its channel.
        Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        channel = (
            Channel.objects.select_for_update(of=("self",))  # not the tenant row its ordering joins
            .filter(tenant=tenant, kind=ChannelKind.WEBHOOK, name="demo")
            .first()
        )
        if channel is None:
            channel = Channel.objects.create(
                tenant=tenant, kind=ChannelKind.WEBHOOK, name="demo", url=url, secret=secret,
                events=list(TENANT_DEFAULT_EVENTS),
            )
            audit_record(actor=None, action="notifications.webhook.create", obj=channel, tenant_id=tenant.pk,
                         after={**_channel_snapshot(channel), "source": "PORTAL_DEMO_WEBHOOK_URL"})
        elif channel.url != url:
            channel.url = url
            channel.save(update_fields=["url", "updated_at"])
    _demo_ready.add(marker)
    return channel


def slack_subscriptions_update(
    *, actor: Any, tenant: Tenant, events: list[str] | None = None, enabled: bool | None = None,
    url: str | None = None, expected: dict[str, Any] | None = None,
) -> Channel:
    """Choose which events go to the tenant's Slack channel (the URL itself is set on the tenant).

    url (the channel's admin page): a new Slack URL for the tenant, set in the same transaction, so that a
    refusal of the rest leaves the URL as it was too (tenant_slack_webhook_set_locked). A change that changes
    nothing on an existing channel is neither written nor audited. expected: as webhook_update's (a channel
    made by this call was not the one the page showed: refused)."""
    if url is not None:
        url = slack_webhook_url_check(url)  # before the transaction: it resolves the host
    with transaction.atomic(durable=True):
        _lock_rights(actor=actor, tenant_id=tenant.pk)
        if url is not None:
            tenant = tenant_slack_webhook_set_locked(actor=actor, tenant_id=tenant.pk, url=url)
        # One writer per tenant's settings. NO KEY UPDATE, as the Slack URL's store takes it: bookings key-share
        # the row until they commit, and FOR UPDATE queued this change behind every booking in flight.
        Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        channel, created = Channel.objects.get_or_create(
            tenant=tenant, kind=ChannelKind.SLACK, defaults={"name": "slack", "events": list(TENANT_DEFAULT_EVENTS)}
        )
        # Read again under the row's lock: a worker may be flagging the channel broken (or repaired) right now,
        # and saving the copy read before its commit wrote the old flag back over it.
        channel = Channel.objects.select_for_update(of=("self",)).filter(pk=channel.pk).first()
        if channel is None:
            raise NotFound("No such channel (it has just been deleted).")
        _refuse_if_changed(None if created else channel, expected)
        channel.tenant = tenant
        before = _channel_snapshot(channel)
        was_listening = not created and _hears_quota_alerts(channel)
        if events is not None:
            channel.events = _validate_events(events)
        if enabled is not None:
            channel.enabled = bool(enabled)
        if created or _channel_snapshot(channel) != before:
            channel.save()
            audit_record(actor=actor, action="notifications.slack.update", obj=channel, tenant_id=tenant.pk,
                         before=before, after=_channel_snapshot(channel))
    _catch_up(channel, was_listening=was_listening)
    return channel


def platform_channel_update(*, actor: Any, channel: Channel, events: list[str] | None = None,
                            enabled: bool | None = None, expected: dict[str, Any] | None = None) -> Channel:
    """Choose what the platform channel receives (its URL is PORTAL_PLATFORM_SLACK_WEBHOOK).

    A change that changes nothing is neither written nor audited. expected: as webhook_update's."""
    with transaction.atomic(durable=True):
        channel = _lock_channel(channel, actor=actor)
        if not channel.is_platform:
            raise InvalidState("Not the platform channel.")
        _refuse_if_changed(channel, expected)
        before = _channel_snapshot(channel)
        if events is not None:
            channel.events = _validate_events(events)
        if enabled is not None:
            channel.enabled = bool(enabled)
        if _channel_snapshot(channel) != before:  # a save that changes nothing: no write, no audit row
            channel.save()
            audit_record(actor=actor, action="notifications.platform.update", obj=channel, before=before,
                         after=_channel_snapshot(channel))
    return channel


def webhook_create(
    *, actor: Any, tenant: Tenant, url: str, name: str = "", events: list[str] | None = None
) -> tuple[Channel, str]:
    """Register a tenant's signed webhook; return it with its secret, which is shown only now."""
    url = _validate_url(url)
    name = _validate_channel_name(name)
    events = _validate_events(TENANT_DEFAULT_EVENTS if events is None else events)
    secret = signing.generate_secret()
    cap = max_webhooks()
    with transaction.atomic(durable=True):
        _lock_rights(actor=actor, tenant_id=tenant.pk)
        # The cap is a check-then-insert: two creates counting at once would both see a place left. The tenant's row
        # (FOR NO KEY UPDATE, after the team lock, as every tenant settings write takes it) makes them take turns,
        # whoever the actor (staff on a tenant without leads locks no lead row); bookings only key-share the row,
        # so they do not wait on this.
        Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        if Channel.objects.filter(tenant_id=tenant.pk, kind=ChannelKind.WEBHOOK).count() >= cap:
            raise QuotaExceeded(
                f"{tenant.name} already has the most signed webhooks a tenant may have ({cap}): delete one first.")
        channel = Channel.objects.create(
            tenant=tenant, kind=ChannelKind.WEBHOOK, name=name, url=url, secret=secret,
            events=events,
        )
        audit_record(actor=actor, action="notifications.webhook.create", obj=channel, tenant_id=tenant.pk,
                     after=_channel_snapshot(channel))
    _catch_up(channel, was_listening=False)
    return channel, secret


def _lock_channel(channel: Channel, *, actor: Any, deliveries: bool = False) -> Channel:
    """Decide actor's right on the channel's tenant (_lock_rights), then lock the channel's row and return it.

    deliveries: lock the rows of the channel's deliveries too, before the channel's own (for a change that
    writes them: the delete sets their channel to NULL). A delivery's row comes before its channel's
    everywhere: the worker recording an outcome (_record) holds the delivery when it flags the channel
    broken or repaired, and a lead's retry (delivery_requeue) does the same. Taken the other way round, a
    delete met a recording halfway and PostgreSQL broke the deadlock by failing one of them.

    A channel never moves to another tenant, so the tenant is the one of the instance given."""
    _lock_rights(actor=actor, tenant_id=channel.tenant_id)
    if deliveries:
        # In id order, as deliveries_prune takes them. One that a fan-out commits between this and the channel's
        # lock below (which waits for that commit) is not locked here: only a worker that sent it and is recording
        # its outcome within the few milliseconds left to this transaction could still meet the delete halfway.
        list(Delivery.objects.select_for_update().filter(channel_id=channel.pk).order_by("pk")
             .values_list("pk", flat=True))
    locked = Channel.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=channel.pk).first()
    if locked is None:
        raise NotFound("No such channel (it has just been deleted).")
    return locked


def webhook_update(
    *, actor: Any, channel: Channel, url: str | None = None, name: str | None = None,
    events: list[str] | None = None, enabled: bool | None = None, expected: dict[str, Any] | None = None,
) -> Channel:
    """Change a signed webhook: only the fields given (None: left as they are). A change that changes nothing is
    neither written nor audited.

    expected ({field: value} for name, events, enabled: what an edit page showed for the fields it changes):
    refused (InvalidState) if any is no longer so, checked under the channel's lock, so that a page opened
    before a lead's change does not write its old values back."""
    # Checked before the row lock: the URL check resolves the host name.
    url = None if url is None else _validate_url(url)
    name = None if name is None else _validate_channel_name(name)
    with transaction.atomic(durable=True):
        channel = _lock_channel(channel, actor=actor)
        if channel.kind != ChannelKind.WEBHOOK:
            raise InvalidState("Only signed webhooks are edited here.")
        _refuse_if_changed(channel, expected)
        before = _channel_snapshot(channel)
        # Compared on what is stored (the snapshot shows the URL masked: two URLs may mask alike).
        stored = (str(channel.url), channel.name, list(channel.events), channel.enabled)
        was_listening = _hears_quota_alerts(channel)
        if url is not None:
            channel.url = url
        if name is not None:
            channel.name = name
        if events is not None:
            channel.events = _validate_events(events)
        if enabled is not None:
            channel.enabled = bool(enabled)
        if (str(channel.url), channel.name, list(channel.events), channel.enabled) != stored:
            channel.save()
            audit_record(actor=actor, action="notifications.webhook.update", obj=channel,
                         tenant_id=channel.tenant_id, before=before, after=_channel_snapshot(channel))
    _catch_up(channel, was_listening=was_listening)
    return channel


def secret_version(channel: Channel) -> str:
    """A short hash naming the webhook's current signing secret (not the secret): what a confirmation page shows
    it is replacing, so that a second post of the same page is told the secret has changed."""
    return url_fingerprint(str(channel.secret or ""))


def webhook_rotate_secret(*, actor: Any, channel: Channel, overlap_hours: int | None = None,
                          expected_version: str | None = None) -> tuple[Channel, str]:
    """Issue a new signing secret; the old one keeps signing alongside it for overlap_hours.

    Requests carry both signatures meanwhile (Standard Webhooks allows several), so the
    tenant can switch their receiver to the new secret at leisure. Only one previous secret is
    kept: one still in its overlap stops signing now.

    expected_version (secret_version of what a confirmation page showed): refused (InvalidState, nothing changed)
    when the secret is another one by now. A confirmation posted twice (a double click) rotated twice, and the
    second made the first's new secret the "previous" one: the receiver's secret stopped verifying at once.
    """
    hours = secret_overlap_hours() if overlap_hours is None else int(overlap_hours)
    new_secret = signing.generate_secret()
    with transaction.atomic(durable=True):
        channel = _lock_channel(channel, actor=actor)
        if channel.kind != ChannelKind.WEBHOOK:
            raise InvalidState("Only signed webhooks have a signing secret.")
        if expected_version is not None and expected_version != secret_version(channel):
            raise InvalidState("This webhook's signing secret was rotated since you opened this page (a second "
                               "click?); nothing was changed. Rotate again only if the secret shown then is lost.")
        channel.previous_secret = channel.secret if hours > 0 else ""
        channel.previous_secret_expires_at = timezone.now() + timedelta(hours=hours) if hours > 0 else None
        channel.secret = new_secret
        channel.save()
        audit_record(actor=actor, action="notifications.webhook.rotate", obj=channel, tenant_id=channel.tenant_id,
                     after={"secret": mask(new_secret), "previous_valid_until":
                            channel.previous_secret_expires_at.isoformat() if hours > 0 else None})
    return channel, new_secret


def channel_delete(*, actor: Any, channel: Channel) -> None:
    """Delete a channel; its deliveries stay in the log (open ones are skipped).

    A tenant's Slack channel exists because the tenant has a Slack URL (its row is made again on the
    next event), so deleting it removes that URL first. The platform channel comes from
    PORTAL_PLATFORM_SLACK_WEBHOOK the same way: it is disabled, not deleted.
    """
    if channel.is_platform:
        with transaction.atomic(durable=True):
            _lock_rights(actor=actor, tenant_id=None)  # the right first (staff only): a non-staff hears 403, not why
        raise InvalidState("The platform channel comes from PORTAL_PLATFORM_SLACK_WEBHOOK and would be made "
                           "again on the next event: disable it instead (or unset the setting).")
    with transaction.atomic(durable=True):
        # One transaction: the URL goes with its channel or not at all. (Cleared in a transaction of its own first,
        # a failure of the delete left the URL gone and the channel there; and a new URL set in between was
        # announced to the channel row the delete then removed: a URL without its channel.)
        if channel.kind == ChannelKind.SLACK:
            _lock_rights(actor=actor, tenant_id=channel.tenant_id)  # the team lock, then the tenant row, as ever
            tenant_slack_webhook_clear_locked(actor=actor, tenant_id=channel.tenant_id)
        channel = _lock_channel(channel, actor=actor, deliveries=True)  # on_delete=SET_NULL writes them
        before = _channel_snapshot(channel)
        tenant_id = channel.tenant_id
        audit_record(actor=actor, action="notifications.channel.delete", obj=channel, tenant_id=tenant_id,
                     before=before)
        channel.delete()


def channel_clear_broken(*, actor: Any, channel: Channel) -> tuple[Channel, bool]:
    """Let a broken channel send again (after fixing the receiving end).

    Return the channel and whether there was a broken flag to clear: one that is not broken (a second
    click, a delivered message repaired it meanwhile) is left as it is, with no "repaired" audit row.
    """
    with transaction.atomic(durable=True):
        channel = _lock_channel(channel, actor=actor)
        if (channel.broken_at is None and not channel.broken_error and channel.broken_status is None
                and not channel.broken_url_fp):
            return channel, False
        before = {"broken_error": channel.broken_error}
        channel.broken_at, channel.broken_error, channel.broken_status, channel.broken_url_fp = None, "", None, ""
        channel.save()
        audit_record(actor=actor, action="notifications.channel.repaired", obj=channel, tenant_id=channel.tenant_id,
                     before=before, after={"broken_error": ""})
    return channel, True


# --- building deliveries ------------------------------------------------------------------


def _build_body(channel_kind: str, event: str, payload: dict[str, Any], message_id: str) -> tuple[str, str]:
    """Return (body to POST, one-line summary). Raise ValueError for a payload the builders reject."""
    message = slack.build_message(event, payload, settings.PORTAL_BASE_URL)
    # The log's one line is plain text (the page escapes it); the message's own text is Slack-escaped.
    summary = slack.plain(message["text"])
    if channel_kind == ChannelKind.SLACK:
        return slack.to_body(message).decode("utf-8"), summary
    envelope = {
        "id": message_id,
        "type": str(event),
        "timestamp": timezone.now().strftime("%Y-%m-%dT%H:%M:%SZ"),
        "data": payload,
    }
    return json.dumps(envelope, ensure_ascii=False, separators=(",", ":")), summary


def _delivery_for(notice: Notice, channel: Channel) -> tuple[Delivery, bool]:
    """get_or_create the delivery of notice to channel; True when this call created it."""
    key = f"{notice.key}|c{channel.pk}"
    if len(key) > 255:
        # Long keys (two long hostnames) keep what tells channels apart: cutting the "|c<channel>" off
        # gave every channel the same key, and all but the first were silently skipped.
        key = f"{key[:190]}#{hashlib.sha256(key.encode()).hexdigest()}"
    existing = Delivery.objects.filter(key=key).first()
    if existing is not None:
        return existing, False
    message_id = signing.generate_message_id()
    payload = selectors.without_secrets_in(selectors.jsonable(notice.payload))
    status, error = DeliveryStatus.PENDING, ""
    if channel.is_broken and notice.event != Event.TEST:
        # Recorded (the lead sees what was missed) but not sent until the channel is fixed.
        status, error = DeliveryStatus.SKIPPED, f"channel_broken: {channel.broken_error}"[:200]
    try:
        body, summary = _build_body(channel.kind, notice.event, payload, message_id)
    except ValueError as exc:
        # A translator bug or an event we cannot render: keep it visible in the log, do not send.
        logger.error("cannot build %s for channel %s: %s", notice.event, channel.pk, exc)
        body, summary, status, error = "", f"{notice.event} (could not be built)", DeliveryStatus.FAILED, (
            f"build_error: {exc}"[:200])
    return Delivery.objects.get_or_create(
        key=key,
        defaults={
            "channel": channel,
            "channel_label": channel.label,
            "kind": channel.kind,
            "tenant_id": channel.tenant_id,
            "event": notice.event,
            "source_event": notice.source_event,
            "message_id": message_id,
            "payload": payload,
            "body": body,
            "summary": summary[:300],
            "status": status,
            "last_error": error,
            "next_attempt_at": timezone.now(),
        },
    )


def _deliver_notices(notices: list[Notice]) -> list[Delivery]:
    platform = platform_channel_ensure()
    created: list[Delivery] = []
    tenant_ids = {n.tenant_id for n in notices if n.tenant_id is not None}
    for tenant in Tenant.objects.filter(pk__in=tenant_ids):
        slack_channel_ensure(tenant)
    for notice in notices:
        for channel in selectors.channels_for_notice(notice, platform=platform):
            delivery, new = _delivery_for(notice, channel)
            if new and delivery.status == DeliveryStatus.PENDING:
                created.append(delivery)
    _enqueue([d.pk for d in created])
    return created


def event_fanout(*, event: str, payload: dict[str, Any]) -> list[Delivery]:
    """Turn one domain event into deliveries (idempotent) and queue them; unknown events do nothing."""
    demo_channel_ensure()
    notices = selectors.notices_for(event, payload)
    created = _deliver_notices(notices) if notices else []
    if event in selectors.QUOTA_EVENTS:
        reservation_id = selectors.as_id(payload.get("reservation_id"))
        row = None if reservation_id is None else (
            Reservation.objects.filter(pk=reservation_id).values("tenant_id", "pool_id").first())
        if row:
            created += quota_threshold_check(tenant_id=row["tenant_id"], pool_id=row["pool_id"])
    return created


def _quota_state_refresh(quota: Quota, now: datetime) -> tuple[QuotaAlertState, int, bool]:
    """Re-measure the tenant's booked peak in the quota's pool; return (state, peak, crossed just now).

    The peak is taken over the whole booking horizon from now, with the alert state row locked,
    so concurrent checks take turns and each sees the bookings committed before it. Callers run it in
    their own transaction, so a crossing is committed with the alert that announces it, or not at all.
    """
    threshold = float(_setting("PORTAL_NOTIFY_QUOTA_THRESHOLD_PERCENT", 80))
    horizon = now + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS)
    with transaction.atomic():
        QuotaAlertState.objects.get_or_create(quota=quota)
        state = QuotaAlertState.objects.select_for_update().get(quota=quota)
        peak = tenant_peak_usage(tenant_id=quota.tenant_id, pool_id=quota.pool_id, start=now, end=horizon)
        above = peak * 100 >= threshold * quota.max_nodes
        crossing = above and not state.above
        state.above, state.last_peak = above, peak
        if crossing:
            state.crossings += 1
        state.save()
    return state, peak, crossing


def _quota_notice(quota: Quota, state: QuotaAlertState, peak: int) -> Notice:
    """The alert of the state's current crossing (its key is the same whoever asks, and when)."""
    return Notice(
        event=Event.QUOTA_THRESHOLD,
        key=f"{Event.QUOTA_THRESHOLD}:q{quota.pk}:n{state.crossings}",
        payload={
            "tenant": quota.tenant.slug,
            "tenant_name": quota.tenant.name,
            "pool": quota.pool.name,
            "used_nodes": peak,
            "max_nodes": quota.max_nodes,
            "percent": round(100 * peak / quota.max_nodes),
        },
        source_event="quota.threshold",
        tenant_id=quota.tenant_id,
        to_platform=False,
    )


def quota_threshold_check(*, tenant_id: int, pool_id: int, now: datetime | None = None) -> list[Delivery]:
    """Alert once when the tenant's booked peak in the pool reaches the threshold (default 80 %)."""
    now = now or timezone.now()
    quota = Quota.objects.select_related("tenant", "pool").filter(tenant_id=tenant_id, pool_id=pool_id).first()
    if quota is None or quota.max_nodes <= 0:
        return []
    return _quota_check(quota, now)


def quota_alerts_recheck(*, now: datetime | None = None) -> list[Delivery]:
    """Re-measure every quota (beat): use also changes without a booking change.

    Bookings end as time passes, so a tenant once above the threshold falls back below it with
    nothing announced: re-armed here, its next climb is a crossing with an alert of its own
    (otherwise it would read as still above, and stay silent). A quota lowered under the
    tenant's bookings is a crossing too, and one raised above them re-arms the alert.

    Each quota is checked on its own: one that fails (its transaction rolled back, crossing and alert
    together) is logged and re-measured at the next run; the others are checked all the same.
    """
    now = now or timezone.now()
    created: list[Delivery] = []
    for quota in Quota.objects.select_related("tenant", "pool").filter(max_nodes__gt=0).order_by("pk"):
        try:
            created += _quota_check(quota, now)
        except Exception:  # noqa: BLE001 - any failure of one quota: logged, retried at the next run
            logger.exception("quota alert recheck of quota #%s (tenant %s, pool %s) failed; retried at the next run",
                             quota.pk, quota.tenant.slug, quota.pool.name)
    return created


def _quota_check(quota: Quota, now: datetime) -> list[Delivery]:
    # The crossing and its alert's deliveries commit together (the state row stays locked meanwhile): counted
    # in a transaction of its own, a fan-out failing after it (and the task run again) found the tenant
    # already above, no crossing, and sent no alert for this climb at all.
    with transaction.atomic():
        state, peak, crossing = _quota_state_refresh(quota, now)
        if not crossing:
            return []
        return _deliver_notices([_quota_notice(quota, state, peak)])


def quota_alerts_catch_up(*, channel_id: int, now: datetime | None = None) -> list[Delivery]:
    """Tell a channel that has just started listening (added, enabled, subscribed) the tenant's current quota alerts.

    The alert goes out once per upward crossing, to the channels listening at that moment; a
    channel that joins while the tenant is still above the threshold gets that crossing's alert
    now. Its key is the crossing's, so the channels already told are not told again, and saving
    the channel twice (or switching it off and on) within one crossing sends it once. The use is
    measured afresh: a tenant that has fallen back below is re-armed instead, and one found above
    for the first time is a crossing, announced to every channel as usual.
    """
    now = now or timezone.now()
    channel = Channel.objects.select_related("tenant").filter(pk=channel_id).first()
    if not _hears_quota_alerts(channel) or not channel.target_url():
        return []
    created: list[Delivery] = []
    for quota in Quota.objects.select_related("tenant", "pool").filter(tenant_id=channel.tenant_id, max_nodes__gt=0):
        with transaction.atomic():  # a crossing commits with its alert's deliveries (see _quota_check)
            state, peak, crossing = _quota_state_refresh(quota, now)
            if crossing:
                created += _deliver_notices([_quota_notice(quota, state, peak)])
            elif state.above:
                delivery, new = _delivery_for(_quota_notice(quota, state, peak), channel)
                if new and delivery.status == DeliveryStatus.PENDING:
                    _enqueue([delivery.pk])
                    created.append(delivery)
    return created


def _catch_up(channel: Channel, *, was_listening: bool) -> None:
    """After a committed change to channel: if it has just started listening, send it the current quota alerts.

    The change stands whatever happens here: a failure is logged, not raised into the request
    that saved the channel (the next crossing reaches it anyway).
    """
    if was_listening or not _hears_quota_alerts(channel):
        return
    try:
        quota_alerts_catch_up(channel_id=channel.pk)
    except Exception:  # noqa: BLE001 - see above
        logger.exception("could not send the current quota alerts to channel %s", channel.pk)


def reminders_emit(*, now: datetime | None = None) -> list[Delivery]:
    """Announce the reminders that are due (beat, every minute); the keys make repeats no-ops."""
    now = now or timezone.now()
    demo_channel_ensure()
    created: list[Delivery] = []
    for event, reservation_id, hours in selectors.reminders_due(now=now):
        created += event_fanout(event=event, payload={"reservation_id": reservation_id, "hours": hours})
    return created


def channel_send_test(*, actor: Any, channel: Channel) -> Delivery:
    """Queue a test message to channel, even a broken one (that is how a fixed URL is proven)."""
    payload: dict[str, Any] = {"tenant": channel.tenant.slug} if channel.tenant_id else {}
    if channel.tenant_id:
        payload["tenant_name"] = channel.tenant.name
    if getattr(actor, "pk", None):
        # A tenant's channel reads "platform staff" for a staff sender; the platform channel, the account.
        payload["actor"] = selectors.actor_words(actor) if channel.tenant_id else actor.get_username()
    notice = Notice(event=Event.TEST, key=f"test:{uuid.uuid4().hex}", payload=payload, source_event="test",
                    tenant_id=channel.tenant_id)
    with transaction.atomic(durable=True):
        # The right first (a non-lead hears 403, not this), then the channel's row, read again: one deleted
        # meanwhile (the delete queued this behind it on the team lock) is "no such channel", where inserting a
        # delivery that names it failed at commit on the foreign key (a 500).
        channel = _lock_channel(channel, actor=actor)
        if not channel.target_url():
            raise InvalidState("No webhook URL is set for this channel.")
        delivery, _ = _delivery_for(notice, channel)
        audit_record(actor=actor, action="notifications.test", obj=channel, tenant_id=channel.tenant_id,
                     after={"delivery": delivery.pk})
        _enqueue([delivery.pk])
    return delivery


# --- sending --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendResult:
    """What one call of delivery_send came to; retry_in says when the task should run again."""

    status: str
    retry_in: float | None = None
    posted: bool = False
    error: str = ""


def _secrets_for(channel: Channel, now: datetime) -> list[str]:
    """The webhook's secrets to sign with: its current one, and the previous one while a rotation overlaps.

    Raise ValueError when the current secret is no signing key (empty, cut short, not base64): there is nothing
    to sign with. A previous secret that is no key is left out (the current one still signs), and logged.
    """
    current = channel.secret
    if isinstance(current, UnreadableSecret):
        raise ValueError("the channel's signing secret cannot be decrypted")
    if not current:
        raise ValueError("the channel has no signing secret")
    try:
        signing.decode_secret(current)
    except ValueError as exc:
        raise ValueError(f"the channel's signing secret is not a valid key ({exc})") from None
    secrets = [current]
    previous = channel.previous_secret
    if (previous and not isinstance(previous, UnreadableSecret) and channel.previous_secret_expires_at
            and channel.previous_secret_expires_at > now):
        try:
            signing.decode_secret(previous)
        except ValueError:
            logger.warning("channel %s: its previous signing secret is not a valid key; signing with the current "
                           "one only", channel.pk)
        else:
            secrets.append(previous)
    return secrets


def _skip_reason(delivery: Delivery, channel: Channel | None) -> str:
    if channel is None:
        return "channel_deleted"
    if not channel.target_url():
        return "no_url"
    if channel.kind == ChannelKind.WEBHOOK and isinstance(channel.secret, UnreadableSecret):
        return "secret_unreadable"  # never sign with nothing: the key it was stored with is gone
    if delivery.event == Event.TEST:
        return ""
    if not channel.enabled:
        return "channel_disabled"
    if delivery.event not in channel.events:
        return "event_unsubscribed"  # unticked since the message was queued: the lead no longer wants it
    if channel.is_broken:
        return f"channel_broken: {channel.broken_error}"[:200]
    reason = selectors.reminder_obsolete(delivery, now=timezone.now()) or selectors.quota_alert_obsolete(delivery)
    return reason[:200]


def _finish(delivery_id: int, *, status: str, error: str) -> SendResult:
    """End a delivery unsent (skipped, or failed before any POST), unless another worker has claimed it meanwhile.

    The condition is the claim's, less its due time: open and unclaimed, or claimed on a lease that has run out.
    PostgreSQL re-checks it after a concurrent claim commits, so a sender already posting keeps its row and its
    outcome counts (finishing it anyway dropped that outcome as a lost claim's: a Slack 404 left the delivery
    "skipped" and the channel never flagged broken)."""
    now = timezone.now()
    finished = (
        Delivery.objects.filter(pk=delivery_id)
        .filter(Q(status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING])
                | Q(status=DeliveryStatus.SENDING, lease_until__lt=now))
        .update(status=status, last_error=error[:200], lease_until=None, claim=None, next_attempt_at=None,
                updated_at=now)
    )
    if not finished:
        return _come_back(delivery_id)
    return SendResult(status=status, error=error)


def _come_back(delivery_id: int) -> SendResult:
    """The delivery is someone else's now (claimed, or finished): say when to look again, if ever."""
    current = Delivery.objects.filter(pk=delivery_id).first()
    if current is None or current.status in TERMINAL_STATUSES:
        return SendResult(status=current.status if current else "missing")
    return SendResult(status=current.status, retry_in=_wait_for(current, timezone.now()) or 1.0)


def _wait_for(delivery: Delivery, now: datetime) -> float | None:
    """Seconds until this delivery may be attempted, or None when it may be now."""
    if delivery.status == DeliveryStatus.SENDING and delivery.lease_until and delivery.lease_until > now:
        return (delivery.lease_until - now).total_seconds() + 0.5
    if delivery.status in (DeliveryStatus.PENDING, DeliveryStatus.RETRYING) and delivery.next_attempt_at:
        early = (delivery.next_attempt_at - now) - DUE_TOLERANCE
        if early > timedelta(0):
            return (delivery.next_attempt_at - now).total_seconds()
    return None


def _claim(delivery_id: int, *, now: datetime, worker: str) -> tuple[uuid.UUID, DeliveryAttempt] | None:
    """Take the delivery for one attempt, or return None when it is not ours to send now."""
    token = uuid.uuid4()
    with transaction.atomic(durable=True):
        claimed = (
            Delivery.objects.filter(pk=delivery_id)
            .filter(
                Q(status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING])
                & (Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now + DUE_TOLERANCE))
                | Q(status=DeliveryStatus.SENDING, lease_until__lt=now)
            )
            .update(
                status=DeliveryStatus.SENDING, claim=token, lease_until=now + timedelta(seconds=lease_seconds()),
                attempts=F("attempts") + 1, last_attempt_at=now, updated_at=now,
            )
        )
        if not claimed:
            return None
        number = Delivery.objects.values_list("attempts", flat=True).get(pk=delivery_id)
        # An attempt still "in flight" belongs to a sender that lost its lease (killed worker).
        DeliveryAttempt.objects.filter(delivery_id=delivery_id, verdict=AttemptVerdict.SENDING).update(
            verdict=AttemptVerdict.INTERRUPTED, finished_at=now, error="worker_lost"
        )
        attempt = DeliveryAttempt.objects.create(delivery_id=delivery_id, number=number, started_at=now,
                                                 worker=worker[:200])
    return token, attempt


def _mark_broken(channel_id: int | None, *, url: str, outcome: transport.Outcome) -> None:
    if channel_id is None:
        return
    channel = Channel.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=channel_id).first()
    if channel is None:
        return
    fp = url_fingerprint(url)
    if channel.broken_at is not None and channel.broken_url_fp == fp:
        return
    channel.broken_at = timezone.now()
    channel.broken_error = (outcome.error or f"http_{outcome.status}")[:100]
    channel.broken_status = outcome.status
    channel.broken_url_fp = fp
    channel.save(update_fields=["broken_at", "broken_error", "broken_status", "broken_url_fp", "updated_at"])
    audit_record(actor=None, action="notifications.channel.broken", obj=channel, tenant_id=channel.tenant_id,
                 after={"error": channel.broken_error, "status": outcome.status, "url": channel.masked_url()})


def _mark_repaired(channel_id: int | None, *, url: str | None = None, actor: Any = None,
                   by: str = "a delivered message") -> None:
    """Clear the channel's broken flag, if it is set, with its "repaired" audit row (by: what repaired it).

    url: where the message that proves it was delivered. One delivered to another URL than the broken one
    (posted to the old URL while the new one was refused) proves nothing and leaves the flag. Inside the
    caller's transaction, which holds the delivery's row already (a delivery before its channel)."""
    if channel_id is None:
        return
    channel = (Channel.objects.select_for_update(of=("self",)).select_related("tenant")
               .filter(pk=channel_id, broken_at__isnull=False).first())
    if channel is None:
        return
    if url is not None and channel.is_broken and channel.broken_url_fp != url_fingerprint(url):
        return
    before = {"broken_error": channel.broken_error}
    channel.broken_at, channel.broken_error, channel.broken_status, channel.broken_url_fp = None, "", None, ""
    channel.save(update_fields=["broken_at", "broken_error", "broken_status", "broken_url_fp", "updated_at"])
    audit_record(actor=actor, action="notifications.channel.repaired", obj=channel, tenant_id=channel.tenant_id,
                 before=before, after={"broken_error": "", "by": by})


def _budget_start(delivery: Delivery) -> datetime:
    """When the delivery's current budget of attempts began: its first attempt since creation or the last requeue."""
    started = (DeliveryAttempt.objects.filter(delivery_id=delivery.pk, number=delivery.requeued_after + 1)
               .values_list("started_at", flat=True).first())
    return started or delivery.created_at


def _record(delivery_id: int, *, token: uuid.UUID, attempt: DeliveryAttempt, url: str,
            outcome: transport.Outcome, window: timedelta | None = None,
            test_budget: tuple[float, int] | None = None) -> SendResult:
    now = timezone.now()
    window = retry_window() if window is None else window
    with transaction.atomic(durable=True):
        delivery = Delivery.objects.select_for_update().get(pk=delivery_id)
        attempt.finished_at = now
        attempt.status_code = outcome.status
        attempt.error = outcome.error[:200]
        attempt.retry_after = outcome.retry_after
        if outcome.delivered:
            attempt.verdict = AttemptVerdict.DELIVERED
            attempt.save()
            # The message got through whoever holds the claim now: it is delivered.
            if delivery.status != DeliveryStatus.DELIVERED:
                delivery.status = DeliveryStatus.DELIVERED
                delivery.delivered_at = now
                delivery.last_status_code, delivery.last_error = outcome.status, ""
                delivery.lease_until = delivery.claim = delivery.next_attempt_at = None
                delivery.save()
            _mark_repaired(delivery.channel_id, url=url)
            return SendResult(status=DeliveryStatus.DELIVERED, posted=True)
        attempt.verdict = AttemptVerdict.RETRY if outcome.retryable else AttemptVerdict.PERMANENT
        if delivery.claim != token or delivery.status != DeliveryStatus.SENDING:
            # Our lease ran out and another sender took over (or finished): its result counts.
            attempt.save()
            return SendResult(status=delivery.status, posted=True, error=outcome.error)
        delivery.last_status_code, delivery.last_error = outcome.status, outcome.error[:200]
        delivery.lease_until = delivery.claim = None
        retry_in = None
        tries = delivery.attempts - delivery.requeued_after
        if delivery.event == Event.TEST:
            # The lead reads the receiver's own words on the page: its answer's first line, when it is not the error.
            said = " ".join(outcome.body.split())[:100]
            if said and said != outcome.error:
                delivery.last_error = f"{outcome.error}: {said}"[:200]
        if outcome.retryable and delivery.event == Event.TEST:
            # A test message checks the receiver now: a few tries within a minute or so, then its answer is final.
            delay = transport.retry_delay(outcome, tries - 1, base_s=_backoff_base(), cap_s=_backoff_cap())
            limit = timedelta(seconds=test_retry_seconds() if test_budget is None else test_budget[0])
            attempts_allowed = test_max_attempts() if test_budget is None else test_budget[1]
            if tries < attempts_allowed and now + timedelta(seconds=delay) - _budget_start(delivery) <= limit:
                delivery.status = DeliveryStatus.RETRYING
                delivery.next_attempt_at = attempt.next_attempt_at = now + timedelta(seconds=delay)
                retry_in = delay
            else:
                delivery.status = DeliveryStatus.FAILED
                delivery.next_attempt_at = None
                delivery.last_error = f"{delivery.last_error} (test message: gave up after {tries} attempts)"[:200]
        elif outcome.retryable and (tries < max_attempts() or now - _budget_start(delivery) < window):
            delay = transport.retry_delay(outcome, tries - 1, base_s=_backoff_base(),
                                          cap_s=_backoff_cap())
            if tries >= max_attempts():
                # Past the attempts, in the retry window: a receiver's "Retry-After: 1" waits the backoff all the
                # same (it would otherwise cost an attempt a second, a day long).
                delay = max(delay, transport.backoff(tries - 1, base_s=_backoff_base(), cap_s=_backoff_cap()))
            delivery.status = DeliveryStatus.RETRYING
            delivery.next_attempt_at = attempt.next_attempt_at = now + timedelta(seconds=delay)
            retry_in = delay
        elif outcome.retryable:
            delivery.status = DeliveryStatus.FAILED
            delivery.next_attempt_at = None
            delivery.last_error = f"{outcome.error} (gave up after {tries} attempts)"[:200]
        else:
            delivery.status = DeliveryStatus.FAILED
            delivery.next_attempt_at = None
            _mark_broken(delivery.channel_id, url=url, outcome=outcome)
        attempt.save()
        delivery.save()
    return SendResult(status=delivery.status, retry_in=retry_in, posted=True, error=outcome.error)


def delivery_send(*, delivery_id: int, worker: str = "") -> SendResult:
    """Make one attempt at a delivery if it is due and nobody else is on it; say when to come back."""
    now = timezone.now()
    delivery = Delivery.objects.select_related("channel__tenant").filter(pk=delivery_id).first()
    if delivery is None:
        return SendResult(status="missing")
    if delivery.status in TERMINAL_STATUSES:
        return SendResult(status=delivery.status)
    wait = _wait_for(delivery, now)
    if wait is not None:
        return SendResult(status=delivery.status, retry_in=wait)
    channel = delivery.channel
    reason = _skip_reason(delivery, channel)
    if reason:
        return _finish(delivery.pk, status=DeliveryStatus.SKIPPED, error=reason)
    url = channel.target_url()
    if not channel.is_platform:
        # Checked again at every send: the name may point somewhere else now than when it was saved.
        problem = egress.destination_problem(url)
        if problem:
            return _finish(delivery.pk, status=DeliveryStatus.FAILED, error=f"blocked_destination: {problem}")
    # Read before the claim: a bad setting claims nothing.
    timeout, deadline, window = http_timeout(), http_deadline(), retry_window()
    test_budget = (test_retry_seconds(), test_max_attempts()) if delivery.event == Event.TEST else None
    secrets: list[str] = []
    if delivery.kind == ChannelKind.WEBHOOK:
        # Before the claim too: signing failing after it left the delivery "sending" until its lease ran out, for
        # the sweeper to queue again, for ever. A secret that is no key fails it, saying so (rotate, then retry).
        try:
            secrets = _secrets_for(channel, timezone.now())
        except ValueError as exc:
            return _finish(delivery.pk, status=DeliveryStatus.FAILED, error=f"secret_invalid: {exc}")
    # Take the webhook's one-per-second slot before the row: a slot wasted on a lost claim is harmless.
    wait = ratelimit.acquire(_redis(), ratelimit.key_for_url(url), _min_interval())
    if wait > 0 and test_budget is not None and (
            timezone.now() + timedelta(seconds=wait) - _budget_start(delivery)).total_seconds() > test_budget[0]:
        # The receiver asked for a long pause (a 429's Retry-After): the lead learns that now, not after it.
        return _finish(delivery.pk, status=DeliveryStatus.FAILED,
                       error=f"rate_limited: the receiver asked for a pause of {wait:.0f} s (Retry-After); not sent")
    if wait > _min_interval():
        # The webhook is held (a 429's Retry-After, up to the backoff cap): the row says when this message comes
        # back, or the sweeper took it for lost (its next attempt long past) and queued a copy every time its own
        # hold ran out, each copy alive until the delivery ends. Not for the ordinary per-second slot: no write.
        due = timezone.now() + timedelta(seconds=wait)
        Delivery.objects.filter(
            Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lt=due),
            pk=delivery.pk, status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING],
        ).update(next_attempt_at=due)
    if wait > 0:
        # Jitter: many messages queued for one webhook would otherwise all wake in the same instant.
        return SendResult(status=delivery.status, retry_in=wait + random.uniform(0, _min_interval()))  # noqa: S311
    claimed = _claim(delivery.pk, now=timezone.now(), worker=worker)
    if claimed is None:
        return _come_back(delivery.pk)
    token, attempt = claimed
    body = delivery.body.encode("utf-8")
    headers: dict[str, str] = {}
    if delivery.kind == ChannelKind.WEBHOOK:
        # Signed afresh on every attempt (new timestamp), always with the same webhook-id.
        headers = signing.sign_headers(secrets, body, msg_id=delivery.message_id)
    if channel.is_platform:  # the operator's own URL: never checked
        outcome = transport.post(url, body, headers, timeout=timeout, deadline=deadline,
                                 slack=delivery.kind == ChannelKind.SLACK)
    else:
        # Checked again on the connection itself: a name re-pointed since the check above (DNS rebinding).
        with egress.public_session() as session:
            outcome = transport.post(url, body, headers, timeout=timeout, deadline=deadline,
                                     slack=delivery.kind == ChannelKind.SLACK, session=session)
    if outcome.status == 429 and outcome.retry_after:
        # The limit is the webhook's: every message to it waits (capped as the retry itself is), rather than
        # being posted into the limit one per second, each spending an attempt on another 429.
        try:
            ratelimit.hold(_redis(), ratelimit.key_for_url(url), min(outcome.retry_after, _backoff_cap()))
        except Exception:  # noqa: BLE001 - Redis down: the outcome still has to be recorded
            logger.warning("could not hold the send slot of a rate-limited webhook", exc_info=True)
    return _record(delivery.pk, token=token, attempt=attempt, url=url, outcome=outcome, window=window,
                   test_budget=test_budget)


def delivery_requeue(*, actor: Any, delivery: Delivery) -> Delivery:
    """Send a failed or skipped delivery again (an admin's or lead's "retry now")."""
    with transaction.atomic(durable=True):
        _lock_rights(actor=actor, tenant_id=delivery.tenant_id)  # before the delivery's row, as everywhere
        delivery = Delivery.objects.select_for_update().filter(pk=delivery.pk).first()
        if delivery is None:  # pruned meanwhile (deliveries_prune)
            raise InvalidState("This delivery is no longer kept; nothing to retry.")
        if delivery.status not in (DeliveryStatus.FAILED, DeliveryStatus.SKIPPED, DeliveryStatus.RETRYING):
            raise InvalidState(f"Delivery #{delivery.pk} is {delivery.status}; nothing to retry.")
        if not delivery.body:
            raise InvalidState("This delivery could not be built; it cannot be sent.")
        if delivery.channel_id is None:  # (the log keeps it, by its label): the worker would only skip it again
            raise InvalidState("The channel of this delivery has been deleted; there is nowhere to send it.")
        before = {"status": delivery.status, "attempts": delivery.attempts, "last_error": delivery.last_error}
        delivery.status = DeliveryStatus.PENDING
        delivery.next_attempt_at = timezone.now()
        delivery.requeued_after = delivery.attempts  # a fresh budget of attempts, counted from here
        delivery.save()
        # Sending it again means sending on the channel: a broken one is repaired, on the record as any repair.
        _mark_repaired(delivery.channel_id, actor=actor, by=f"retrying delivery #{delivery.pk}")
        audit_record(actor=actor, action="notifications.delivery.requeue", obj=delivery,
                     tenant_id=delivery.tenant_id, before=before, after={"status": delivery.status})
        _enqueue([delivery.pk])
    return delivery


# After the sweeper queues a delivery again it leaves it this long to that message: a delivery late because the
# queue is behind (its own message waits there) is not queued again every minute, one more copy each time.
SWEEP_HOLD_S = 300
SWEEP_KEY_PREFIX = "portal:notify:swept:"


def _sweep_key(pk: int, message_id: str, attempts: int) -> str:
    # The message id tells a row apart from an earlier one with the same id (a database restored or recreated);
    # the attempt count lets a delivery that moved on (and is stuck again) be queued at once.
    return f"{SWEEP_KEY_PREFIX}{pk}:{message_id}:{attempts}"


def _not_swept_lately(ids: list[int], limit: int) -> list[int]:
    """Of these stuck deliveries, the first `limit` the sweeper has not queued within SWEEP_HOLD_S (marking them)."""
    rows = Delivery.objects.filter(pk__in=ids).order_by("id").values_list("id", "message_id", "attempts")
    keys = [(pk, _sweep_key(pk, message_id, attempts)) for pk, message_id, attempts in rows]
    chosen: list[int] = []
    try:
        client = _redis()
        position = 0
        while position < len(keys) and len(chosen) < limit:
            batch = keys[position:position + limit - len(chosen)]
            position += len(batch)
            pipe = client.pipeline(transaction=False)
            for _, key in batch:
                pipe.set(key, "1", nx=True, ex=SWEEP_HOLD_S)
            chosen += [pk for (pk, _), fresh in zip(batch, pipe.execute(), strict=True) if fresh]
    except Exception:  # noqa: BLE001 - Redis down: queue them all (the broker is Redis too; it may be back by then)
        logger.warning("could not check which stuck deliveries were queued lately", exc_info=True)
        return [pk for pk, _ in keys][:limit]
    return chosen


def deliveries_requeue_stuck(*, now: datetime | None = None, grace_s: float = 60.0, limit: int = 500) -> list[int]:
    """Queue again every open delivery nobody is working on (beat): the belt to acks_late's braces.

    One the sweeper queued within SWEEP_HOLD_S is left to that message (under a backlog it waits in the queue,
    as the delivery's own retry does); a lost one is queued again after the hold."""
    ids = selectors.stuck_delivery_ids(now=now or timezone.now(), grace=timedelta(seconds=grace_s), limit=limit * 10)
    ids = _not_swept_lately(ids, limit)
    if ids:
        logger.warning("requeueing %d stuck deliveries", len(ids))
        _enqueue(ids)
    return ids


def deliveries_prune(*, now: datetime | None = None, batch: int = 10_000, max_batches: int = 1) -> int:
    """Delete finished deliveries (and their attempt logs) untouched for PORTAL_NOTIFY_RETENTION_DAYS (beat).

    Only delivered, failed and skipped ones: nothing more happens to them unless someone requeues
    one, which touches it (updated_at) and so keeps it another retention period; the rows are
    locked while they go, so a requeue racing the prune either wins (and the row stays) or finds
    the row gone. Open deliveries are never pruned, however old. Up to ``max_batches`` batches of
    ``batch``, each its own transaction; the beat's hourly run takes as many as it needs
    (notifications.tasks), so a busy cluster or a backlog the beat left while down is drained.
    """
    days = int(_setting("PORTAL_NOTIFY_RETENTION_DAYS", 90))
    cutoff = (now or timezone.now()) - timedelta(days=days)
    pruned = 0
    for _ in range(max_batches):
        with transaction.atomic():
            ids = list(
                Delivery.objects.select_for_update(skip_locked=True)
                .filter(status__in=TERMINAL_STATUSES, created_at__lt=cutoff, updated_at__lt=cutoff)
                .order_by("id").values_list("id", flat=True)[:batch]
            )
            if ids:
                # Two statements by id, not Model.delete(): the collector would load every row whole
                # (body, payload) and delete them 100 at a time while the batch's locks are held.
                with connection.cursor() as cur:
                    cur.execute("DELETE FROM notifications_deliveryattempt WHERE delivery_id = ANY(%s)", [ids])
                    cur.execute("DELETE FROM notifications_delivery WHERE id = ANY(%s)", [ids])
                    pruned += cur.rowcount
        if len(ids) < batch:
            break
    if pruned:
        logger.info("pruned %d deliveries finished more than %d days ago", pruned, days)
    return pruned
