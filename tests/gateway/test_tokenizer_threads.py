"""The gateway's tokenizer cache used from several threads at once, each with its own event
loop, as playground workers do (`run_tokens` runs under async_to_sync in each of a Celery
thread pool's threads): the first loads of the same tokenizer must all finish."""

import asyncio
import threading
import time
from types import SimpleNamespace

from tokenizers import Tokenizer, models

from api import tokenizer as gateway_tokenizer

TOKENIZER_JSON = Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()


def test_two_threads_loading_the_same_tokenizer_at_once_both_get_it(
    monkeypatch, settings, tmp_path
):
    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path)
    monkeypatch.setattr(gateway_tokenizer, "_tokenizers", {})
    monkeypatch.setattr(gateway_tokenizer, "_missing_until", {})

    async def slow_fetch(url):
        # Slow enough that the second thread asks while the first is still loading.
        await asyncio.sleep(0.3)
        return TOKENIZER_JSON.encode()

    monkeypatch.setattr(gateway_tokenizer.upstream, "fetch_tokenizer_json", slow_fetch)
    model = SimpleNamespace(
        name="threads-model",
        tokenizer_sha256="",
        weights_dir="",
        upstream_urls=["http://127.0.0.1:9"],
    )
    loaded = []

    def load():
        loaded.append(asyncio.run(gateway_tokenizer.load_tokenizer(model)))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in threads), "a thread never got its tokenizer"
    assert len(loaded) == 2 and all(item is not None for item in loaded)
