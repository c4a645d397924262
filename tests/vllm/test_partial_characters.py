"""Output that ends inside, or crosses, a multi-byte character is one behaviour on both
upstreams: `text` never ends in U+FFFD for an unfinished character, a byte-fallback token
that leaves its character unfinished is named "", and the token that completes it carries
the whole character (as vLLM names them; the engine used to say "\ufffd" and end the text in
it). Streams say the same."""

import pytest

from .test_text_offsets import assert_offsets_map_into_text
from .test_vllm_lens import answer_pair, assert_same_generation, streamed

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("prompt", ["東京は日本の", "Emoji: 🙂🎉 and", "Le château se trouve à"])
def test_multi_byte_output_is_named_and_cut_alike_on_both(client, models, prompt):
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    vllm, engine = answer_pair(client, models, body)
    ours, theirs = vllm["choices"][0], engine["choices"][0]
    agreed = assert_same_generation(ours, theirs)
    for choice in (ours, theirs):
        assert not choice["text"].endswith("\ufffd"), choice["text"]
        assert "\ufffd" not in "".join(choice["logprobs"]["tokens"])
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        assert_offsets_map_into_text(choice)
    if agreed == len(theirs["logprobs"]["tokens"]):
        assert ours["text"] == theirs["text"]
    # Cut after each token: every prefix of the generation ends the same way on both.
    for max_tokens in range(1, agreed + 1):
        short = {**body, "max_tokens": max_tokens}
        vllm_short, engine_short = answer_pair(client, models, short)
        assert vllm_short["choices"][0]["text"] == engine_short["choices"][0]["text"]
        assert (
            vllm_short["choices"][0]["logprobs"]["tokens"]
            == engine_short["choices"][0]["logprobs"]["tokens"]
        )


def test_a_stream_names_partial_characters_as_the_answer_does(client, models):
    body = {"prompt": "東京は日本の", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    for name in (models["vllm"], models["engine"]):
        answer = client.post("/v1/completions", json={"model": name, **body}).json()
        frames = streamed(client, {"model": name, **body, "stream": True})
        text = "".join(c["text"] for f in frames for c in f["choices"])
        tokens = [t for f in frames for c in f["choices"] for t in c["logprobs"]["tokens"]]
        assert text == answer["choices"][0]["text"], name
        assert tokens == answer["choices"][0]["logprobs"]["tokens"], name
