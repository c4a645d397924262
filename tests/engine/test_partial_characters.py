"""Output that ends inside, or crosses, a multi-byte UTF-8 character (SmolLM2's byte-level BPE
tokens) is named and written as vLLM 0.32 does: a byte token in logprobs is named by what it
adds to the tokens chosen before it (`engine.outputs.TokenNames`, after vLLM's
`LogprobsProcessor._correct_decoded_token`), never as the U+FFFD it decodes to alone, and
`text` never holds the bytes of an unfinished character.

The expected names were produced by vLLM 0.32's own `LogprobsProcessor` (sample and prompt
logprobs, list and flat containers) on this tokenizer."""

import pytest
import torch

from engine.loader import model_config, weights_directory
from engine.outputs import (
    ChoiceText,
    PromptScores,
    TokenNames,
    echo_logprobs,
    generated_entry,
    legacy_top,
    prompt_context,
    vllm_prompt_logprobs,
)

# "café 日本": 日 is split over three tokens (" " + 0xE6, 0x97, 0xA5), each decoding alone to
# something ending in U+FFFD.
CAFE = [83, 1939, 2756, 17097, 241, 115, 40993]
CAFE_ALONE = ["c", "af", "é", " \ufffd", "\ufffd", "\ufffd", "本"]
CAFE_NAMES = ["c", "af", "é", "", "", " 日", "本"]
# Alternatives at positions 3 to 5 and vLLM's names of them there, after the chosen tokens.
ALTERNATIVES = {3: [10644, 241], 4: [10644, 115, 40993], 5: [116, 241, 17097]}
ALTERNATIVE_NAMES = {3: ["", ""], 4: [" 戒", "", "本"], 5: [" 旦", " 旗", ""]}
# "😀" is three byte tokens: generated, the last one completes it after the first two; in a
# prompt the first token is no context (it has no prompt logprobs), so it never does.
EMOJI = [10813, 242, 218]
EMOJI_GENERATED_NAMES = ["", "", "😀"]
EMOJI_PROMPT_NAMES = ["", ""]  # positions 1 and 2


class CountingTokenizer:
    """A tokenizer that counts its decodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids, **options) -> str:
        self.decodes += 1
        return self.tokenizer.decode(ids, **options)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights_directory())


@pytest.fixture(scope="module")
def token_strings(tokenizer) -> list[str]:
    vocabulary_size = model_config(weights_directory()).vocab_size
    return [tokenizer.decode([i]) for i in range(vocabulary_size)]


@pytest.fixture(scope="module")
def names(tokenizer, token_strings) -> TokenNames:
    return TokenNames(tokenizer, token_strings)


def test_the_cases_hold_byte_tokens(token_strings):
    """Decoded alone (the names before), these tokens are U+FFFD: the cases test something."""
    assert [token_strings[i] for i in CAFE] == CAFE_ALONE
    assert all(token_strings[i].endswith("\ufffd") for i in [*EMOJI, 10644, 116, 241])


def test_generated_byte_tokens_are_named_by_the_tokens_generated_before(names):
    got = [names.at([token_id], CAFE[:i])[0] for i, token_id in enumerate(CAFE)]
    assert got == CAFE_NAMES
    assert [names.at([t], EMOJI[:i])[0] for i, t in enumerate(EMOJI)] == EMOJI_GENERATED_NAMES
    # The first generated token has no context: a byte token there is "".
    assert names.at([218], []) == [""]


def test_alternatives_are_named_after_the_chosen_tokens_not_after_each_other(names):
    for position, alternatives in ALTERNATIVES.items():
        got = names.at([CAFE[position], *alternatives], CAFE[:position])
        assert got == [CAFE_NAMES[position], *ALTERNATIVE_NAMES[position]], position


def test_prompt_byte_tokens_are_named_by_the_prompt_tokens_with_logprobs_before(names):
    for position in range(1, len(CAFE)):
        assert prompt_context(CAFE, position) == CAFE[max(1, position - 4) : position]
        got = names.at([CAFE[position]], prompt_context(CAFE, position))
        assert got == [CAFE_NAMES[position]]
    got = [names.at([EMOJI[p]], prompt_context(EMOJI, p))[0] for p in (1, 2)]
    assert got == EMOJI_PROMPT_NAMES


def test_the_context_is_the_tokens_just_before(names):
    # However long the generation, the last tokens chosen (vLLM takes up to 4, enough for
    # any UTF-8 character) complete a byte token's character.
    context = [*range(300, 310), 17097, 241]
    assert names.at([115], context) == [" 日"]
    assert names.vocabulary(context)[115] == " 日"


def test_the_whole_vocabulary_is_named_once_per_context(tokenizer, token_strings):
    counting = CountingTokenizer(tokenizer)
    names = TokenNames(counting, token_strings)
    context = CAFE[1:5]
    vocabulary = names.vocabulary(context)
    byte_tokens = [i for i, s in enumerate(token_strings) if s.endswith("\ufffd")]
    assert len(byte_tokens) == len(names.byte_tokens) == 314
    assert counting.decodes <= 4 * (len(byte_tokens) + 1)
    assert vocabulary[115] == " 日" and vocabulary[116] == " 旦" and vocabulary[17097] == ""
    assert vocabulary[:100] == token_strings[:100]
    assert [vocabulary[i] for i in byte_tokens] == names.at(byte_tokens, context)
    assert not any(name.endswith("\ufffd") for name in vocabulary)
    decodes = counting.decodes
    assert names.vocabulary(context) == vocabulary
    assert counting.decodes == decodes, "a context's names are computed once"


def test_text_stops_before_an_unfinished_character_and_offsets_follow_the_names(tokenizer, names):
    # 17097 and 241 leave 日 unfinished: its bytes, and the space that 17097 holds, are
    # dropped at the end (before, the text ended in " \ufffd").
    texts = ["c", "caf", "café", "café", "café", "café 日", "café 日本"]
    for length, expected in enumerate(texts, start=1):
        ids = CAFE[:length]
        text = ChoiceText(tokenizer, (), "")
        offsets = [text.add_token(token_id)[0] for token_id in ids]
        assert text.take_sendable(finished=True) == expected
        token_names = [names.at([t], ids[:i])[0] for i, t in enumerate(ids)]
        assert "".join(token_names) == expected
        assert offsets == [len("".join(token_names[:i])) for i in range(length)]


def test_a_generated_entry_names_its_token_and_byte_alternatives(names):
    position = 5
    top_ids = [116, 241, 17097, 10813]
    row = torch.full((len(names.alone),), -30.0)
    row[CAFE[position]] = -0.5
    for rank, token_id in enumerate(top_ids):
        row[token_id] = -1.0 - rank
    name, logprob, top = generated_entry(row, CAFE[: position + 1], 5, names)
    assert name == " 日" and logprob == -0.5
    # The chosen token first, then the top ones (the chosen one among them keeps its place);
    # 17097 and 10813 are both "" here, and the later one's logprob is kept, as in vLLM.
    assert list(top.items()) == [(" 日", -0.5), (" 旦", -1.0), (" 旗", -2.0), ("", -4.0)]


def test_legacy_top_keeps_the_chosen_token_first_and_the_later_of_a_shared_name():
    # vLLM keys a position by token id first: the chosen token listed again among the top
    # ones is not a later entry, so the top token named like it (-1.0) wins the shared name.
    top = legacy_top([7, 3, 7, 5], [-2.0, -1.0, -2.0, -3.0], ["", "", "", "x"])
    assert list(top.items()) == [("", -1.0), ("x", -3.0)]


def cafe_scores(full_vocab: bool) -> PromptScores:
    """Scores of CAFE's positions 1.. whose top tokens are the actual one, then the
    ALTERNATIVES; with `full_vocab` also (arbitrary) full-vocabulary rows."""
    positions = range(1, len(CAFE))
    top_ids = [[CAFE[p], *ALTERNATIVES.get(p, [])] for p in positions]
    generator = torch.Generator().manual_seed(0)
    rows = [torch.log_softmax(torch.randn(49152, generator=generator), dim=-1) for _ in positions]
    return PromptScores(
        token_logprobs=[-1.0] * len(top_ids),
        ranks=[1] * len(top_ids),
        top_ids=top_ids,
        top_logprobs=[[-1.0 - i for i in range(len(ids))] for ids in top_ids],
        full_vocab=rows if full_vocab else None,
    )


def test_prompt_logprobs_name_each_entry_by_the_prompt_before(names):
    result = vllm_prompt_logprobs(cafe_scores(False), CAFE, 4, names)
    assert result[0] is None
    for position in range(1, len(CAFE)):
        decoded = {int(k): entry["decoded_token"] for k, entry in result[position].items()}
        expected = dict(
            zip(
                [CAFE[position], *ALTERNATIVES.get(position, [])],
                [CAFE_NAMES[position], *ALTERNATIVE_NAMES.get(position, [])],
                strict=True,
            )
        )
        assert decoded == expected, position


def test_full_vocabulary_prompt_logprobs_name_every_byte_token(names):
    result = vllm_prompt_logprobs(cafe_scores(True), CAFE, 0, names)
    for position in range(1, len(CAFE)):
        entry = result[position]
        assert len(entry) == len(names.alone)
        assert entry[str(CAFE[position])]["decoded_token"] == CAFE_NAMES[position]
        for token_id, name in zip(
            ALTERNATIVES.get(position, []), ALTERNATIVE_NAMES.get(position, []), strict=True
        ):
            assert entry[str(token_id)]["decoded_token"] == name
        assert not any(e["decoded_token"].endswith("\ufffd") for e in entry.values())


def test_echoed_prompt_tokens_and_offsets_follow_the_prompt_logprobs_names(names):
    chunk = echo_logprobs(cafe_scores(False), CAFE, 4, names)
    assert chunk.tokens == CAFE_NAMES
    assert chunk.text_offset == [0, 1, 3, 4, 4, 4, 6]
    assert list(chunk.top_logprobs[5]) == [" 日", " 旦", " 旗", ""]
    # The first prompt token is named as decoded alone, U+FFFD and all, as vLLM does.
    emoji = echo_logprobs(
        PromptScores([-1.0, -1.0], [1, 1], [[], []], [[], []], None), EMOJI, 0, names
    )
    assert emoji.tokens == ["\ufffd", "", ""]
    assert emoji.text_offset == [0, 1, 1]


def assert_no_name_is_unfinished(logprobs: dict) -> None:
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert not token.endswith("\ufffd"), logprobs["tokens"]
        assert not any(name.endswith("\ufffd") for name in top or {}), top


def test_a_generation_stopping_inside_a_character_through_the_server(complete, tokenizer):
    body = dict(prompt="Emoji: 😀😀😀", temperature=0, logprobs=3)
    free = complete(**body, max_tokens=12, return_token_ids=True)["choices"][0]
    ids = free["token_ids"]
    unfinished = [i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd")]
    assert unfinished, f"no character left unfinished ({free['text']!r}): choose another prompt"
    cut = unfinished[-1]
    stopped = complete(**body, max_tokens=cut + 1)["choices"][0]
    logprobs = stopped["logprobs"]
    assert logprobs["tokens"][-1] == ""
    assert "\ufffd" not in stopped["text"] and free["text"].startswith(stopped["text"])
    assert stopped["text"] == "".join(logprobs["tokens"])
    tokens = logprobs["tokens"]
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(cut + 1)]
    assert_no_name_is_unfinished(free["logprobs"])


def test_an_echoed_prompt_and_its_prompt_logprobs_through_the_server(complete):
    body = complete(
        prompt=[CAFE], max_tokens=1, temperature=0, echo=True, logprobs=2, prompt_logprobs=2
    )
    choice = body["choices"][0]
    assert choice["text"].startswith("café 日本")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][: len(CAFE)] == CAFE_NAMES
    assert logprobs["text_offset"] == [0, 1, 3, 4, 4, 4, 6, 7]
    assert_no_name_is_unfinished({k: logprobs[k][1:] for k in ("tokens", "top_logprobs")})
    prompt_logprobs = choice["prompt_logprobs"]
    for position in range(1, len(CAFE)):
        entry = prompt_logprobs[position]
        assert entry[str(CAFE[position])]["decoded_token"] == CAFE_NAMES[position]
        assert not any(e["decoded_token"].endswith("\ufffd") for e in entry.values())


def test_full_vocabulary_prompt_logprobs_through_the_server(complete):
    prompt = CAFE[2:6]  # é, then 日's three tokens
    body = complete(prompt=[prompt], max_tokens=1, prompt_logprobs=-1)
    entries = body["choices"][0]["prompt_logprobs"][1:]
    assert [entry["115"]["decoded_token"] for entry in entries] == ["", "", " 日"]
    assert entries[2]["116"]["decoded_token"] == " 旦"
    for entry in entries:
        assert not any(e["decoded_token"].endswith("\ufffd") for e in entry.values())
