"""What an audit row's action code ("reservation.create") says in words ("Booked"), for the portal's pages.

The codes stay what is stored, filtered on and exported; only what a reader sees is worded. A code not
listed here (a new one) still reads as words: "cluster.allocating_nodes" → "Cluster: allocating nodes".
"""

from __future__ import annotations

from django import template

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
