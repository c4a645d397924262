"""JobSubmission belongs to the portal's Jobs page now (portal/migrations/0001): the model
leaves the playground's state only; its table, playground_jobsubmission, and its rows stay
where they are, and the portal's model names that table."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("playground", "0015_work_row_data")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="JobSubmission")],
            database_operations=[],
        )
    ]
