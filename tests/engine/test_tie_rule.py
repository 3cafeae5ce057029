"""The GPU equivalence tests' comparison of two greedy runs (`tests.helpers.gpu_engine.logprob_diff`): identical
tokens, except where the reference's top two were a near-tie; checked here on made-up runs so the rule can fail."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers.gpu_engine import TIE, logprob_diff


def run(ids, entries):
    return SimpleNamespace(request_id="r", adapter=None, output_ids=ids, logprobs=entries)


def entry(lp, tops):
    return (lp, 1, tops)


def test_identical_runs_give_the_largest_logprob_difference():
    a = run([5, 6], [entry(-1.0, [(5, -1.0), (7, -2.0)]), entry(-0.5, [(6, -0.5), (3, -3.0)])])
    b = run([5, 6], [entry(-1.02, [(5, -1.02), (7, -2.0)]), entry(-0.49, [(6, -0.49), (3, -3.0)])])
    assert logprob_diff([a], [b]) == pytest.approx(0.02)


def test_a_split_near_tie_ends_the_comparison_of_that_request():
    ref = run([5, 9, 9], [entry(-0.1, [(5, -0.1), (7, -4.0)]), entry(-1.00, [(9, -1.00), (8, -1.03)]),
                          entry(-0.2, [(9, -0.2), (1, -3.0)])])
    got = run([5, 8, 2], [entry(-0.1, [(5, -0.1), (7, -4.0)]), entry(-1.01, [(8, -1.01), (9, -1.02)]),
                          entry(-9.0, [(2, -9.0), (1, -9.5)])])
    assert logprob_diff([got], [ref]) == 0.0  # step 2 differs wildly but follows the tie: not compared


@pytest.mark.parametrize("tops", [[(9, -1.0), (8, -1.0 - 2 * TIE)], [(9, -1.0), (4, -1.01)]],
                         ids=["margin over the tie", "the pick not in the reference's top two"])
def test_a_divergence_that_is_no_tie_fails(tops):
    ref = run([9], [entry(-1.0, tops)])
    got = run([8], [entry(-1.0, [(8, -1.0), (9, -1.1)])])
    with pytest.raises(AssertionError, match="tokens diverge"):
        logprob_diff([got], [ref])
