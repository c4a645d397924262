"""Everything checked about a harvest request before its job is made (as `api.validation`
checks a completion body): the model captures activations, the layers asked for
(`acs_client.protocol.harvest_layers`), and the size of the files the job would write."""

from django.conf import settings

from acs_client.protocol import RuleBroken, harvest_layers
from api.errors import ApiError
from api.models import LanguageModel
from api.tokenizer import count_prompt_tokens

from .schemas import HarvestRequest
from .services.harvest_output import harvest_too_large
from .storage import harvest_bytes_estimate


async def validate_harvest(harvest: HarvestRequest, model: LanguageModel) -> list[int]:
    """The layers the job captures; ApiError with the contract's code for the first problem
    found."""
    if not model.supports_activations:
        raise ApiError(
            "activation_engine_unconfigured",
            f"Model {model.name} offers no activation capture; use another model.",
        )
    try:
        layers = harvest_layers(harvest.layers, n_layers=model.n_layers)
    except RuleBroken as error:
        raise ApiError("invalid_request", str(error)) from None
    await _check_size(harvest, model, layers)
    return layers


async def _check_size(harvest: HarvestRequest, model: LanguageModel, layers: list[int]) -> None:
    """413 request_too_large when the job's files would pass ACS_HARVEST_MAX_JOB_BYTES (the
    worker enforces it again on the tokens it captures)."""
    counts = await count_prompt_tokens(
        model, harvest.prompts, add_special_tokens=harvest.add_special_tokens
    )
    size = harvest_bytes_estimate(
        prompt_tokens=sum(counts), n_layers=len(layers), hidden_size=model.hidden_size
    )
    limit = settings.ACS_HARVEST_MAX_JOB_BYTES
    if size > limit:
        raise harvest_too_large(
            f"Capturing {len(layers)} layers over the {sum(counts)} tokens of these prompts "
            f"would write about {size} bytes; one harvest job may write at most {limit}"
        )
