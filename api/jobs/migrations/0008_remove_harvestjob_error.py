from django.db import migrations


class Migration(migrations.Migration):
    """A harvest job's error is its `error_code` and `error_message` (0007 moved it there)."""

    dependencies = [
        ("jobs", "0007_work_row_errors"),
    ]

    operations = [
        migrations.RemoveField(model_name="harvestjob", name="error"),
    ]
