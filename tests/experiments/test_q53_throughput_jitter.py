"""throughput_jitter: five cases run as their configs say (no timing asserted), and the judge's readings of
step-time series tested on made-up series, where the answer is known."""

import math

import pytest

from experiments.q53_throughput_jitter import CASES, Config, Observations, Run, judge
from lab.provenance import Setup
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def page():
    return get("throughput_jitter").run(Config(steps=12, checkpoint_every=4, global_batch=8))


def test_every_check_reads_a_clock_and_states_its_claim(page):
    assert pinned(page) == {}  # nothing here is exact or a model: every check is timed on this host
    assert len(page.checks) == 11 and all(c.kind == "timing" and c.basis for c in page.checks)
    assert [c.claim for c in page.claims][:2] == [
        "Look at the timeline first: its shape (periodic, random, trend) names the layer that jitters",
        "A drop every N steps is most likely a checkpoint save: check that the save interval is N",
    ]


def test_every_case_is_on_the_page_with_its_shape(page):
    rows = page.tables[0].rows
    assert [row[0] for row in rows] == list(CASES)
    assert all(row[1] in ("periodic", "random", "trend", "steady") for row in rows)
    assert set(page.plots) == {"step_times"}


def test_checkpoint_cases_save_every_k_steps_and_loader_cases_wait_at_least_the_loader(page):
    runs = {r["case"]: r for r in page.observations["runs"]}
    for case in ("sync checkpoints", "async checkpoints"):
        assert [i for i, saved in enumerate(runs[case]["checkpoint"]) if saved] == [3, 7, 11]
    assert not any(runs["steady"]["checkpoint"])
    slow = runs["slow loader"]
    assert slow["input_ms"] > 0 and len(slow["scheduled_s"]) == len(slow["seconds"])
    # the sleep is inside the measured wait (a sleep never returns early)
    assert all(wait >= cost for wait, cost in zip(slow["data_s"], slow["scheduled_s"]))
    assert runs["slow loader + prefetch"]["prefetch"] == 8


# --- the judge on made-up series --------------------------------------------------------------------------------

STEP = 0.02
K = 10


def _run(case, seconds, **kw) -> Run:
    n = len(seconds)
    fields = {
        "input_ms": 0.0,
        "input_jitter_ms": 0.0,
        "prefetch": 0,
        "checkpoint_every": 0,
        "async_checkpoint": False,
        "state_bytes": 1 << 20,
        "data_s": (0.0005,) * n,
        "save_s": (0.0,) * n,
        "checkpoint": (False,) * n,
    } | kw
    return Run(case=case, seconds=tuple(seconds), **fields)


def _observations(burst: bool) -> Observations:
    n = 60
    noise = [STEP * (1 + 0.05 * math.sin(1.7 * i)) for i in range(n)]
    saves = [(i + 1) % K == 0 for i in range(n)]
    sync = [t + (0.3 if s else 0.0) for t, s in zip(noise, saves)]
    if burst:  # another process slows seven steps before the first save, as seen on this host
        sync = [t * 3 if 2 <= i < 9 else t for i, t in enumerate(sync)]
    asyn = [t + (0.1 if s else 0.0) for t, s in zip(noise, saves)]
    costs = [0.01 + 0.04 * (i % 7) / 6 for i in range(n)]
    slow = [t + c for t, c in zip(noise, costs)]
    return Observations(
        setup=Setup("cpu:8"),
        host_copy_bandwidth=10e9,
        runs=(
            _run("steady", noise),
            _run(
                "sync checkpoints",
                sync,
                checkpoint=tuple(saves),
                save_s=tuple(0.3 if s else 0.0 for s in saves),
                checkpoint_every=K,
            ),
            _run(
                "async checkpoints",
                asyn,
                checkpoint=tuple(saves),
                save_s=tuple(0.1 if s else 0.0 for s in saves),
                checkpoint_every=K,
                async_checkpoint=True,
            ),
            _run(
                "slow loader", slow, input_ms=10.0, input_jitter_ms=30.0, data_s=tuple(costs), scheduled_s=tuple(costs)
            ),
            _run("slow loader + prefetch", noise, input_ms=10.0, input_jitter_ms=30.0, prefetch=8),
        ),
    )


@pytest.mark.parametrize("burst", [False, True])
def test_the_dips_and_their_period_survive_a_slow_stretch_of_the_host(burst):
    obs = _observations(burst)
    sync = obs.run("sync checkpoints")
    assert sync.dip_period == K and sync.shape == "periodic" and sync.dips() == (9, 19, 29, 39, 49, 59)
    if burst:  # the raw series sees the stretch as random slow steps and loses the period
        assert sync.series().period is None
    verdicts = {c.quantity: c.verdict for c in judge(obs, Config(checkpoint_every=K)).checks}
    assert verdicts["sync checkpoints: period of the dips (steps 4x their neighbours)"] == "agrees"
    assert verdicts["sync checkpoints: dips that are save steps / dips"] == "agrees"


def test_an_async_save_far_above_its_copy_differs_and_no_sentence_refines_it():
    checks = {c.quantity: c for c in judge(_observations(False), Config(checkpoint_every=K)).checks}
    copy = checks["async checkpoints: median blocking save (ms) = the state's copy to host memory"]
    assert copy.verdict == "differs" and copy.refined is None
    added = checks["async checkpoints: mean step time added / sync's, over the run (first save included)"]
    assert added.observed == pytest.approx(0.1 / 0.3) and added.verdict == "agrees"


def test_the_loader_check_prices_the_seeded_draws_beside_the_textbook():
    obs = _observations(False)
    loader = {c.quantity: c for c in judge(obs, Config(checkpoint_every=K)).checks}[
        "slow loader: median wait for data (ms) = latency + ln2 x jitter + placement"
    ]
    # textbook 10 + ln2·30 + 0.5 ms; the draws' median (here 0.01 + 0.04·3/6 s) + placement is what was waited
    assert loader.theory == pytest.approx(10 + math.log(2) * 30 + 0.5)
    assert loader.refined == pytest.approx(30.5) and loader.observed == pytest.approx(30.0)
