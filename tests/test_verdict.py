"""Checks and verdicts: a difference is refined only by a number that agrees, never by a sentence."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.verdict import Claim, check, counts, holds, tally

MODEL = "the simulator prices ticks, not the host's scheduling: 5% is the spread of repeats"


def test_numbers_within_tolerance_agree_and_beyond_differ():
    assert check("bytes", 100, 104, kind="model", rtol=0.05, basis=MODEL).verdict == "agrees"
    assert check("bytes", 100, 106, kind="model", rtol=0.05, basis=MODEL).verdict == "differs"


def test_a_refined_prediction_that_agrees_refines_and_keeps_its_number_and_evidence():
    row = check("bytes", 2.0, 3.0, kind="exact", refined=3.0, why="3 tuple members all-reduced apart")
    assert (row.verdict, row.refined, row.why) == ("refined", 3.0, "3 tuple members all-reduced apart")
    assert row.passed


def test_a_refined_prediction_that_misses_still_differs():
    row = check("bytes", 2.0, 3.5, kind="exact", refined=3.0, why="3 tuple members")
    assert row.verdict == "differs" and not row.passed


def test_a_sentence_alone_cannot_refine():
    with pytest.raises(TypeError):
        check("count", 2, 1, kind="exact", explained="XLA combined both")  # the old escape hatch is gone
    with pytest.raises(ValueError, match="names the evidence"):
        check("count", 2, 1, kind="exact", refined=1)


def test_exact_checks_are_exact_and_the_others_say_why():
    with pytest.raises(ValueError, match="exact check takes rtol"):
        check("flops", 10, 10, kind="exact", rtol=0.15)
    assert check("flops", 10, 10, kind="exact", rtol=1e-6).verdict == "agrees"
    with pytest.raises(ValueError, match="basis"):
        check("ms", 1.0, 1.0, kind="timing", rtol=0.2)
    with pytest.raises(ValueError, match="kind"):
        check("ms", 1.0, 1.0, kind="vibes", basis="x")


def test_strings_must_match():
    assert check("axes", "tensor", "tensor", kind="exact").verdict == "agrees"
    assert check("axes", "tensor", "fsdp", kind="exact").verdict == "differs"


def test_bounds_hold_on_their_side_only():
    assert check("ratio", 0.5, 0.4, kind="timing", relation="<=", basis="half the dip").verdict == "agrees"
    assert check("ratio", 0.5, 0.7, kind="timing", relation="<=", basis="half the dip").verdict == "differs"
    assert check("speed-up", 2.0, 2.5, kind="timing", relation=">=", basis="at least 2x").verdict == "agrees"


@given(st.floats(0.001, 1e9), st.floats(0, 0.5))
def test_a_value_agrees_with_itself_and_not_with_half_again_beyond_its_tolerance(x, rtol):
    assert holds(x, x, rtol)
    assert not holds(x, x * (1 + 2 * rtol) + x * 0.01, rtol)


def test_counts_and_tally():
    rows = [
        check("a", 1, 1, kind="exact"),
        check("b", 1, 2, kind="exact"),
        check("c", 1, 2, kind="exact", refined=2, why="w"),
    ]
    assert counts(rows) == {"agrees": 1, "refined": 1, "differs": 1}
    assert tally(rows) == "1 agree, 1 refined, 1 differ"


def test_a_claim_has_a_status_and_its_numbers():
    assert Claim("1F1B has GPipe's bubble", "confirmed", "both 27.3% at P=4, m=8").status == "confirmed"
    with pytest.raises(ValueError, match="status"):
        Claim("x", "plausible", "1")
    with pytest.raises(ValueError, match="numbers"):
        Claim("x", "refuted", "")


def test_the_tolerance_is_relative_to_the_theory():
    assert holds(100, 150, 0.5) and holds(100, 50, 0.5)
    assert not holds(100, 190, 0.5)  # math.isclose would accept it: 90 <= 0.5 * max(100, 190)
