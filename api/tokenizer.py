"""Prompt-token counting with each model's own tokenizer, so context-length checks and budget
reservations use the count the upstream will report.

The tokenizer is, in order: the tokenizer.json staff attached to the model row, else the one
in the row's `weights_dir` (the model's directory, which vLLM serves from and the lens reads:
plain vLLM serves no tokenizer file), else the one the upstream serves at /tokenizer.json
(the embedded engine does). It is loaded once per process; an attached or served one is
cached under `settings.ACS_TOKENIZER_CACHE_DIR`. Without any, the upstream counts each prompt
through its POST /tokenize, a round trip per prompt, and tokens have ids but no strings.
Token-id prompts count their ids.
"""

import asyncio
import hashlib
import logging
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from tokenizers import Tokenizer

from metering.sql import run_db

from . import upstream
from .models import LanguageModel

logger = logging.getLogger(__name__)

# Text longer than this is tokenized in a worker thread, off the event loop.
_INLINE_CHARS = 20_000
# How long to remember that no tokenizer could be had before looking again.
_MISSING_RETRY_S = 300.0

_tokenizers: dict[tuple[str, str], Tokenizer | None] = {}
_missing_until: dict[tuple[str, str], float] = {}
# One lock per event loop: an asyncio.Lock only works within one loop, and playground workers
# load tokenizers from several threads at once, each running its own loop (async_to_sync);
# a waiter on another loop than the holder's would never be woken.
_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache_path(model_name: str, source: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return Path(settings.ACS_TOKENIZER_CACHE_DIR) / f"{model_name}-{digest}.json"


async def load_tokenizer(model) -> Tokenizer | None:
    """The tokenizer of `model` (attached to its row, else in its weights directory, else from
    the first of its upstreams that serves one), or None if there is none."""
    if model.tokenizer_sha256:
        source = f"sha256:{model.tokenizer_sha256}"
    else:
        source = ",".join([model.weights_dir, *model.upstream_urls])
    cache_key = (model.name, source)
    if cache_key in _tokenizers:
        return _tokenizers[cache_key]
    if _missing_until.get(cache_key, 0.0) > time.monotonic():
        return None
    loop_locks = _locks.setdefault(asyncio.get_running_loop(), {})
    lock = loop_locks.setdefault(cache_key, asyncio.Lock())
    async with lock:
        if cache_key in _tokenizers:
            return _tokenizers[cache_key]
        if model.tokenizer_sha256:
            tokenizer = await _attached_tokenizer(model, source)
        else:
            tokenizer = await _directory_tokenizer(model) or await _served_tokenizer(model)
        if tokenizer is None:
            _missing_until[cache_key] = time.monotonic() + _MISSING_RETRY_S
            return None
        _tokenizers[cache_key] = tokenizer
        return tokenizer


async def _attached_tokenizer(model, source: str) -> Tokenizer | None:
    path = _cache_path(model.name, source)
    content = await asyncio.to_thread(_read_file, path)
    if content is None or hashlib.sha256(content).hexdigest() != model.tokenizer_sha256:
        text = await run_db(_attached_tokenizer_json, model.pk, model.tokenizer_sha256)
        if text is None:  # replaced since the registry was read; the next read has the new one
            return None
        content = text.encode()
        await asyncio.to_thread(_write_file, path, content)
    return await _parse(content)


def _attached_tokenizer_json(model_id: int, sha256: str) -> str | None:
    return (
        LanguageModel.objects.filter(pk=model_id, tokenizer_sha256=sha256)
        .values_list("tokenizer_json", flat=True)
        .first()
    )


async def _directory_tokenizer(model) -> Tokenizer | None:
    """The tokenizer.json of the row's weights directory, where this machine has it."""
    if not model.weights_dir:
        return None
    content = await asyncio.to_thread(_read_file, Path(model.weights_dir) / "tokenizer.json")
    return None if content is None else await _parse(content)


async def _served_tokenizer(model) -> Tokenizer | None:
    for url in model.upstream_urls:
        path = _cache_path(model.name, url)
        content = await asyncio.to_thread(_read_file, path)
        if content is None:
            content = await upstream.fetch_tokenizer_json(url)
            if content is None:
                continue
            await asyncio.to_thread(_write_file, path, content)
        tokenizer = await _parse(content)
        if tokenizer is not None:
            return tokenizer
    return None


async def _parse(content: bytes) -> Tokenizer | None:
    try:
        return await asyncio.to_thread(Tokenizer.from_str, content.decode())
    except Exception:  # a malformed file: count through /tokenize instead
        return None


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write_file(path: Path, content: bytes) -> None:
    """Cache `content` at `path`, atomically: replicas sharing the cache folder may write the
    same file at once. A cache that cannot be written is only a slower next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as file:
            file.write(content)
        Path(file.name).replace(path)
    except OSError:
        logger.warning("could not cache the tokenizer at %s", path, exc_info=True)


async def _encode(tokenizer: Tokenizer, texts: list[str], *, add_special_tokens: bool):
    """The token ids of each text: the one encoding that counts prompts and lists their
    tokens, so both always agree."""
    if sum(len(text) for text in texts) > _INLINE_CHARS:
        encodings = await asyncio.to_thread(
            tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens
        )
    else:
        # One by one: encode_batch hands short texts to its thread pool and waits for a
        # thread to be scheduled, which on a busy machine cost more than the encoding itself.
        encodings = [
            tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts
        ]
    return [encoding.ids for encoding in encodings]


async def count_prompt_tokens(model, prompts: list, *, add_special_tokens: bool) -> list[int]:
    """The token count of each prompt (a string or a token-id list) for `model`."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    counts_by_text: dict[int, int] = {}
    if texts:
        tokenizer = await load_tokenizer(model)
        if tokenizer is not None:
            id_lists = await _encode(tokenizer, texts, add_special_tokens=add_special_tokens)
        else:
            id_lists = await asyncio.gather(
                *(
                    upstream.upstream_tokenize(
                        model, prompt=text, add_special_tokens=add_special_tokens, activation=False
                    )
                    for text in texts
                )
            )
        counts_by_text = dict(enumerate(len(ids) for ids in id_lists))
    result, text_index = [], 0
    for prompt in prompts:
        if isinstance(prompt, str):
            result.append(counts_by_text[text_index])
            text_index += 1
        else:
            result.append(len(prompt))
    return result


@dataclass
class PromptTokens:
    """A prompt's tokens as the gateway counts them: the ids and, where the model's tokenizer
    is at hand, each token decoded on its own (as the API's logprobs show tokens); None where
    only the upstream's POST /tokenize could be asked."""

    ids: list[int]
    strings: list[str] | None


def _strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    # Special tokens included: the API's logprobs name them too (e.g. "<|im_end|>").
    return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in ids]


async def prompt_tokens(
    model, prompt: str | list[int], *, add_special_tokens: bool
) -> PromptTokens:
    """The tokens of one prompt (a string or a token-id list) for `model`, from the same
    tokenizer and encoding as `count_prompt_tokens`; without a local tokenizer the ids come
    from the activation upstream's POST /tokenize (raises ApiError when it fails)."""
    tokenizer = await load_tokenizer(model)
    if isinstance(prompt, list):
        ids = [int(token) for token in prompt]
    elif tokenizer is not None:
        ids = (await _encode(tokenizer, [prompt], add_special_tokens=add_special_tokens))[0]
    else:
        ids = await upstream.upstream_tokenize(
            model, prompt=prompt, add_special_tokens=add_special_tokens
        )
    return PromptTokens(ids=ids, strings=_strings(tokenizer, ids) if tokenizer else None)


async def token_strings(model, id_lists: list[list[int]]) -> list[list[str] | None]:
    """Each token of each list decoded on its own (as `PromptTokens.strings`); None for
    every list without a local tokenizer."""
    tokenizer = await load_tokenizer(model)
    return [_strings(tokenizer, ids) if tokenizer else None for ids in id_lists]


async def special_token_strings(model) -> frozenset[str]:
    """The strings of `model`'s special tokens (`<|im_end|>`, …), which upstreams leave out
    of generated text; empty without a local tokenizer."""
    tokenizer = await load_tokenizer(model)
    if tokenizer is None:
        return frozenset()
    # Asked for every request with logprobs: read once per tokenizer, which stays cached for
    # the process (so its id() is never reused), as `_ids_by_string` below.
    found = _special_by_tokenizer.get(id(tokenizer))
    if found is None:
        added = tokenizer.get_added_tokens_decoder().values()
        found = frozenset(token.content for token in added if token.special)
        _special_by_tokenizer[id(tokenizer)] = found
    return found


_special_by_tokenizer: dict[int, frozenset[str]] = {}


_ids_by_string: dict[int, dict[str, int | None]] = {}


async def token_ids_of_strings(model, strings: list[str]) -> list[int | None] | None:
    """The id of each token given as the API's logprobs show it (the token decoded alone),
    None for a string that no token or several tokens decode to alone (the pieces of a
    character: named "" or by the character they complete, as vLLM names them); None
    altogether without a local tokenizer."""
    tokenizer = await load_tokenizer(model)
    if tokenizer is None:
        return None
    table = _ids_by_string.get(id(tokenizer))
    if table is None:
        table = {}
        for token_id in range(tokenizer.get_vocab_size()):
            string = tokenizer.decode([token_id], skip_special_tokens=False)
            table[string] = None if string in table else token_id
        # Tokenizers stay cached for the process, so their id() is never reused.
        _ids_by_string[id(tokenizer)] = table
    return [table.get(string) for string in strings]
