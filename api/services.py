"""Writes to the model registry."""

import hashlib
import json
from pathlib import Path

from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone
from tokenizers import Tokenizer

from .models import LanguageModel
from .upstream import ModelCardUnavailable, upstream_model_card

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


# Where a Hugging Face config.json keeps each of a model's sizes.
CONFIG_KEYS = {
    "max_model_len": "max_position_embeddings",
    "n_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
}


class ModelSizesUnknown(Exception):
    """Some of a model's sizes are blank and could not be filled; the message says what was
    tried and what staff can do."""


def language_model_sizes_fill(*, model: LanguageModel) -> None:
    """Fill `model`'s blank sizes (`LanguageModel.sizes_missing`) and save them: each from the
    first of its upstreams whose GET /v1/models lists the model (vLLM reports
    `max_model_len`; the embedded engine every size), else from config.json in its
    `weights_dir`. Sizes already set are kept, and so is a value staff set meanwhile. Raises
    ModelSizesUnknown, saving nothing, when any size stays blank. Makes HTTP requests (up to
    `upstream.MODELS_TIMEOUT_S` each): call it outside a transaction."""
    missing = model.sizes_missing
    if not missing:
        return
    reasons: list[str] = []
    found = _sizes_reported(model, missing, reasons)
    still_missing = [name for name in missing if name not in found]
    if still_missing:
        found |= _sizes_configured(model, still_missing, reasons)
    still_missing = [name for name in missing if name not in found]
    if still_missing:
        raise ModelSizesUnknown(
            f"The sizes {', '.join(still_missing)} of model '{model.name}' are blank and "
            f"could not be filled: {'; '.join(reasons)}. Staff: set the model's weights_dir "
            "to its directory (config.json), or the sizes themselves, in the admin."
        )
    # A value staff typed into a blank field since `model` was read wins over ours.
    LanguageModel.objects.filter(pk=model.pk).update(
        **{name: Coalesce(F(name), Value(value)) for name, value in found.items()},
        updated_at=timezone.now(),
    )
    for name, value in found.items():
        setattr(model, name, value)


def _sizes_reported(model: LanguageModel, wanted: list[str], reasons: list[str]) -> dict:
    """The `wanted` sizes the first upstream listing the model reports; appends to `reasons`
    why none or only some came."""
    urls = list(dict.fromkeys(model.upstream_urls + model.activation_upstream_urls))
    for url in urls:
        try:
            card = upstream_model_card(url, model.upstream_model_name)
        except ModelCardUnavailable as error:
            reasons.append(str(error))
            continue
        found = {name: card[name] for name in wanted if _is_size(card.get(name))}
        if len(found) < len(wanted):
            reported = ", ".join(found) or "none of them"
            reasons.append(f"{url} reports {reported} of its sizes")
        return found
    if not urls:
        reasons.append("it has no upstream URL")
    return {}


def _sizes_configured(model: LanguageModel, wanted: list[str], reasons: list[str]) -> dict:
    """The `wanted` sizes in config.json of the model's weights_dir; appends to `reasons`
    why any is not there."""
    if not model.weights_dir:
        reasons.append("it has no weights_dir to read config.json from")
        return {}
    path = Path(model.weights_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as error:
        reasons.append(f"its weights_dir's config.json cannot be read ({error.strerror})")
        return {}
    except ValueError:
        reasons.append("its weights_dir's config.json is not JSON")
        return {}
    if not isinstance(config, dict):
        reasons.append("its weights_dir's config.json is not a JSON object")
        return {}
    found = {
        name: config[CONFIG_KEYS[name]]
        for name in wanted
        if _is_size(config.get(CONFIG_KEYS[name]))
    }
    absent = [CONFIG_KEYS[name] for name in wanted if name not in found]
    if absent:
        reasons.append(f"its weights_dir's config.json gives no {', '.join(absent)}")
    return found


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
