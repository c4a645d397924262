"""Attach a tokenizer.json to a model row (plain vLLM upstreams serve none), or detach it."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from api.models import LanguageModel
from api.services import InvalidTokenizer, language_model_tokenizer_set


class Command(BaseCommand):
    help = (
        "acs_model_tokenizer MODEL PATH attaches the tokenizer.json at PATH to MODEL; "
        "acs_model_tokenizer MODEL --remove detaches it."
    )

    def add_arguments(self, parser):
        parser.add_argument("model", help="the model id clients send as model")
        parser.add_argument("path", nargs="?", help="a HF tokenizer.json file")
        parser.add_argument("--remove", action="store_true", help="detach the tokenizer")

    def handle(self, *args, model, path, remove, **options):
        if bool(path) == remove:
            raise CommandError("Give either a tokenizer.json path or --remove.")
        language_model = LanguageModel.objects.defer("tokenizer_json").filter(name=model).first()
        if language_model is None:
            raise CommandError(f"No model is called {model!r}.")
        content = None
        if path:
            try:
                content = Path(path).read_bytes()
            except OSError as error:
                raise CommandError(f"Cannot read {path}: {error.strerror}.") from error
        try:
            language_model_tokenizer_set(model=language_model, content=content)
        except InvalidTokenizer as error:
            raise CommandError(str(error)) from error
        verb = "attached to" if content else "removed from"
        self.stdout.write(f"Tokenizer {verb} {model}.")
