"""The numeric bounds of tests/tolerances.py tell rounding from defects: each passes what
rounding does and fails a planted defect."""

import numpy as np
import pytest

from tests.tolerances import (
    TOLERANCES,
    float32_reordering_bound,
    greedy_divergence_margins,
    row_relative_errors,
)

GREEDY_BOUND = 2 * TOLERANCES["bfloat16"].greedy_margin


def test_a_divergence_at_a_near_tie_on_both_sides_is_rounding():
    ours = {" date": -3.05, " version": -3.08}
    theirs = {" version": -3.01, " date": -3.04}
    assert max(greedy_divergence_margins(ours, theirs, " date", " version")) <= GREEDY_BOUND


def test_a_divergence_where_one_side_was_sure_is_a_defect():
    ours = {" Paris": -0.1, " Rome": -2.4}
    theirs = {" Rome": -0.7, " Paris": -0.8}
    assert max(greedy_divergence_margins(ours, theirs, " Paris", " Rome")) > GREEDY_BOUND


def test_a_choice_missing_from_the_other_sides_top_two_is_below_both_of_them():
    ours = {" Paris": -0.1, " Lyon": -2.4}
    theirs = {" Rome": -0.7, " Milan": -0.8}
    margins = greedy_divergence_margins(ours, theirs, " Paris", " Rome")
    assert margins == pytest.approx((2.3, 0.1))
    assert max(margins) > GREEDY_BOUND


def test_a_divergence_cannot_be_judged_from_one_top_logprob():
    with pytest.raises(AssertionError, match="top 2"):
        greedy_divergence_margins({" date": -3.05}, {" version": -3.0}, " date", " version")


def test_row_errors_are_relative_to_each_rows_norm():
    expected = np.array([[50.0, 0.0, 0.0], [0.0, 3.0, 4.0]])
    got = expected + np.array([[0.0, 1e-3, 0.0], [0.0, 0.0, 0.5]])
    np.testing.assert_allclose(row_relative_errors(got, expected), [2e-5, 0.1])


def test_the_float32_reordering_bound_of_the_decoder_sits_between_rounding_and_a_defect():
    """SmolLM2-135M's decoder: 30 layers of two sums in series, the longest over the MLP's
    1,536. Measured: native vs PyTorch steps 1.2e-5 at most (AMX, and AVX2 forced); a step
    one position off (tests/engine/test_native.py) 3.3e-2 at least."""
    bound = float32_reordering_bound(reduction=1536, sums_in_series=60)
    assert 1e-4 < bound < 1e-2
