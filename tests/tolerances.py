"""How far an engine computing in bfloat16 (the embedded engine, vLLM-Lens) may be from the
float32 model, with the reasons: tests/engine/test_fidelity.py holds both to the float32
reference with these bounds, and tests/vllm holds the two to each other through the gateway.
Plain Python, for both virtualenvs."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """How far the engine may be from the float32 reference, with the reason: any reported
    logprob (nats); a generated token's logprob below the reference's best one (a near tie
    that rounding decided, `greedy_margin`); and the residual stream's rows (one position) in
    relative error of their norm, the median of a captured layer's rows and any single row.
    Rounding noise is small almost everywhere and larger at a few sensitive positions; a real
    defect moves every position, so the median bound is the tight one."""

    logprob: float
    greedy_margin: float
    row_median: float
    row_max: float
    reason: str


TOLERANCES = {
    "float32": Tolerance(
        logprob=1e-2,
        greedy_margin=1e-2,
        row_median=2**-7,
        row_max=2**-7,
        reason="the same products as the reference (every weight is exact in float16, which "
        "the float32 path multiplies by); only the order of the sums differs, which kernels "
        "(chosen by timing at load) and instruction sets change: a final hidden row 1e-4 off "
        "relative (native vs PyTorch steps: up to 7e-5) moves a logit of 20 by 2e-3. Measured "
        "up to 2.6e-3 nats with oneDNN and MKL capped at AVX-512 BF16 (make test-kernels), "
        "5e-5 otherwise; the bound is four times the largest. Captured rows are sent as "
        "bfloat16, relative step 2**-8",
    ),
    "bfloat16": Tolerance(
        logprob=0.5,
        greedy_margin=0.35,
        row_median=0.05,
        row_max=0.25,
        reason="every matmul rounds to 8 significant bits (a logit of 30 to steps of 0.125) "
        "and kernels (AVX2 emulation, AVX-512 BF16, AMX tiles) sum in different orders. "
        "Measured on an AMX CPU against float32: reported logprobs off by up to 0.46 nats "
        "(a low-ranked top-5 entry of a strongly steered run; 0.26 for the sampled tokens), "
        "the greedy token up to 0.24 below the best, layer medians up to 2.6%, and single rows "
        "up to 17% (transformers' own bfloat16 forward is off by the same 17% there)",
    ),
}
WIDEST = TOLERANCES["bfloat16"]


# float32's unit roundoff: one rounding moves a value by at most this fraction of it.
FLOAT32_UNIT_ROUNDOFF = 2**-24
# How many standard deviations of rounding noise a float32 bound allows (below).
ROUNDING_CONFIDENCE = 10


def float32_reordering_bound(*, reduction: int, sums_in_series: int) -> float:
    """How far, relative to a row's norm, two float32 computations of the same products may
    be when only the order of their sums differs (kernels, BLAS blocking, vector widths: what
    differs between CPUs and between the engine's native and PyTorch steps).

    A sum of `reduction` products rounded in any order is off by about sqrt(reduction) * u of
    its size when the rounding errors are independent (Higham and Mary's probabilistic bound,
    u the unit roundoff); ROUNDING_CONFIDENCE standard deviations make a larger error
    improbable. `sums_in_series` such sums feed each other (two per decoder layer: attention
    and MLP, each added to the residual stream, which passes relative errors on unamplified
    to first order) and their errors add in the worst case; the two computations compared are
    each that far from the exact result. A real defect (a position off by one, a missing
    layer or hook) moves rows by percents, two orders of magnitude more."""
    one_sum = ROUNDING_CONFIDENCE * reduction**0.5 * FLOAT32_UNIT_ROUNDOFF
    return 2 * sums_in_series * one_sum


def row_relative_errors(got, expected):
    """Each row's (last axis) distance from its expected row, relative to the expected row's
    norm: what a bound on rounding is about. Elementwise tolerances mistake a near-zero entry
    beside entries of size 50 (the residual stream has such) for a large relative error."""
    import numpy as np

    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return np.linalg.norm(got - expected, axis=-1) / np.linalg.norm(expected, axis=-1)


def greedy_divergence_margins(
    ours: dict[str, float], theirs: dict[str, float], our_token: str, their_token: str
) -> tuple[float, float]:
    """Where two greedy decoders chose different tokens: by how much each side's choice beat
    the other side's choice on its own side, from each side's top logprobs at that step
    (`ours`, `theirs`, token → logprob, at least two entries each, else the tie cannot be
    told). A choice missing from a side's top logprobs is below all of them: its margin is
    at least the chosen token's logprob less the lowest listed. Both margins within the
    greedy bound make the divergence a near tie that rounding decided; either beyond it, a
    defect."""
    for side, top in (("our", ours), ("their", theirs)):
        if len(top) < 2:
            raise AssertionError(
                f"{side} side reported {len(top)} top logprob(s) where the tokens differ: a "
                "near tie is told from both sides' top 2 (ask logprobs >= 2)"
            )
    our_margin = ours[our_token] - ours.get(their_token, min(ours.values()))
    their_margin = theirs[their_token] - theirs.get(our_token, min(theirs.values()))
    return our_margin, their_margin
