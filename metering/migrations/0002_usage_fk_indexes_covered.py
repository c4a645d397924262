"""Drop the single-column foreign-key indexes of the usage tables that composite indexes
already cover (usage records: (user, -created_at) and (key, -created_at); daily roll-up:
(user, day)): every batch the gateway writes maintains each index of these tables.

The indexes go with DROP INDEX CONCURRENTLY, outside a transaction, so that the gateway's
writes are not blocked while they go (altering the fields would drop and re-add the foreign
keys, which validates every row under a lock)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

# (table, index, column) of each index dropped.
INDEXES = [
    ("accounts_usagedaily", "accounts_usagedaily_user_id_64d6d60d", "user_id"),
    ("accounts_usagerecord", "accounts_usagerecord_key_id_e82e0803", "key_id"),
    ("accounts_usagerecord", "accounts_usagerecord_user_id_eb2884ed", "user_id"),
]


def _concurrently(schema_editor) -> str:
    return "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""


def drop_indexes(apps, schema_editor):
    for _, index, _ in INDEXES:
        schema_editor.execute(f'DROP INDEX {_concurrently(schema_editor)}IF EXISTS "{index}"')


def create_indexes(apps, schema_editor):
    for table, index, column in INDEXES:
        schema_editor.execute(
            f'CREATE INDEX {_concurrently(schema_editor)}IF NOT EXISTS "{index}"'
            f' ON "{table}" ("{column}")'
        )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("accounts", "0007_metering_models_moved"),
        ("metering", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="usagedaily",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                migrations.AlterField(
                    model_name="usagerecord",
                    name="key",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="usage_records",
                        to="accounts.apikey",
                    ),
                ),
                migrations.AlterField(
                    model_name="usagerecord",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="usage_records",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(drop_indexes, create_indexes)],
        )
    ]
