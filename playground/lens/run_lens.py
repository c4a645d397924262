"""The logit lens of a capture run (`playground.lens`), computed by the worker once, just
before it stores the run, and kept in `Run.lens`: the `LensTable` as JSON, or
`{"unavailable": why}` when the model's weights cannot be had (the run's page then says why
instead of drawing it). A run without a capture has none (None)."""

import logging

from acs_client.protocol import CompletionFields
from api.models import LanguageModel
from playground.captures import activations
from playground.lens.tables import LensUnavailable, LensWeights, lens_table, lens_weights

logger = logging.getLogger(__name__)


def model_lens_weights(model: str | None, *, hidden: int) -> LensWeights:
    """The lens weights of the registry's model `model` (the default model when None), from
    its `weights_dir`, for a capture of `hidden` units; LensUnavailable saying why when
    there are none, or when they are another model's."""
    rows = LanguageModel.objects.filter(**({"name": model} if model else {"is_default": True}))
    directory = rows.values_list("weights_dir", flat=True).first()
    if not directory:
        raise LensUnavailable(
            f"The model registry gives {model or 'the default model'} no weights directory, "
            "which the lens reads the final norm and unembedding from (staff set it on the "
            "model in the admin)."
        )
    weights = lens_weights(directory)
    if weights.unembedding.shape[1] != hidden:
        raise LensUnavailable(
            f"The weights in {directory} have {weights.unembedding.shape[1]} hidden units and "
            f"this capture {hidden}: the model's weights directory holds another model."
        )
    return weights


def run_lens(request: CompletionFields, response: dict) -> dict | None:
    """What `Run.lens` keeps for a finished run (see the module's docstring)."""
    if not (response.get("activations") or {}).get("residual_stream"):
        return None
    try:
        capture = activations(request, response)
        weights = model_lens_weights(request.model, hidden=capture.tensor.shape[-1])
        return lens_table(capture.tensor, capture.layers, weights).to_json()
    except LensUnavailable as error:
        return {"unavailable": str(error)}
    except Exception:
        # The answer is stored all the same, without its lens.
        logger.exception("logit lens could not be computed")
        return {"unavailable": "The lens could not be computed; the worker's log says why."}
