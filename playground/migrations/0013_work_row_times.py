from django.db import migrations, models

OLD_RUN_INDEX = "playground__user_id_a8d579_idx"
RUN_INDEX = "playground__user_id_08d14d_idx"


class Migration(migrations.Migration):
    """The start and end times have one name each across every work table
    (`infra.lifecycle.WorkRow`): a run's `queued_at` is its `created_at`, a job submission's
    `sent_at` (when the API took or refused it) its `finished_at`."""

    dependencies = [
        ("playground", "0012_work_status"),
    ]

    operations = [
        migrations.RenameField(model_name="run", old_name="queued_at", new_name="created_at"),
        migrations.RenameField(
            model_name="jobsubmission", old_name="sent_at", new_name="finished_at"
        ),
        migrations.AlterModelOptions(name="run", options={"ordering": ["-created_at"]}),
        # The index on (user, -queued_at) is the one on (user, -created_at) once its column
        # is renamed: the database renames it, not rebuilds it.
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RenameIndex(
                    model_name="run", old_name=OLD_RUN_INDEX, new_name=RUN_INDEX
                ),
            ],
            state_operations=[
                migrations.RemoveIndex(model_name="run", name=OLD_RUN_INDEX),
                migrations.AddIndex(
                    model_name="run",
                    index=models.Index(fields=["user", "-created_at"], name=RUN_INDEX),
                ),
            ],
        ),
    ]
