"""Fill model rows' blank sizes from their upstreams (GET /v1/models) or weights_dir's
config.json, as the registry does when it first serves a row: for operators, after adding a
row or pointing it at another model (blank its sizes first)."""

from django.core.management.base import BaseCommand, CommandError

from api.models import SIZE_FIELDS, LanguageModel
from api.services import ModelSizesUnknown, language_model_sizes_fill


class Command(BaseCommand):
    help = (
        "acs_model_sizes [MODEL ...] fills the blank sizes of the named models (default: every "
        "model), and prints each model's sizes."
    )

    def add_arguments(self, parser):
        parser.add_argument("models", nargs="*", help="model ids clients send as model")

    def handle(self, *args, models, **options):
        rows = LanguageModel.objects.defer("tokenizer_json").order_by("name")
        if models:
            rows = rows.filter(name__in=models)
            unknown = sorted(set(models) - {row.name for row in rows})
            if unknown:
                raise CommandError(f"No model is called {', '.join(map(repr, unknown))}.")
        failures = []
        for row in rows:
            try:
                language_model_sizes_fill(model=row)
            except ModelSizesUnknown as error:
                failures.append(str(error))
                continue
            sizes = " ".join(f"{name}={getattr(row, name)}" for name in SIZE_FIELDS)
            self.stdout.write(f"{row.name}: {sizes}")
        if failures:
            raise CommandError("\n".join(failures))
