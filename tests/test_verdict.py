"""Checks and verdicts: agree within tolerance, refined when explained, differ otherwise."""

from lab.verdict import Expectation, check, compare, tally


def test_numbers_within_tolerance_agree():
    assert check("bytes", 100, 104, rtol=0.05).verdict == "agrees"
    assert check("bytes", 100, 106, rtol=0.05).verdict == "differs"


def test_an_explained_difference_is_refined_and_keeps_its_reason():
    row = check("all-reduces", 2, 1, explained="XLA combined both into one tuple all-reduce")
    assert row.verdict == "refined" and "tuple" in row.note and row.passed


def test_strings_must_match():
    assert check("axes", "tensor", "tensor").verdict == "agrees"
    assert check("axes", "tensor", "fsdp").verdict == "differs"


def test_compare_reports_missing_quantities_as_differs():
    expected = Expectation("ring", {"permutes": 14, "bytes": 7.0}, rtol=0.01)
    rows = compare(expected, {"permutes": 14})
    assert [r.verdict for r in rows] == ["agrees", "differs"]
    assert rows[1].observed == "not found"
    assert tally(rows) == "1 agree, 0 refined, 1 differ"


def test_at_most_agrees_up_to_the_limit_and_says_what_it_saw_beyond():
    from lab.verdict import at_most

    assert at_most("ratio", 0.5, 0.5).verdict == "agrees"
    beyond = at_most("ratio", 0.7, 0.5)
    assert (beyond.verdict, beyond.theory, beyond.observed) == ("differs", "<= 0.5", 0.7)
    assert at_most("ratio", 0.7, 0.5, explained="a fixed cost").verdict == "refined"
