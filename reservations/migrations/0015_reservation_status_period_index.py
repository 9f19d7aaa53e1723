from django.db import migrations, models


class Migration(migrations.Migration):
    """The reservation lists filtered by status read their page off (status, period, id)."""

    dependencies = [("reservations", "0014_allocation_released_period_gist")]

    operations = [
        migrations.AddIndex(
            model_name="reservation",
            index=models.Index(fields=["status", "period", "id"], name="reservation_status_period_id"),
        ),
    ]
