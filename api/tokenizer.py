"""Prompt-token counting with each model's own tokenizer, so context-length checks and budget
reservations use the count the upstream will report.

The tokenizer is the HF `tokenizer.json` the upstream serves, fetched once and cached in
memory and under `settings.ACS_TOKENIZER_CACHE_DIR`. Upstreams without that file (plain vLLM)
are asked to count through their POST /tokenize instead. Token-id prompts count their ids.
"""

import asyncio
import hashlib
import time
from pathlib import Path

from django.conf import settings
from tokenizers import Tokenizer

from . import upstream

# Text longer than this is tokenized in a worker thread, off the event loop.
_INLINE_CHARS = 20_000
# How long to remember that an upstream serves no tokenizer.json before asking again.
_MISSING_RETRY_S = 300.0

_tokenizers: dict[tuple[str, str], Tokenizer | None] = {}
_missing_until: dict[tuple[str, str], float] = {}
_locks: dict[tuple[str, str], asyncio.Lock] = {}


def _cache_path(model_name: str, url: str) -> Path:
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(settings.ACS_TOKENIZER_CACHE_DIR) / f"{model_name}-{digest}.json"


async def load_tokenizer(model) -> Tokenizer | None:
    """The cached tokenizer of `model` (from the first of its upstreams that serves one), or
    None if none does."""
    cache_key = (model.name, ",".join(model.upstream_urls))
    if cache_key in _tokenizers:
        return _tokenizers[cache_key]
    if _missing_until.get(cache_key, 0.0) > time.monotonic():
        return None
    lock = _locks.setdefault(cache_key, asyncio.Lock())
    async with lock:
        if cache_key in _tokenizers:
            return _tokenizers[cache_key]
        tokenizer = None
        for url in model.upstream_urls:
            tokenizer = await _tokenizer_from(model.name, url)
            if tokenizer is not None:
                break
        if tokenizer is None:
            _missing_until[cache_key] = time.monotonic() + _MISSING_RETRY_S
            return None
        _tokenizers[cache_key] = tokenizer
        return tokenizer


async def _tokenizer_from(model_name: str, url: str) -> Tokenizer | None:
    path = _cache_path(model_name, url)
    content = await asyncio.to_thread(_read_file, path)
    if content is None:
        content = await upstream.fetch_tokenizer_json(url)
        if content is None:
            return None
        await asyncio.to_thread(_write_file, path, content)
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
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(content)
    temporary.replace(path)


async def count_prompt_tokens(model, prompts: list, *, add_special_tokens: bool) -> list[int]:
    """The token count of each prompt (a string or a token-id list) for `model`."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    counts_by_text: dict[int, int] = {}
    if texts:
        tokenizer = await load_tokenizer(model)
        if tokenizer is not None:
            if sum(len(text) for text in texts) > _INLINE_CHARS:
                encodings = await asyncio.to_thread(
                    tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens
                )
            else:
                # One by one: encode_batch hands short texts to its thread pool and waits
                # for a thread to be scheduled, which on a busy machine cost more than the
                # encoding itself.
                encodings = [
                    tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts
                ]
            counts = [len(encoding.ids) for encoding in encodings]
        else:
            url = (await upstream.pick_target(model.upstream_urls)).url
            counts = await asyncio.gather(
                *(
                    upstream.tokenize_remote(
                        url,
                        text,
                        model_name=model.upstream_model_name,
                        add_special_tokens=add_special_tokens,
                    )
                    for text in texts
                )
            )
        counts_by_text = dict(enumerate(counts))
    result, text_index = [], 0
    for prompt in prompts:
        if isinstance(prompt, str):
            result.append(counts_by_text[text_index])
            text_index += 1
        else:
            result.append(len(prompt))
    return result
