"""What one request-log row was billed, counted the way `/v1/usage` counts it: its prompt and
completion tokens go to the token windows (all of them, the input and output ones apart),
and a capture or steering request to the activation-request quota."""

from dataclasses import dataclass

from api.jobs.capture import CAPTURE_MAX_TOKENS

HARVEST_ENDPOINT = "harvest"


@dataclass
class Billed:
    tokens: int
    activation_requests: int | None  # None where the record cannot tell (steering)
    why: str


def billed(record) -> Billed:
    """The tokens and activation requests a usage record was charged, and why."""
    tokens = record.prompt_tokens + record.completion_tokens
    if record.endpoint == HARVEST_ENDPOINT:
        # One record per harvest batch: each prompt of it is one capture request, which
        # decodes CAPTURE_MAX_TOKENS token(s) and counts one activation request.
        prompts = record.completion_tokens // CAPTURE_MAX_TOKENS
        return Billed(
            tokens=tokens,
            activation_requests=prompts,
            why=(
                f"harvest batch of {prompts} prompts: their {record.prompt_tokens} prompt "
                f"tokens + {record.completion_tokens} completion tokens ({CAPTURE_MAX_TOKENS} "
                "generated per captured prompt), and one activation request per prompt"
            ),
        )
    if record.activation_layers is not None:
        return Billed(
            tokens=tokens,
            activation_requests=1,
            why="prompt + completion tokens, and one activation request (a capture)",
        )
    return Billed(tokens=tokens, activation_requests=None, why="prompt + completion tokens")
