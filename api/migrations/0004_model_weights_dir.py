from django.conf import settings
from django.db import migrations, models


def engine_weights_dir(apps, schema_editor):
    """The registry row the first migration created for the embedded engine, while it still
    points at the engine, gets the engine's weights directory."""
    LanguageModel = apps.get_model("api", "LanguageModel")
    for model in LanguageModel.objects.filter(name="smollm2-135m", weights_dir=""):
        if model.upstream_urls == [settings.ENGINE_URL]:
            model.weights_dir = settings.ENGINE_WEIGHTS_DIR
            model.save(update_fields=["weights_dir"])


class Migration(migrations.Migration):
    dependencies = [("api", "0003_model_tokenizer")]

    operations = [
        migrations.AddField(
            model_name="languagemodel",
            name="weights_dir",
            field=models.CharField(
                blank=True,
                help_text="The model's directory on the web and worker machines (config.json, "
                "model.safetensors, tokenizer.json: what vLLM serves it from). When set, the "
                "playground shows the logit lens and direct logit attribution of capture runs.",
                max_length=500,
            ),
        ),
        migrations.RunPython(engine_weights_dir, migrations.RunPython.noop),
    ]
