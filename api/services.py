"""Writes to the model registry."""

import hashlib

from django.db import transaction
from tokenizers import Tokenizer

from .models import LanguageModel

# A real tokenizer.json is a few MB (Llama 3's is 9 MB); far more is not a tokenizer.
TOKENIZER_MAX_BYTES = 64 * 1024 * 1024


class InvalidTokenizer(ValueError):
    """The content is not a tokenizer.json the `tokenizers` library can load."""


def tokenizer_json_check(content: bytes) -> str:
    """The text of a tokenizer.json, or InvalidTokenizer saying what is wrong with it."""
    if len(content) > TOKENIZER_MAX_BYTES:
        raise InvalidTokenizer(
            f"The file is {len(content):,} bytes; a tokenizer.json is at most "
            f"{TOKENIZER_MAX_BYTES:,}."
        )
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidTokenizer("The file is not UTF-8 text.") from error
    try:
        Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises plain Exception for any malformed file
        raise InvalidTokenizer(f"The file is not a tokenizer.json: {error}") from error
    return text


@transaction.atomic
def language_model_tokenizer_set(*, model: LanguageModel, content: bytes | None) -> None:
    """Attach the HF tokenizer.json `content` to `model` (None detaches it). Raises
    InvalidTokenizer for a file the gateway could not load. Gateways pick the change up with
    the registry (within seconds) and cache the file by its hash."""
    if content is None:
        model.tokenizer_json, model.tokenizer_sha256 = "", ""
    else:
        model.tokenizer_json = tokenizer_json_check(content)
        model.tokenizer_sha256 = hashlib.sha256(content).hexdigest()
    model.save(update_fields=["tokenizer_json", "tokenizer_sha256", "updated_at"])
