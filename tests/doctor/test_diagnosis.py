"""lab.doctor.diagnosis and lab.doctor.checks: each threshold at its edge (made-up numbers), the ranking, a compile-only
memory problem, and `lab doctor` on the command line."""

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from lab.cli import main
from lab.doctor import checks as checks
from lab.doctor.checks import Finding
from lab.doctor.diagnosis import Diagnosis, diagnose
from lab.rules import ShardingReport, get_strategy
from lab.training.run import RunConfig


def _without_libtpu_flags() -> None:
    """A child's environment as a fresh shell has it: without the no-crash-on-OOM that lab predict puts where
    libtpu reads its flags."""
    os.environ.pop("LIBTPU_INIT_ARGS", None)


pytestmark = pytest.mark.long  # kept ahead of tests/predict/test_command.py, also long (see REFUSED below)

GIB = 2**30
# libtpu's refusal of a step too big for the chip: the second once lab predict started libtpu in this process with
# --xla_tpu_no_crash_on_oom=true (the doctor reads both, lab/doctor/diagnosis.py); which one depends on test order
REFUSED = ("RESOURCE_EXHAUSTED", "Invalid TPU program")


def _memory(peak: float, capacity: float = 16 * GIB, **kwargs) -> Finding:
    evidence = checks.MemoryEvidence(
        capacity,
        "test",
        {"params": GIB, "optimizer": 2 * GIB},
        (("w", GIB),),
        peak_bytes=peak,
        temp_bytes=peak - 3 * GIB,
        **kwargs,
    )
    return checks.check_memory(evidence)


def test_memory_edges_capacity_and_headroom():
    assert _memory(16 * GIB).severity == "warning"  # fits exactly: no headroom left
    assert _memory(16 * GIB + 1).severity == "problem"
    assert _memory(checks.MEMORY_HEADROOM * 16 * GIB).severity == "ok"
    assert _memory(checks.MEMORY_HEADROOM * 16 * GIB + 1).severity == "warning"


def test_memory_fix_attacks_the_larger_part_first():
    temporaries_dominate = _memory(40 * GIB, devices=4)  # 3 GiB of states, 37 GiB of temporaries
    assert temporaries_dominate.fix.startswith("split the batch") and "zero3" in temporaries_dominate.fix
    assert _memory(GIB).fix == ""
    evidence = checks.MemoryEvidence(
        16 * GIB,
        "test",
        {"params": 10 * GIB, "optimizer": 10 * GIB},
        (),
        peak_bytes=21 * GIB,
        temp_bytes=GIB,
        devices=4,
    )
    assert checks.check_memory(evidence).fix.startswith("shard the model states")
    refused = checks.MemoryEvidence(
        16 * GIB, "test", {"params": GIB}, (), peak_bytes=None, compiler_refused="RESOURCE_EXHAUSTED"
    )
    assert checks.check_memory(refused).severity == "problem"  # the compiler's word, whatever our estimate says


def _input(wait_s: float, step_s: float = 0.1) -> Finding:
    return checks.check_input([1.0] * checks.WARMUP_STEPS + [step_s] * 5, [0.9] * checks.WARMUP_STEPS + [wait_s] * 5)


def test_input_edges_after_warmup():
    assert _input(checks.INPUT_PROBLEM * 0.1).severity == "problem"
    assert _input(checks.INPUT_PROBLEM * 0.1 * 0.99).severity == "warning"
    assert _input(checks.INPUT_WARNING * 0.1 * 0.99).severity == "ok"  # the slow warm-up steps are not counted
    assert checks.check_input([], []).severity == "not applicable"


def test_idle_axes_and_the_pipeline_bubble():
    sizes = {"data": 1, "stage": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    idle = checks.check_idle_axes(sizes, ("stage",))
    assert idle.severity == "problem" and idle.numbers["repeats"] == 2 and "do the work of 4" in idle.evidence[0]
    assert checks.check_idle_axes(sizes, ()).severity == "ok"
    assert checks.check_pipeline_bubble(1, 4, 4).severity == "not applicable"
    assert checks.check_pipeline_bubble(2, 1, 4).numbers["bubble"] == pytest.approx(
        0.5
    )  # (P-1)/(M+P-1) = 1/2: a problem
    assert checks.check_pipeline_bubble(2, 1, 4).severity == "problem"
    assert checks.check_pipeline_bubble(4, 4, 8).severity == "warning"  # 3/7
    assert checks.check_pipeline_bubble(4, 16, 8).severity == "ok"  # 3/19
    assert "--micro-batches to 16" in checks.check_pipeline_bubble(4, 4, 8).fix


def test_expert_skew_edges():
    warm = [5.0] * checks.WARMUP_STEPS  # a skewed start is not what the run settles to
    assert checks.check_expert_skew(warm + [checks.EXPERT_SKEW_PROBLEM] * 3).severity == "problem"
    assert checks.check_expert_skew(warm + [checks.EXPERT_SKEW_WARNING] * 3).severity == "warning"
    assert checks.check_expert_skew(warm + [1.1] * 3).severity == "ok"
    assert checks.check_expert_skew([]).severity == "not applicable"


def test_unsharded_uses_the_strategys_limit():
    zero3 = get_strategy("zero3")
    over = ShardingReport(100, math.ceil(100 * zero3.max_unsharded_fraction) + 1, ("embed",))
    assert checks.check_unsharded(zero3, over, 8).severity == "problem"
    assert checks.check_unsharded(zero3, ShardingReport(100, 1, ("norm",)), 8).severity == "ok"
    assert (
        checks.check_unsharded(get_strategy("ddp"), ShardingReport(100, 100, ("embed",)), 8).severity == "ok"
    )  # by design
    assert checks.check_unsharded(zero3, over, 1).severity == "not applicable"


def test_communication_time_and_volume_edges():
    traffic = [checks.Traffic("all-gather", ("fsdp",), 4, 1e6, 0.5e-3)]
    assert checks.check_comm_time(traffic, 0.5e-3, "test").severity == "problem"
    assert checks.check_comm_time(traffic, 1e-3, "test").severity == "warning"
    assert checks.check_comm_time(traffic, 1.01e-3, "test").severity == "ok"
    expected = checks.zero_volume(shards_params=True, reshard_after_forward=True)
    assert expected == 3.0 and checks.zero_volume(False, True) == 2.0
    assert checks.check_comm_volume(checks.VOLUME_PROBLEM * 3.0, 1.0, expected, 8, "zero3").severity == "problem"
    assert checks.check_comm_volume(checks.VOLUME_WARNING * 3.0, 1.0, expected, 2, "zero3").severity == "warning"
    assert checks.check_comm_volume(3.0, 1.0, expected, 1, "zero3").severity == "ok"
    assert (
        checks.check_comm_volume(3.0, 1.0, expected, 1, "zero3", exact=False).severity == "not applicable"
    )  # a lower bound proves nothing
    assert checks.check_comm_volume(24.0, 1.0, expected, 8, "zero3", exact=False).severity == "problem"
    assert checks.check_exposed(None).severity == "not applicable"


def test_numerics_edges():
    assert checks.check_nonfinite([3.0, math.nan], [1.0, 1.0]).numbers["first_bad_step"] == 1
    assert checks.check_nonfinite([3.0, 2.0], [1.0, math.inf]).severity == "problem"
    assert checks.check_nonfinite([3.0, 2.0], [1.0, 1.0]).severity == "ok"
    calm = [1.0] * checks.SPIKE_WINDOW
    assert checks.check_spikes([*calm, checks.SPIKE_FACTOR]).severity == "warning"
    assert checks.check_spikes([*calm, checks.SPIKE_FACTOR * 0.99]).severity == "ok"
    assert checks.check_spikes(calm).severity == "not applicable"
    assert checks.check_divergence([5.0, 4.0, 6.0, 7.0]).severity == "problem"
    assert checks.check_divergence([5.0, 2.0, 2.5, 2.5]).severity == "warning"  # 2.5 > 1.2 x the best
    assert checks.check_divergence([5.0, 2.0, 2.3, 2.3]).severity == "ok"


def test_ranking_puts_problems_first_in_layer_order():
    findings = (
        Finding("memory", "m", "ok", ""),
        Finding("input", "i", "warning", ""),
        Finding("numerics", "n", "problem", ""),
        Finding("layout", "l", "problem", ""),
        Finding("communication", "c", "not applicable", ""),
    )
    diagnosis = Diagnosis(findings, "cpu:8")
    assert [f.check for f in diagnosis.ranked] == ["l", "n", "i", "m", "c"]
    assert diagnosis.start_here.check == "l"
    assert Diagnosis(findings[:2], "cpu:8").start_here is None


def test_a_1b_model_with_ddp_does_not_fit_a_v5e():
    """Compile-only: the TPU compiler refuses the step, and the doctor says memory first, without running anything.

    In a process of its own, as the CLI runs it: libtpu takes its flags once a process, and one that `lab predict`
    started (no-crash-on-OOM) refuses this step as an "Invalid TPU program", without the bytes it needed."""
    config = RunConfig(target="tpu:v5e:2x2", mesh="data=4", model="1b", strategy="ddp", global_batch=8)
    spawn = multiprocessing.get_context("spawn")  # with libtpu's flags as a fresh shell has them
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=_without_libtpu_flags) as fresh:
        diagnosis = fresh.submit(diagnose, config).result()
    memory = diagnosis.start_here
    assert memory.layer == "memory" and any(words in memory.evidence[0] for words in REFUSED)
    assert (
        memory.numbers["peak_bytes"] > memory.numbers["capacity_bytes"] == 16 * GIB
    )  # v5e's HBM from lab.targets.hardware
    assert memory.numbers["states_bytes"] > 10 * GIB  # 1b parameters and two Adam moments, fp32, whole on every chip
    assert "compile-only" in diagnosis.not_run
    assert {f.severity for f in diagnosis.findings if f.layer in ("input", "numerics")} == {"not applicable"}


def test_cli_prints_the_ranked_report_and_exits_0(capsys, devices):
    """A finding is not an error: the doctor ran, so the exit code is 0 (compile-only, so nothing executes)."""
    assert (
        main(
            [
                "doctor",
                "--target",
                "tpu:v5e:2x2",
                "--model",
                "1b",
                "--strategy",
                "ddp",
                "--mesh",
                "data=4",
                "--global-batch",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "start here: memory, peak memory per device" in out and "no steps run" in out
    assert any(words in out for words in REFUSED)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["doctor", "--strategy", "zero9"], "unknown strategy"),
        (["doctor", "--mesh", "fsdp=3"], "uses 3 devices"),
        (["doctor", "--capacity", "lots"], "size 'lots'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, devices, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
