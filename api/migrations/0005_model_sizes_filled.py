from django.conf import settings
from django.db import migrations, models

SIZE_HELP = (
    "Leave blank: filled from the upstream's GET /v1/models, else from config.json in "
    "weights_dir. A value given here is kept (e.g. a shorter context than the upstream's)."
)


def blank_engine_sizes(apps, schema_editor):
    """The sizes 0002 typed into the embedded engine's row are blanked while the row still
    points at the engine: the registry fills them from the engine's GET /v1/models (its
    config.json) when it first serves the row."""
    LanguageModel = apps.get_model("api", "LanguageModel")
    for model in LanguageModel.objects.filter(name="smollm2-135m"):
        if model.upstream_urls == [settings.ENGINE_URL]:
            model.max_model_len = model.n_layers = model.hidden_size = model.vocab_size = None
            model.save(update_fields=["max_model_len", "n_layers", "hidden_size", "vocab_size"])


class Migration(migrations.Migration):
    dependencies = [("api", "0004_model_weights_dir")]

    operations = [
        *(
            migrations.AlterField(
                model_name="languagemodel",
                name=name,
                field=models.PositiveIntegerField(blank=True, help_text=SIZE_HELP, null=True),
            )
            for name in ("hidden_size", "max_model_len", "n_layers", "vocab_size")
        ),
        # Not reversible: a blank row cannot go back to columns that need a value.
        migrations.RunPython(blank_engine_sizes),
    ]
