"""``lab predict --fn``: a user's own step compiled as written and priced as the lab's model is, and its bad inputs."""

import json
from pathlib import Path

import pytest

from lab.cli import main
from lab.targets.hardware import profile
from tests.conftest import run_lab_json
from tests.data.programs import priced

pytestmark = pytest.mark.long  # libtpu compiles: scheduled first, with the other predict tests

PROGRAMS = Path(priced.__file__)
V5E = ("--target", "tpu:v5e:2x2", "--mesh", "fsdp=4")
ON_V5E = (*V5E, "--json")


def _predict(capsys, *argv: str) -> dict:
    assert main(["predict", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_labs_own_step_handed_over_as_a_program_is_priced_as_the_model_is(capsys):
    model = _predict(
        capsys, "--model", priced.SMALL, "--seq", str(priced.SEQ), "--batch-per-device", str(priced.BATCH_PER_DEVICE),
        *ON_V5E,
    )  # fmt: skip
    program = _predict(capsys, "--fn", f"{PROGRAMS}:lab_model", "--axis-types", "explicit", *ON_V5E)
    for key in ("step_s", "compute_s", "exposed_comm_s", "hardware_flops_per_step", "memory_bytes", "exposed_by_link"):
        assert program[key] == model[key], key
    assert program["program"].endswith("priced.py:lab_model") and program["mfu"] is None


@pytest.mark.parametrize(
    ("target", "mesh", "chip"), [("tpu:v5e:2x2", "fsdp=4", "v5e"), ("gpu:h100:1x8", "fsdp=8", "h100")]
)
def test_a_matmuls_flops_are_counted_as_by_hand_and_the_model_flops_give_the_mfu(target, mesh, chip, capsys):
    flops = 2 * (2 * priced.ROWS * priced.WIDTH * priced.WIDTH)  # x @ w forward, x^T @ g for the gradient
    where = ("--target", target, "--mesh", mesh, "--json")
    out = _predict(capsys, "--fn", f"{PROGRAMS}:matmul_gradient", "--model-flops", str(flops / 2), *where)
    assert out["hardware_flops_per_step"] == flops
    peak = profile(chip).peak_bf16_flops
    assert out["hfu"] == pytest.approx(flops / out["chips"] / out["step_s"] / peak)
    assert out["mfu"] == pytest.approx(out["hfu"] / 2)
    assert out["step_s"] >= out["compute_s"] > 0 and out["fits"]
    assert any("fsdp" in link for link in out["exposed_by_link"])  # w's columns gathered over fsdp


@pytest.mark.filterwarnings("ignore:jax.experimental.pjit.pjit has been deprecated")
def test_a_pjit_era_program_is_priced_as_the_same_step_written_today(capsys):
    """Bare PartitionSpecs resolved in the mesh in context (``with mesh:``, which pjit reads): the same gradient of
    sum(tanh(x @ w)) as `matmul_gradient`, so the same matmul FLOPs."""
    corpus = PROGRAMS.parent / "public_issues.py"
    out = _predict(
        capsys, "--fn", f"{corpus}:pjit_era_gradient", "--target", "tpu:v5e:2x4", "--mesh", "data=2,fsdp=4", "--json"
    )
    assert out["hardware_flops_per_step"] == 2 * (2 * 64 * 128 * 256) and out["fits"]


def test_a_program_over_hbm_says_by_how_much():
    """In a fresh process, as a user runs it: a worker whose libtpu another test started without no-crash-on-OOM
    has the compiler refuse the step instead (one line, exit 2), with no memory to price."""
    out = run_lab_json(["predict", "--fn", f"{PROGRAMS}:too_big", *V5E])  # run_lab_json adds --json
    assert not out["fits"] and out["over_by_bytes"] == out["memory_bytes"] - 16 * 2**30 > 0
    assert "jax.checkpoint" in out["advice"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--fn", "{p}:matmul_gradient", "--remat", "minimal"], "--remat goes with the lab's model, not with --fn"),
        (["--fn", "{p}:matmul_gradient", "--seq", "512", "--model", "llama3-70b"], "--model, --seq go with"),
        (["--model-flops", "1e12"], "--model-flops goes with --fn"),
        (["--fn", "{p}:matmul_gradient", "--model-flops", "-1"], "--model-flops"),
        (["--fn", "{p}:no_such_step"], "has no 'no_such_step'"),
        (["--fn", "{p}:matmul_gradient", "--target", "cpu:8"], "lab predict compiles for tpu:"),
        (["--fn", "{p}:matmul_gradient", "--mesh", "fsdp=3"], "mesh fsdp=3 uses 3 devices"),
        (["--fn", "{p}:too_big", "--mesh", "data=2,fsdp=2", "--timeout", "-1"], "--timeout"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(args, words, capsys):
    argv = [a.format(p=PROGRAMS) for a in args]
    target = [] if "--target" in argv else ["--target", "tpu:v5e:2x2"]
    assert main(["predict", *argv, *target]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err
