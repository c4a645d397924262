from django.db import migrations, models
from django.db.models import F


def runs_sent_when_queued(apps, schema_editor):
    """Every run before this migration was sent to the workers when it was queued."""
    apps.get_model("playground", "Run").objects.update(sent_at=F("queued_at"))


class Migration(migrations.Migration):
    dependencies = [
        ("playground", "0009_patching_kinds"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="sent_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(runs_sent_when_queued, migrations.RunPython.noop),
    ]
