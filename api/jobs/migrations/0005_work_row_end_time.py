from django.db import migrations


class Migration(migrations.Migration):
    """The end time has one name across every work table (`infra.lifecycle.WorkRow`)."""

    dependencies = [
        ("jobs", "0004_work_status"),
    ]

    operations = [
        migrations.RenameField(
            model_name="harvestjob", old_name="completed_at", new_name="finished_at"
        ),
    ]
