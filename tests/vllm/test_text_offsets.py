"""`text_offset` maps each token into `text` on both upstreams (`api.dialect.public_offsets`):
an echoed chat prompt's special tokens, which `text` holds, and generated special tokens under
`ignore_eos`, which `text` leaves out (vLLM counted them at full length: an offset of 45 in a
36-character text; the engine counted echoed ones at length 0)."""

import pytest

from .test_vllm_lens import answer_pair, assert_same_generation

pytestmark = pytest.mark.django_db(transaction=True)

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def assert_offsets_map_into_text(choice: dict) -> int:
    """Each token's string is in `text` at its offset, but for a special token that `text`
    leaves out, which takes no room, and the last token of a choice that a stop string cut
    (only its start is in `text`); returns how many tokens were left out."""
    text, logprobs = choice["text"], choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    cut = isinstance(choice.get("stop_reason"), str)
    left_out, expected = 0, 0
    for index, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        assert offset == expected, (token, offset, expected, tokens, offsets)
        if text.startswith(token, offset):
            expected += len(token)
        elif cut and index == len(tokens) - 1 and token.startswith(text[offset:]):
            expected = len(text)
        else:
            assert token in SPECIAL, (token, offset, text)
            left_out += 1
    assert expected <= len(text)
    return left_out


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": CHAT, "echo": True, "max_tokens": 4},
        {"prompt": CHAT, "max_tokens": 24, "ignore_eos": True},
    ],
    ids=["echoed-chat-prompt", "generated-under-ignore-eos"],
)
def test_text_offsets_map_each_token_into_the_text_on_both(client, models, body):
    vllm, engine = answer_pair(client, models, {**body, "temperature": 0, "logprobs": 2})
    left_out = [assert_offsets_map_into_text(side["choices"][0]) for side in (vllm, engine)]
    agreed = assert_same_generation(vllm["choices"][0], engine["choices"][0])
    ours, theirs = (side["choices"][0]["logprobs"]["text_offset"] for side in (vllm, engine))
    assert ours[:agreed] == theirs[:agreed]
    if body.get("ignore_eos"):
        assert min(left_out) > 0, "the model generated no special token: choose another prompt"
