"""tests/greedy_close.py: runs equal, apart at a near tie (counted), apart beyond one (an error)."""
from __future__ import annotations

import pytest
from greedy_close import GAP, assert_greedy_close

from ninfer_rt.logprobs import TokenLogprob


def lp(tok: int, top: dict[int, float]) -> TokenLogprob:
    return TokenLogprob(tok, top[tok], tuple(sorted(top.items(), key=lambda kv: -kv[1])))


def test_equal_runs_have_no_divergence():
    a = {"r0": [lp(1, {1: -0.1, 2: -3.0}), lp(5, {5: -0.5, 6: -1.0})]}
    assert assert_greedy_close(a, a) == 0


def test_a_near_tie_may_round_apart_once():
    a = {"r0": [lp(1, {1: -0.70, 2: -0.72}), lp(9, {9: -0.1})], "r1": [lp(3, {3: -0.2})]}
    b = {"r0": [lp(2, {2: -0.69, 1: -0.71}), lp(4, {4: -0.1})], "r1": [lp(3, {3: -0.2})]}
    assert assert_greedy_close(a, b) == 1            # after the divergence the texts differ: not compared


@pytest.mark.parametrize("b_top,msg", [({2: -0.1, 7: -2.0}, "neither among"),
                                        ({2: -0.1, 1: -0.1 - 3 * GAP}, "not a near tie")],
                         ids=["not-in-top", "wide-gap"])
def test_a_divergence_beyond_a_tie_fails(b_top, msg):
    a = {"r0": [lp(1, {1: -0.1, 2: -0.1 - 3 * GAP})]}
    b = {"r0": [lp(2, b_top)]}
    with pytest.raises(AssertionError, match=msg):
        assert_greedy_close(a, b)


def test_lengths_must_match():
    with pytest.raises(AssertionError):
        assert_greedy_close({"r0": [lp(1, {1: 0.0})]}, {"r0": []})
