"""Tenant channels that hear of their cluster (cluster.ready) also hear that its kubeconfig was issued again.

New channels get every event by default; a channel made before this event existed kept the list it had, so
its team was never told that the kubeconfig they downloaded stops working. A team that unticked cluster.ready
chose not to hear of its cluster and is left as it is.
"""

from django.db import migrations

EVENT = "cluster.credentials_renewed"


def forwards(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        cur.execute(
            "UPDATE notifications_channel SET events = array_append(events, %s)"
            " WHERE tenant_id IS NOT NULL AND 'cluster.ready' = ANY(events) AND NOT (%s = ANY(events))",
            [EVENT, EVENT],
        )


def backwards(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        cur.execute("UPDATE notifications_channel SET events = array_remove(events, %s)", [EVENT])


class Migration(migrations.Migration):
    dependencies = [("notifications", "0001_initial")]

    operations = [migrations.RunPython(forwards, backwards)]
