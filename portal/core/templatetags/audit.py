"""What an audit row's action code ("reservation.create") says in words ("Booked"), for the portal's pages,
and the fields of its before and after ("max_nodes" → "Max nodes", status "confirmed" → "Confirmed").

The codes stay what is stored, filtered on and exported (the admin shows them as stored); only what a
reader sees is worded. A code not listed here (a new one) still reads as words:
"cluster.allocating_nodes" → "Cluster: allocating nodes", "retry_in_s" → "Retry in s".
"""

from __future__ import annotations

import json

from django import template

from ..actors import STAFF_WORDS, actor_name

register = template.Library()

ACTION_WORDS: dict[str, str] = {
    # reservations (a reservation's own timeline leaves out the "reservation" subject)
    "reservation.create": "Booked",
    "reservation.update": "Changed",
    "reservation.cancel": "Cancelled",
    "reservation.cancelled": "Cancelled",
    "reservation.reopen": "Reopened",
    "reservation.replace_node": "Node replaced",
    "reservation.confirmed": "Confirmed",
    "reservation.provisioning": "Provisioning started",
    "reservation.active": "Started",
    "reservation.ending": "Ending",
    "reservation.completed": "Completed",
    "reservation.failed": "Failed",
    "reservation.starting_soon": "Reminder sent: starting soon",
    "reservation.ending_soon": "Reminder sent: ending soon",
    # virtual clusters
    "cluster.create": "Cluster requested",
    "cluster.configure": "Cluster configured",
    "cluster.attempt_failed": "Cluster: a provisioning attempt failed",
    "cluster.retry": "Cluster provisioning retried",
    "cluster.credential_download": "Cluster credentials downloaded",
    "cluster.credential_issued": "Cluster credentials issued",
    "cluster.credentials_rotated": "Cluster credentials rotated",
    "cluster.node_swapped": "Cluster node swapped",
    "cluster.volume_attached": "Storage volume attached",
    "health_check.request": "Health check requested",
    "repair.recommended": "Repair recommended",
    "repair.retest_passed": "Repair re-test passed",
    "repair.retest_failed": "Repair re-test failed",
    # the team and the tenant
    "membership.create": "Member added",
    "membership.update": "Member's role changed",
    "membership.delete": "Member removed",
    "quota.create": "Quota added",
    "quota.update": "Quota changed",
    "quota.delete": "Quota removed",
    "tenant.create": "Tenant created",
    "tenant.update": "Tenant settings changed",
    "tenant.ical_token_rotate": "Calendar feed address renewed",
    "tenant.slack_webhook": "Slack webhook URL changed",
    "token.issue": "API token created",
    "token.revoke": "API token revoked",
    # notifications
    "notifications.slack.update": "Slack events changed",
    "notifications.platform.update": "Platform Slack channel changed",
    "notifications.webhook.create": "Webhook added",
    "notifications.webhook.update": "Webhook changed",
    "notifications.webhook.rotate": "Webhook signing secret rotated",
    "notifications.channel.delete": "Notification channel deleted",
    "notifications.channel.broken": "Notification channel stopped (delivery failing)",
    "notifications.channel.repaired": "Notification channel resumed",
    "notifications.delivery.requeue": "Notification sent again",
    "notifications.test": "Test message sent",
    # the fleet and the platform
    "node.create": "Node added",
    "node.update": "Node changed",
    "node.maintenance": "Maintenance scheduled",
    "node.maintenance.withdraw": "Maintenance withdrawn",
    "node.maintenance.end": "Maintenance ended early",
    "pool.create": "Pool added",
    "pool.update": "Pool changed",
    "pool.capability.update": "Pool capability changed",
    "pool.capability.delete": "Pool capability removed",
    "group.create": "Group created",
    "group.update": "Group changed",
    "group.delete": "Group deleted",
    "user.create": "User created",
    "user.update": "User changed",
    "user.delete": "User deleted",
    "user.set_password": "Password set",
    "outbox.requeue": "Event queued again",
}


def action_words(code: str) -> str:
    """The action in words: the table's, else the code's own parts ("cluster.allocating_nodes" →
    "Cluster: allocating nodes")."""
    code = str(code or "")
    if code in ACTION_WORDS:
        return ACTION_WORDS[code]
    subject, _, rest = code.partition(".")
    subject = subject.replace("_", " ").strip().capitalize()
    rest = rest.replace(".", " ").replace("_", " ").strip()
    return f"{subject}: {rest}" if subject and rest else subject or "—"


@register.filter
def action_label(code: str) -> str:
    return action_words(code)


@register.filter
def actor_for(actor, viewer) -> str:
    """Who acted, as viewer (the signed-in user) may see it: "platform staff" for a staff account unless
    viewer is staff; "" for no actor, so a page adds its own default ("the system", "—")."""
    return actor_name(actor, viewer=viewer, staff=STAFF_WORDS) or ""


# An audited field's name in words, where its name alone does not read well ("node_count" is the nodes booked).
FIELD_WORDS: dict[str, str] = {
    "node_count": "Nodes",
    "max_nodes": "Max nodes",
    "burst_nodes": "Burst nodes",
    "max_duration_hours": "Max duration (hours)",
    "gpus_per_node": "GPUs per node",
    "gpu_model": "GPU model",
    "slot_minutes": "Slot (minutes)",
    "on_demand_rate": "On-demand rate",
    "storage_quota_tib": "Storage quota (TiB)",
    "vlan_id": "VLAN",
    "cidr": "CIDR",
    "size_gib": "Size (GiB)",
    "retry_in_s": "Retry in (seconds)",
    "url": "URL",
    "slack_webhook_url": "Slack webhook URL",
    "state_reason": "Reason",
    "expires_at": "Expires",
    "previous_valid_until": "Previous valid until",
    "cuda_version": "CUDA version",
    "cuda_versions": "CUDA versions",
    "slurm_versions": "Slurm versions",
    "kubernetes_versions": "Kubernetes versions",
    "mig_profiles": "MIG profiles",
    "is_active": "Active",
    "is_staff": "Staff",
    "is_superuser": "Superuser",
    "burst_enabled": "Burst allowed",
}
# Fields whose values are codes from a fixed list (a status, a role): shown as words too.
CODED_FIELDS = frozenset({"status", "billing", "role", "state", "phase", "kind", "verdict", "level",
                          "orchestrator", "recommended_action", "events"})
# A coded value whose own words do not read well ("ssh_key" is not "Ssh key"), by field. An app above core
# adds its own with value_words_add (notifications: its events' labels), as core imports no app above it.
VALUE_WORDS: dict[str, dict[str, str]] = {
    "kind": {"ssh_key": "SSH key", "kubeconfig": "Kubeconfig", "slack": "Slack", "webhook": "Signed webhook",
             "reservation": "Reservation", "maintenance": "Maintenance window"},
    "orchestrator": {"slurm": "Slurm", "kubernetes": "Kubernetes"},
}


def value_words_add(key: str, words: dict[str, str]) -> None:
    """Word the coded values of field key as words says (an app's ready() calls this)."""
    VALUE_WORDS.setdefault(key, {}).update({str(code): str(word) for code, word in words.items()})


def field_words(key: str) -> str:
    """An audited field's name in words: the table's, else its own ("state_reason" style → "State reason")."""
    key = str(key or "")
    if key in FIELD_WORDS:
        return FIELD_WORDS[key]
    return key.replace("_", " ").strip().capitalize() or "—"


def field_value_words(key: str, value):
    """A value as a reader reads it: a coded value in words ("confirmed" → "Confirmed", "ssh_key" → "SSH key",
    "reservation.confirmed" → "Reservation confirmed"), a flag as yes/no, a list as its items in words,
    comma-separated ("none" when empty); others as they are."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        items = [field_value_words(key, item) for item in value]
        return ", ".join(i if isinstance(i, str) else json.dumps(i, default=str) for i in items) or "none"
    if isinstance(value, str) and value in VALUE_WORDS.get(key, {}):
        return VALUE_WORDS[key][value]
    if key in CODED_FIELDS and isinstance(value, str) and value:
        return value.replace(".", " ").replace("_", " ").capitalize()
    return value


@register.filter
def audit_object_url(entry) -> str:
    """The page of an audit row's object (a reservation's, a cluster's), or "" where it has none."""
    from ..views import object_url

    return object_url(entry.object_type, entry.object_id)
