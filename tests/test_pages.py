"""The committed pages are evidence: fresh, re-judgeable, and made of checks that can fail.

For every experiment's page under results/ (or under $LAB_RESULTS, to test
pages written elsewhere):

- its result.json holds the observations, the config, every check with
  quantity, kind, theory, observed, rtol and verdict, and the claims;
- its code hash is the code's: a page made by other code is stale
  (``lab report --stale`` regenerates exactly those);
- re-judging its observations gives the same checks and claims, exactly;
- no exact check is loose, no refined check's corrected value misses;
- every exact and model check can fail: some perturbation of the observations
  (a number x1.5 or x0.5, a count +1 or -1, a string or a flag changed, a
  series scaled whole) turns it to "differs". A check no perturbation can move
  reads nothing this run observed: its two sides come from the same code, and
  it belongs in tests/. A field is first perturbed in every record at
  once; then each leaf alone (of a sequence of more than 8 records, the first
  and last two).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from lab.registry import experiments
from lab.verdict import EXACT_RTOL, holds

RESULTS = Path(os.environ.get("LAB_RESULTS", Path(__file__).resolve().parents[1] / "results"))
FIELDS = {"quantity", "kind", "theory", "observed", "rtol", "verdict", "relation", "refined", "why", "basis"}
NAMES = sorted(experiments())


def _stored(name: str) -> dict:
    path = RESULTS / name / "result.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `lab report --only {name}`")
    return json.loads(path.read_text())


@pytest.fixture(scope="module", params=NAMES)
def page(request):
    name = request.param
    return name, experiments()[name], _stored(name)


def test_a_page_stores_its_observations_checks_and_claims(page):
    name, _, data = page
    assert data["observations"] and data["config"], f"{name}: result.json holds no observations or config"
    assert data["checks"], f"{name}: no checks"
    for c in data["checks"]:
        assert set(c) == FIELDS, f"{name}: check {c.get('quantity')!r} has fields {sorted(c)}"
    assert "claims" in data


def test_a_page_was_made_by_the_code_it_is_committed_with(page):
    name, experiment, data = page
    assert data["provenance"]["code_hash"] == experiment.code_hash, (
        f"results/{name} is stale: its code changed since it was measured; run `lab report --stale`"
    )


def test_rejudging_the_observations_reproduces_the_page_exactly(page, tmp_path):
    name, experiment, data = page
    result = experiment.rejudge(RESULTS / name)
    rejudged = json.loads(json.dumps([c.__dict__ for c in result.checks], default=str))
    assert rejudged == data["checks"]
    assert json.loads(json.dumps([c.__dict__ for c in result.claims], default=str)) == data["claims"]


def test_exact_checks_are_exact_and_refinements_agree(page):
    name, _, data = page
    for c in data["checks"]:
        if c["kind"] == "exact":
            assert c["rtol"] <= EXACT_RTOL, f"{name}: exact check {c['quantity']!r} with rtol {c['rtol']}"
        if c["verdict"] == "refined":
            assert holds(c["refined"], c["observed"], c["rtol"], c["relation"]), f"{name}: {c['quantity']!r}"
        if c["kind"] != "exact":
            assert c["basis"], (
                f"{name}: {c['kind']} check {c['quantity']!r} does not say why its tolerance is what it is"
            )


def test_every_exact_and_model_check_can_fail(page):
    name, experiment, _ = page
    observations, config, _ = experiment.stored(RESULTS / name)
    base = experiment.module.judge(observations, config).checks
    open_ = {i for i, c in enumerate(base) if c.kind in ("exact", "model") and c.verdict != "differs"}
    for mutated in _mutations(observations):
        if not open_:
            break
        try:
            checks = experiment.module.judge(mutated, config).checks
        except Exception:  # a perturbation the judge cannot read says nothing about any check
            continue
        if len(checks) != len(base):
            continue
        open_ -= {i for i in open_ if checks[i].verdict == "differs"}
    stuck = [base[i].quantity for i in sorted(open_)]
    assert not stuck, f"{name}: no perturbation of the observations moves these checks: {stuck}"


def _mutations(observations):
    """Copies of the typed observations with one leaf (or one series of numbers, whole) perturbed.

    A string becomes another value that the same field holds elsewhere (a kind, an axis: what a compiler could
    have written instead), or itself with a prime.
    """
    alternatives: dict[str, set[str]] = {}
    for path, value in _leaves(observations):
        if isinstance(value, str):
            alternatives.setdefault(_key(path), set()).add(value)
    by_field: dict[tuple, list] = {}  # every record's copy of one field, perturbed together first
    for path, value in _leaves(observations, limit=None):
        by_field.setdefault(tuple("*" if isinstance(p, int) else p for p in path), []).append((path, value))
    for leaves in by_field.values():
        for variant in range(2):
            mutated = observations
            for path, value in leaves:
                changed = _perturbed(value)
                mutated = _replaced(mutated, path, changed[min(variant, len(changed) - 1)]) if changed else mutated
            yield mutated
    for path, value in _leaves(observations):
        others = sorted(alternatives.get(_key(path), set()) - {value}) if isinstance(value, str) else []
        for changed in [*others[:2], *_perturbed(value)]:
            yield _replaced(observations, path, changed)


def _key(path) -> str:
    """The name a leaf is stored under: its field or key, or for an element of a sequence the sequence's."""
    return next((part for part in reversed(path) if isinstance(part, str)), "")


def _leaves(node, path=(), limit=8):
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _leaves(getattr(node, f.name), (*path, f.name), limit)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key), limit)
    elif isinstance(node, tuple | list):
        if node and all(_number(v) for v in node):
            yield path, node  # a series: perturbed whole, and each of a short one alone
            if len(node) > 8:
                return
        ends = range(len(node)) if limit is None or len(node) <= limit else (0, 1, len(node) - 2, len(node) - 1)
        for index in ends:  # a long sequence of records: its first and last ones stand for the rest
            yield from _leaves(node[index], (*path, index), limit)
    elif node is not None:
        yield path, node


def _perturbed(value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):  # a count off by one; a size in bytes (1 KiB or more) off by a factor too
        return [value + 1, value - 1, *([value * 2, value // 2] if abs(value) >= 1024 else [])]
    if isinstance(value, float):  # a little either way, and far enough to reorder a ranking
        return [value * 1.5, value * 0.5, value * 10] if value else [1.0]
    if isinstance(value, str):
        return [value + "'"]
    if isinstance(value, tuple | list):
        return [type(value)(_scaled(v, 1.5) for v in value), type(value)(_scaled(v, 0.5) for v in value)]
    return []


def _scaled(value, factor):
    return value + (1 if factor > 1 else -1) if isinstance(value, int) else value * factor


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _replaced(node, path, value):
    """`node` with the leaf at `path` replaced: what lies on the path is copied, everything else shared."""
    if not path:
        return value
    head, *rest = path
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(node, **{head: _replaced(getattr(node, head), rest, value)})
    if isinstance(node, dict):
        return {**node, head: _replaced(node[head], rest, value)}
    items = list(node)
    items[head] = _replaced(node[head], rest, value)
    return type(node)(items)
