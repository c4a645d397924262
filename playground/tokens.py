"""The tokens of a run: its prompts' token ids and strings, counted with the gateway's own
tokenizer (`api.tokenizer`), and the tokens each choice generated, kept with the run whatever
its request asked for, so that every position of every figure can be named by its token.

Stored in `Run.tokens` as
`{"prompts": [{"ids", "strings"}], "completions": [{"ids", "strings", "source"} | None]}`:
one entry per prompt of the request and per choice of the response. A completion's tokens
are the ids the response names (`source` "token_ids": every run without echo asks for them
with `return_token_ids`, see `with_token_ids`), each decoded alone (or, without a local
tokenizer, named by the response's logprobs); else, for answers without them, the
response's logprobs strings (`source` "logprobs": an id is None where several tokens decode
to the same string); else unknown (None). The returned text is never
tokenized again: its canonical tokens need not be the ones sampled (two "\n" tokens, ids
198 198, read back as one "\n\n", id 1116).
"""

import logging

from asgiref.sync import async_to_sync

from acs_client.protocol import CompletionFields
from api.errors import ApiError
from api.selectors import model_get
from api.tokenizer import PromptTokens, prompt_tokens, token_ids_of_strings, token_strings
from playground.plots import visible_token

logger = logging.getLogger(__name__)


async def _run_tokens(request: CompletionFields, response: dict) -> dict:
    model = await model_get(request.model)
    prompts = []
    for prompt in request.prompts():
        tokens = await prompt_tokens(model, prompt, add_special_tokens=request.add_special_tokens)
        prompts.append({"ids": tokens.ids, "strings": tokens.strings})
    n = request.n
    completions = []
    for index, choice in enumerate(response.get("choices") or []):
        prompt = prompts[min(index // n, len(prompts) - 1)]
        completions.append(await _completion_tokens(model, request, choice, prompt))
    return {"prompts": prompts, "completions": completions}


async def _completion_tokens(
    model, request: CompletionFields, choice: dict, prompt: dict
) -> dict | None:
    logprobs = choice.get("logprobs") or {}
    reported = None
    if logprobs.get("tokens") is not None:
        echoed = len(prompt["ids"]) if request.echo else 0
        reported = logprobs["tokens"][echoed:]
    if choice.get("token_ids") is not None:
        ids = choice["token_ids"]
        [strings] = await token_strings(model, [ids])
        # Without a local tokenizer the ids are still exact; the strings are the logprobs'.
        if strings is not None or (reported is not None and len(reported) == len(ids)):
            return {"ids": ids, "strings": strings or reported, "source": "token_ids"}
    if reported is not None:
        ids = await token_ids_of_strings(model, reported)
        return {"ids": ids or [None] * len(reported), "strings": reported, "source": "logprobs"}
    return None


def with_token_ids(request: dict) -> dict:
    """`request` asking the API for its tokens' ids (`return_token_ids`), which name every
    generated position exactly (see the module's docstring); unchanged with echo, which the API
    refuses beside them (`check_field_pairs`: vLLM drops the echoed text)."""
    if request.get("echo"):
        return request
    return {**request, "return_token_ids": True}


def run_tokens(request: CompletionFields, response: dict) -> dict | None:
    """The tokens of a finished run (see the module's docstring), or None when the model or
    its tokenizer cannot be reached (the run's page then names positions by their index)."""
    try:
        return async_to_sync(_run_tokens)(request, response)
    except ApiError as error:
        logger.warning("run tokens unavailable: %s %s", error.code, error.message)
    except Exception:
        # The answer is stored all the same: without its tokens the page names positions
        # by their index.
        logger.exception("run tokens could not be computed")
    return None


async def _tokenize(model_id: str, texts: list[tuple[str, bool]]) -> list[PromptTokens]:
    model = await model_get(model_id)
    return [await prompt_tokens(model, text, add_special_tokens=special) for text, special in texts]


def tokenize(model_id: str, texts: list[tuple[str, bool]]) -> list[PromptTokens]:
    """The tokens of each `(text, add_special_tokens)` under `model_id`'s tokenizer, as the
    gateway counts them (raises ApiError when the model or its tokenizer cannot be reached):
    for forms that check a prompt's tokens before anything is sent."""
    return async_to_sync(_tokenize)(model_id, texts)


def shown_tokens(tokens: PromptTokens) -> str:
    """The tokens as a form's error names them: ‘The’ ‘·capital’ …, or their ids."""
    if tokens.strings is None:
        return f"ids {tokens.ids}"
    return " ".join(f"‘{visible_token(string)}’" for string in tokens.strings)


def numbered_tokens(tokens: PromptTokens) -> str:
    """The tokens by position, as a form's error lists them: 0 ‘The’ 1 ‘·capital’ …"""
    if tokens.strings is None:
        return " ".join(f"{position} id {token}" for position, token in enumerate(tokens.ids))
    return " ".join(
        f"{position} ‘{visible_token(string)}’" for position, string in enumerate(tokens.strings)
    )
