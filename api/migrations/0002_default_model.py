from django.conf import settings
from django.db import migrations


def create_default_model(apps, schema_editor):
    """The embedded engine's row. Its sizes are a copy typed here, kept because the columns
    needed a value when this ran (and existing databases ran it so): 0005 blanks them while
    the row points at the engine, and the registry fills them from the engine itself."""
    LanguageModel = apps.get_model("api", "LanguageModel")
    LanguageModel.objects.get_or_create(
        name="smollm2-135m",
        defaults={
            "upstream_urls": [settings.ENGINE_URL],
            "activation_upstream_urls": [],
            "max_model_len": 8192,
            "n_layers": 30,
            "hidden_size": 576,
            "vocab_size": 49152,
            "supports_activations": True,
            "max_logprobs": 100,
            "status": "live",
            "is_default": True,
        },
    )


def remove_default_model(apps, schema_editor):
    apps.get_model("api", "LanguageModel").objects.filter(name="smollm2-135m").delete()


class Migration(migrations.Migration):
    dependencies = [("api", "0001_language_model")]

    operations = [migrations.RunPython(create_default_model, remove_default_model)]
