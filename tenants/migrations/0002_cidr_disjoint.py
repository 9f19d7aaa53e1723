from django.db import migrations


class Migration(migrations.Migration):
    """Network segments of two tenants can never overlap (inet && under GiST)."""

    dependencies = [("tenants", "0001_initial")]

    operations = [
        migrations.RunSQL(
            sql=(
                "ALTER TABLE tenants_tenant ADD CONSTRAINT tenants_tenant_cidr_disjoint "
                "EXCLUDE USING gist ((cidr::inet) inet_ops WITH &&) WHERE (cidr <> '')"
            ),
            reverse_sql="ALTER TABLE tenants_tenant DROP CONSTRAINT tenants_tenant_cidr_disjoint",
        ),
    ]
