"""Form fields the playground's features share: prompt positions (whole numbers and ranges),
the steering positions checked against the prompt's tokens as the API checks them, lists of
numbers, and the bound of a steering scale."""

import math

from django import forms

from acs_client.protocol import (
    RuleBroken,
    check_steering_positions,
)
from api.errors import ApiError
from api.request_forms import (
    LIST_FIELD_MAX_CHARS,
    first_repeated,
    split_list,
)
from playground.tokens import numbered_tokens, tokenize

# |scale| (or |multiple of the typical norm|) above this swamps the residual stream entirely.
MAX_SCALE = 1000.0


def position_list(text: str, *, count: int) -> list[int]:
    """Positions written as whole numbers and ranges ("1-4, 7"), each once, all below
    `count`."""
    positions = []
    for part in split_list(text.replace("–", "-"), field="Positions", max_count=count):
        first, _, last = part.partition("-")
        try:
            start, end = int(first), int(last or first)
        except ValueError:
            raise forms.ValidationError(
                f"Positions: {part!r} is not a number or a range like 1-4."
            ) from None
        if not 0 <= start <= end < count:
            raise forms.ValidationError(
                f"Positions: {part} is outside 0–{count - 1}, or a range that runs backwards."
            )
        positions.extend(range(start, end + 1))
    if not positions:
        raise forms.ValidationError("Positions: give at least one.")
    repeated = first_repeated(positions)
    if repeated is not None:
        raise forms.ValidationError(f"Positions: {repeated} is listed more than once.")
    return positions


def steering_positions_field() -> forms.CharField:
    """The field of the prompt positions to steer at (`steering_position_list` reads it)."""
    return forms.CharField(
        required=False,
        max_length=LIST_FIELD_MAX_CHARS,
        label="Steering positions",
        help_text="The prompt's positions to add the vector at, e.g. 1-3, 5 (0: its first "
        "token); empty: every position. Generated tokens cannot be steered by position, and "
        "position 0 only with max_tokens 1.",
    )


def steering_position_list(
    text: str, *, model_id: str, prompts: list[str], max_tokens: int
) -> list[int]:
    """The positions `text` names, checked against the shortest prompt's tokens as the API
    checks them (`check_steering_positions`); a ValidationError listing that prompt's tokens
    by position otherwise."""
    try:
        tokenized = tokenize(model_id, [(prompt, True) for prompt in prompts])
    except ApiError as error:
        raise forms.ValidationError(
            f"The prompt could not be tokenized ({error.code}: {error.message})."
        ) from None
    shortest = min(tokenized, key=lambda tokens: len(tokens.ids))
    tokens = f"The prompt's tokens: {numbered_tokens(shortest)}."
    try:
        positions = position_list(text, count=len(shortest.ids) + max_tokens)
        check_steering_positions(positions, prompt_tokens=len(shortest.ids), max_tokens=max_tokens)
    except (forms.ValidationError, RuleBroken) as error:
        message = error.messages[0] if isinstance(error, forms.ValidationError) else error
        raise forms.ValidationError(f"{message} {tokens}") from None
    return positions


def positions_text(positions: list[int]) -> str:
    """`positions` written as `position_list` reads them, consecutive ones as a range."""
    if len(positions) > 1 and positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}-{positions[-1]}"
    return ", ".join(str(position) for position in positions)


def float_list(text: str, *, field: str, max_count: int) -> list[float]:
    try:
        values = [float(p) for p in split_list(text, field=field, max_count=max_count)]
    except ValueError:
        raise forms.ValidationError(f"{field}: write numbers separated by commas.") from None
    if not values or not all(math.isfinite(value) for value in values):
        raise forms.ValidationError(f"{field}: give at least one finite number.")
    return values
