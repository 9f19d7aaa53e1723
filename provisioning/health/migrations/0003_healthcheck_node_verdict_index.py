from django.db import migrations, models


class Migration(migrations.Migration):
    """/metrics reads each node's newest check with a verdict off this index, one probe per node."""

    dependencies = [("health", "0002_healthcheck_health_check_recent")]

    operations = [
        migrations.AddIndex(
            model_name="healthcheck",
            index=models.Index(
                models.F("node"),
                models.OrderBy(models.F("finished_at"), descending=True, nulls_last=True),
                models.OrderBy(models.F("id"), descending=True),
                condition=~models.Q(verdict=""),
                name="health_check_node_verdict",
            ),
        ),
    ]
