"""``lab predict`` end to end on small topologies, its bad inputs, and the op-by-op pricing's parts."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest

from lab.cli import main
from lab.errors import LabError
from lab.hlo import parse_collectives
from lab.hlo.schedule import parse_schedule
from lab.predict import calibration
from lab.predict.attention import flash_seconds
from lab.predict.calibration import solve_matmul_efficiency
from lab.predict.command import Predict, price, read_step, run_prediction
from lab.predict.ops import _taps, convolution_flops, op_flops
from lab.predict.spec import model_flops, parse_model
from lab.targets.hardware import H100, profile
from tests.conftest import run_lab_json

pytestmark = pytest.mark.long  # libtpu compiles for a minute and more: scheduled first, after the doctor's tests
# (collected before these, so on a shared worker they run first: see REFUSED in tests/doctor/test_diagnosis.py)

LAYERS_2 = ("--target", "tpu:v5e:2x2", "--layers-compiled", "2")
SMALL = "layers=2,d_model=256,heads=4,kv_heads=2,head_dim=64,d_ff=512,vocab=1024,mlp=swiglu"


def test_a_small_step_on_v5e_predicts_every_reported_quantity(capsys):
    assert (
        main(
            [
                "predict",
                "--model",
                SMALL,
                "--target",
                "tpu:v5e:2x2",
                "--mesh",
                "fsdp=4",
                "--seq",
                "128",
                "--batch-per-device",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "step_s",
        "tflops_per_chip",
        "mfu",
        "model_flops_per_step",
        "hardware_flops_per_step",
        "memory_bytes",
        "hbm_bytes",
        "fits",
        "compute_s",
        "exposed_comm_s",
        "compile_s",
    ):
        assert key in out
    assert out["fits"] and out["chips"] == 4 and len(out["top_ops"]) == 10
    assert out["step_s"] >= out["compute_s"] > 0
    # remat full recomputes the forward: the program runs more matmul FLOPs than the model convention counts
    assert out["hardware_flops_per_step"] > 0.9 * out["model_flops_per_step"]
    assert out["model_flops_per_step"] == model_flops(
        parse_model(SMALL).__class__(**{**parse_model(SMALL).__dict__, "seq": 128}), 2 * 4 * 128
    )


def test_a_step_a_compiler_pass_crashes_on_compiles_without_it_and_says_so(monkeypatch, capsys):
    """libtpu 0.0.42's while-loop-all-reduce-code-motion fails a RET_CHECK on some steps (TPU7x's Llama 3.1 70B
    recipe): the step compiles again without that pass, and the prediction names the pass it went without."""
    import jax

    real = jax.stages.Lowered.compile

    def crashing(lowered, compiler_options=None):
        if "xla_disable_hlo_passes" not in (compiler_options or {}):
            raise jax.errors.JaxRuntimeError("INTERNAL: RET_CHECK failure (while_loop_all_reduce_code_motion.cc:1)")
        return real(lowered, compiler_options)

    argv = ["predict", "--model", SMALL, "--target", "tpu:v5e:2x2", "--seq", "128"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disabled_passes"] == []
    monkeypatch.setattr(jax.stages.Lowered, "compile", crashing)
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disabled_passes"] == ["while-loop-all-reduce-code-motion"]
    assert main(argv) == 0
    assert "compiled without the compiler's pass while-loop-all-reduce-code-motion" in capsys.readouterr().out


@pytest.mark.parametrize(("target", "chip"), [("tpu:v4:2x2x1", "v4"), ("tpu:v5p:2x2x1", "v5p"), ("tpu:v6e:2x2", "v6e")])
def test_every_generation_predicts_on_its_own_chip(target, chip):
    p = run_prediction(Predict(model=SMALL, target=target, mesh="fsdp=2,tensor=2", seq=128))
    assert p.chips == 4 and p.hbm_bytes == profile(chip).hbm_bytes and p.fits
    # each generation's constant is set by its own run (results/published_runs, results/pod_predictions)
    assert p.calibrated and p.calibrated_on == chip
    assert p.efficiency["matmul"] == calibration.MATMUL_EFFICIENCY[p.calibrated_on]
    assert p.step_s >= p.compute_s > 0 and p.comm_s > 0  # the tensor all-reduces and fsdp gathers are priced


def test_two_slices_put_the_data_axis_on_dcn():
    p = run_prediction(Predict(model=SMALL, target="tpu:v5e:2x2", slices=2, mesh="fsdp=4", seq=256))
    assert p.chips == 8 and p.mesh == "data=2,fsdp=4"
    # the gradients' all-reduce over the slices: libtpu's megascale transfers, read and priced on DCN
    assert any(link.startswith("data on DCN across 2 slices") for link in p.exposed_by_link), p.exposed_by_link


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "llama9"], "unknown model preset"),
        (["--model", SMALL + ",colour=red"], "unknown key"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "tensor=4", "--seq", "128"], "divisible"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "stage=4", "--seq", "128"], "stage=4"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--seq", "100"], "tiles the sequence"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--seq", "1"], "tiles the sequence"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--seq", "640"], "tiles the sequence"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=8"], "uses 8 devices"),
        (["--model", SMALL, "--target", "tpu:v5e:3x7"], "libtpu does not know"),
        (["--model", SMALL, "--target", "cpu:8"], "compiles for tpu"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--layers-compiled", "1"], "without its loop"),
        (
            ["--model", SMALL.replace("layers=2", "layers=8"), "--mesh", "stage=2,fsdp=2", *LAYERS_2],
            "--layers-compiled 2 with stage=2: each stage must run the same 2 or more layers, and not 2 (the "
            "pipeline's ticks, whose buffers would read as the layers'); give 6",
        ),
        (
            ["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--seq", "1073741824"],
            "tokens a step, past the 2,147,483,647 a step can count (int32); give --seq 536,870,911 or less",
        ),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--remat", "half"], "offload:<names>"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--sequence-parallel"], "tensor=2 or more"),
        (
            ["--model", SMALL, "--target", "tpu:v5e:2x2", "--remat", "offload:mlp_out,out_proj"],
            "'mlp_out' is not a named",
        ),
        (["--model", SMALL.replace("layers=2", "layers=4"), "--remat", "offload:out_proj", *LAYERS_2], "unrolls"),
        (["--model", SMALL, "--target", "tpu:v5e:2x2", "--matmul-precision", "fp8"], "v5e publishes no fp8"),
        (
            ["--model", f"{SMALL},experts=4,capacity=dropless", "--target", "tpu:v5e:2x2", "--mesh", "fsdp=2,expert=2"],
            "--mesh expert=2: capacity=dropless multiplies each device's own tokens by every expert",
        ),
        (["--model", f"{SMALL},experts=4,capacity=all", "--target", "tpu:v5e:2x2"], "none or dropless"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(args, words, capsys):
    assert main(["predict", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_compiler_flags_are_taken_as_the_help_writes_them():
    from lab.cli import _parse

    flags = "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_overlap_compute_collective_tc=true"
    for argv in (["--libtpu-flags", flags], [f"--libtpu-flags={flags}"]):
        assert _parse(["predict", *argv, "--seq", "128"]) == Predict(seq=128, libtpu_flags=flags)


TPU_FLAGS = ("--libtpu-flags", "LIBTPU_INIT_ARGS", "topology_devices", LAYERS_2)
GPU_FLAGS = ("--xla-flags", "XLA_FLAGS", "gpu_cluster_devices", ("--target", "gpu:h100:1x8", "--seq", "256"))


@pytest.mark.parametrize(
    ("compiler", "flags", "words"),
    [
        (TPU_FLAGS, "--2a886c8_chip_config_name=default", "Unknown command line flag '2a886c8_chip_config_name'"),
        (TPU_FLAGS, "--xla_tpu_enable_async_collective_fusion=maybe", "Illegal value 'maybe'"),
        (TPU_FLAGS, "xla_tpu_enable_async_collective_fusion=true", "is not a flag; write each as --name=value"),
        (GPU_FLAGS, "--xla_gpu_enable_async_all_gather=true", "unknown to this XLA: --xla_gpu_enable_async_all_gather"),
        (GPU_FLAGS, "xla_gpu_enable_latency_hiding_scheduler=true", "is not a flag; write each as --name=value"),
        (GPU_FLAGS, "--xla_gpu_memory_limit_slop_factor=abc", "cannot read 'abc' as a value of --xla_gpu_memory_limit"),
    ],
)
def test_a_flag_the_compiler_rejects_is_one_line_and_exit_2_before_it_starts(
    compiler, flags, words, capsys, monkeypatch
):
    """libtpu's flags and XLA:GPU's alike: refused before the compiler starts, nothing left where it reads them."""
    import os

    from lab.targets import devices

    option, variable, starts, target = compiler

    def no_compile(*args, **kwargs):
        raise AssertionError("the compiler started before the flags were checked")

    monkeypatch.setattr(devices, starts, no_compile)
    before = os.environ.get(variable)
    assert main(["predict", "--model", SMALL, *target, option, flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert os.environ.get(variable) == before  # nothing of the bad flags left for the compiler to read


def test_a_flag_libtpu_rejects_in_the_users_environment_is_one_line_and_exit_2():
    """libtpu reads LIBTPU_INIT_ARGS when it starts and ends the process on a flag it does not know (exit 1, no
    word); the lab tries them first, in a fresh process as the user runs it."""
    env = {**os.environ, "LIBTPU_INIT_ARGS": "--xla_dump_to=/tmp/hlo"}  # XLA's flag, not libtpu's
    argv = [sys.executable, "-m", "lab", "predict", "--model", SMALL, "--target", "tpu:v5e:2x2", "--seq", "128"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("lab: error: libtpu rejects LIBTPU_INIT_ARGS '--xla_dump_to=/tmp/hlo': Unknown command")


def test_flags_libtpu_knows_pass_its_check():
    from lab.targets import libtpu

    libtpu.check(("--xla_tpu_enable_async_collective_fusion=true", "--xla_tpu_no_crash_on_oom=true"))


@pytest.mark.parametrize(
    ("flags", "waits"), [((), ["all-gather", "reduce-scatter"]), (calibration.CF_FOR_ALL_GATHER, ["reduce-scatter"])]
)
def test_fsdp_collectives_libtpu_runs_synchronously_are_named_with_what_they_cost(flags, waits):
    """On v6e libtpu's defaults run every FSDP gather synchronously and MaxText's collective-fusion flags make them
    asynchronous; the gradients' reduce-scatters wait either way. `lab predict` says which, each a fresh process."""
    argv = ["predict", "--model", SMALL, "--target", "tpu:v6e:2x4", "--mesh", "data=2,fsdp=4", "--seq", "128"]
    argv += ["--libtpu-flags", flags] if flags else []
    assert sorted(run_lab_json(argv)["synchronous_s"]) == waits
    if not flags:
        shown = subprocess.run([sys.executable, "-m", "lab", *argv], capture_output=True, text=True, check=True).stdout
        assert "every FSDP all-gather" in " ".join(shown.split()) and "fuse_all_gather=true" in shown


CONVOLUTIONS = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[8,512,1024,1], b: bf16[12,8,160,512], x: f32[4,1,16], w: f32[64,16,32]) -> bf16[8,1024,12,160] {
  %a = bf16[8,512,1024,1]{3,2,1,0} parameter(0)
  %b = bf16[12,8,160,512]{3,2,1,0} parameter(1)
  %x = f32[4,1,16]{2,1,0} parameter(2)
  %w = f32[64,16,32]{2,1,0} parameter(3)
  %padded = f32[4,64,32]{2,1,0} convolution(%x, %w), window={size=64 pad=63_63}, dim_labels=b0f_0io->b0f
  ROOT %experts = bf16[8,1024,12,160]{3,2,1,0} convolution(%a, %b),
    window={size=8x12 stride=7x1 pad=0_0x11_11 lhs_dilate=8x1 rhs_reversal=0x1}, dim_labels=0fb1_10oi->0b1f
}
"""


def test_convolution_windows_count_only_the_taps_on_real_elements():
    # a [.., 1] input under a window of 64 padded 63 each side: 64 outputs, one real tap each
    assert _taps(n=1, w=64, n_out=64, lo=63, stride=1, dilation=1) == 64
    assert _taps(n=8, w=3, n_out=6, lo=0, stride=1, dilation=1) == 18  # a valid convolution
    # 8 elements dilated 8 times (57 positions), window 8, stride 7: each of 8 outputs lands on one element
    assert _taps(n=8, w=8, n_out=8, lo=0, stride=7, dilation=1, holes=8) == 8
    schedule = parse_schedule(CONVOLUTIONS)
    padded, experts = (i for i in schedule.computations[schedule.entry] if i.opcode == "convolution")
    assert convolution_flops(schedule, schedule.entry, padded) == 2 * 4 * 32 * 16 * 64
    # libtpu's form of an MoE layer's expert matmul becd,edf->becf (b 12, e 8, c 160, d 512, f 1024): the experts
    # as a dilated spatial dimension, the batch as a padded one (it once counted 3 of the 8 experts' taps)
    assert convolution_flops(schedule, schedule.entry, experts) == 2 * 12 * 8 * 160 * 512 * 1024


GEMMS = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[256,512], b: bf16[256,512], x: bf16[4,256,64], y: bf16[4,64,128]) -> bf16[256,256] {
  %a = bf16[256,512]{1,0} parameter(0)
  %b = bf16[256,512]{1,0} parameter(1)
  %x = bf16[4,256,64]{2,1,0} parameter(2)
  %y = bf16[4,64,128]{2,1,0} parameter(3)
  %batched = (bf16[4,256,128]{2,1,0}, s8[4194304]{0}) custom-call(%x, %y), custom_call_target="__cublas$gemm",
    backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  %lt = (bf16[256,256]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul",
    backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = bf16[256,256]{1,0} get-tuple-element(%lt), index=0
}
"""


def test_cublas_gemms_count_their_dots_flops():
    """XLA:GPU's GEMMs as cuBLAS custom calls (--xla_gpu_enable_triton_gemm=false): 2 · result · contracted."""
    schedule = parse_schedule(GEMMS)
    batched, lt = (i for i in schedule.computations[schedule.entry] if i.opcode == "custom-call")
    assert op_flops(schedule, schedule.entry, batched) == 2 * 4 * 256 * 128 * 64
    assert op_flops(schedule, schedule.entry, lt) == 2 * 256 * 256 * 512


def test_an_moe_step_prices_each_expert_matmul_at_its_einsums_flops(capsys):
    # E 8, top-2, capacity 1.25 of 128 tokens: 40 slots per expert; remat full: every expert einsum runs forward,
    # again in the recompute, and twice backward (SwiGLU: three einsums a layer)
    moe = "layers=2,d_model=256,heads=4,kv_heads=2,d_ff=512,vocab=1024,mlp=swiglu,experts=8,top_k=2,capacity=1.25"
    argv = ["predict", "--model", moe, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=2,expert=2", "--seq", "128"]
    assert main([*argv, "--batch-per-device", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = parse_model(moe)
    assert out["parameters"] == config.parameters and config.active_parameters < config.parameters
    assert out["model_flops_per_step"] == model_flops(replace(config, seq=128), 2 * 4 * 128)
    assert any(name.startswith("expert") for name in out["exposed_by_link"])  # the dispatch and combine all-to-alls
    per_einsum = 2 * (2 * 2) * (8 / 2) * 40 * 256 * 512  # per chip: 4 sequences' slots for 4 of the 8 experts
    expert_ops = [o["flops"] / per_einsum for o in out["top_ops"] if "/moe/be" in o["op"]]
    # a fusion holds one einsum or two whole ones, never a fraction (3/8 and 36/8 before the windows were read)
    assert expert_ops and all(ratio in (1.0, 2.0) for ratio in expert_ops), expert_ops


@pytest.mark.parametrize("d_ff", [512, 1536])
def test_a_dropless_moe_step_prices_megabloxs_grouped_matmuls_by_the_whole_blocks_they_multiply(d_ff):
    """capacity=dropless compiles MaxText's sparse_matmul: megablox's gmm forward, and gmm + tgmm backward, for each
    of a SwiGLU expert's three matmuls. Counted here from the sizes and megablox's tiling, apart from the kernels'
    modules the pricing reads: tiles (512, min(1024, k), min(1024, n)) from each forward [k, n]; the rows'
    gradient multiplies [n, k] with the same tiles; every block is multiplied whole (a d_ff of 1536 is two tiles of
    1024), and the row tiles are visited m/tm + E - 1 times."""
    moe = f"{SMALL.replace('d_ff=512', f'd_ff={d_ff}')},experts=8,top_k=2,capacity=dropless"
    reading = read_step(Predict(model=moe, target="tpu:v5e:2x2", mesh="fsdp=4", seq=512, batch_per_device=2))
    grouped = [o for o in reading.read.predict(calibration.efficiency("v5e")).ops if "gmm" in o.name]
    visits = 2 * 512 * 2 // 512 + 8 - 1  # per chip: 2 sequences of 512 tokens to 2 experts, 4 row tiles of 512

    def whole(size, tile):
        return -(-size // tile) * tile

    def matmul(k, n):  # remat full: forward, recompute, the rows' gradient, the weights' (tgmm)
        tk, tn = min(1024, k), min(1024, n)
        forward = whole(k, tk) * whole(n, tn)
        return 2 * 512 * visits * (3 * forward + whole(n, tk) * whole(k, tn))

    expected = 2 * matmul(256, d_ff) + matmul(d_ff, 256)  # gate and input, then output, per layer
    assert sum(o.flops * o.runs for o in grouped) == pytest.approx(2 * expected, rel=1e-9)


def test_an_offloading_remat_sends_the_named_activations_to_host_and_recomputes_the_rest():
    # MaxText's custom policy: the attention's four projections offloaded are not recomputed; remat full recomputes
    # them (and everything else). Per chip, a layer's projections are 2 * tokens * D * (H + G + G + H) * K FLOPs.
    config, chips, tokens = parse_model(SMALL), 4, 2 * 128
    args = {"model": SMALL, "target": "tpu:v5e:2x2", "mesh": "fsdp=4", "seq": 128, "batch_per_device": 2}
    full = read_step(Predict(**args))
    offload = read_step(Predict(**args, remat="offload:decoder_layer_input,query_proj,key_proj,value_proj,out_proj"))
    projections = 2 * tokens * config.embed * 2 * (config.heads + config.groups) * config.head_dim * config.layers
    assert price(full).hardware_flops_per_step - price(offload).hardware_flops_per_step == chips * projections
    # the named activations live in host memory (space 5) between the forward and the backward pass
    assert "S(5)" in offload.compiled.hlo and "S(5)" not in full.compiled.hlo
    assert price(offload).host_bytes > 0 and price(full).host_bytes == 0
    # ...and cross PCIe twice: each layer's block input, Q, K, V and attention output out, and back, at v5e's PCIe
    named = tokens * (config.embed + (config.heads + 2 * config.groups) * config.head_dim + config.embed) * 2
    transfers = [c for c in offload.read.predict(calibration.efficiency("v5e")).comms if c.kind == "host transfer"]
    for direction in ("to host", "from host"):
        moved = [c for c in transfers if c.link == f"PCIe {direction}"]
        assert sum(c.bytes * c.runs for c in moved) == config.layers * named
        assert sum(c.seconds for c in moved) == pytest.approx(config.layers * named / profile("v5e").host_bandwidth)


def test_a_custom_remat_keeps_its_named_activations_in_hbm_and_recomputes_only_the_rest():
    # MaxText's custom policy with every name =device: nothing goes to host, the projections are not recomputed
    config, chips, tokens = parse_model(SMALL), 4, 2 * 128
    args = {"model": SMALL, "target": "tpu:v5e:2x2", "mesh": "fsdp=4", "seq": 128, "batch_per_device": 2}
    full = price(read_step(Predict(**args)))
    names = ("decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "out_proj")
    kept = price(read_step(Predict(**args, remat="custom:" + ",".join(f"{n}=device" for n in names))))
    projections = 2 * tokens * config.embed * 2 * (config.heads + config.groups) * config.head_dim * config.layers
    assert full.hardware_flops_per_step - kept.hardware_flops_per_step == chips * projections
    assert kept.host_bytes == 0 and kept.memory_bytes > full.memory_bytes


def test_a_custom_remat_keeps_the_mlps_activations_by_maxtexts_names():
    # a recipe's mlpwi_0 / mlpwi_1 (the gate's and the other input matmul's outputs) kept: the backward recomputes
    # neither; mlpwo (W_out's output) kept changes nothing, as the backward needs W_out's input, not its output
    config, chips, tokens = parse_model(SMALL), 4, 2 * 128
    args = {"model": SMALL, "target": "tpu:v5e:2x2", "mesh": "fsdp=4", "seq": 128, "batch_per_device": 2}
    full = price(read_step(Predict(**args)))
    inputs = price(read_step(Predict(**args, remat="custom:mlpwi_0=device,mlpwi_1=device")))
    output = price(read_step(Predict(**args, remat="custom:mlpwo=device,qkv_proj=device")))
    assert config.gated and full.hardware_flops_per_step - inputs.hardware_flops_per_step == (
        chips * 2 * (2 * tokens * config.embed * config.mlp) * config.layers
    )
    # JAX saves only what the backward reads: W_out's output, kept or not, is the same program
    assert (output.hardware_flops_per_step, output.memory_bytes) == (full.hardware_flops_per_step, full.memory_bytes)


def test_tpu7x_shows_two_devices_per_chip_each_with_half_its_compute_and_memory():
    p = run_prediction(Predict(model=SMALL, target="tpu:tpu7x:2x2x1", mesh="fsdp=4,tensor=2", seq=128))
    chip = profile("tpu7x")
    assert p.chips == 8 and p.devices_per_chip == 2 and p.fits  # 4 chips, 8 of JAX's devices
    assert (chip.peak_bf16_flops, chip.hbm_bytes) == (2.307e15 / 2, 96 * 2**30) and p.hbm_bytes == chip.hbm_bytes
    assert p.step_s >= p.compute_s > 0 and p.comm_s > 0


def test_sequence_parallelism_reduce_scatters_over_tensor():
    # Megatron SP on the TPU compiler: each row-parallel output reduce-scattered along the sequence over tensor (the
    # TP step all-reduces it); what the layers save, split tensor ways, is tests/predict/test_remat.py's
    args = {"model": SMALL + ",qk_norm=true", "target": "tpu:v5e:2x2", "mesh": "fsdp=2,tensor=2", "seq": 512}
    tp = read_step(Predict(**args, batch_per_device=4, remat="minimal"))
    sp = read_step(Predict(**args, batch_per_device=4, remat="minimal", sequence_parallel=True))

    def over_tensor(reading):
        found, _ = parse_collectives(reading.compiled.hlo, (1, 1, 2, 1, 2))
        return {c.kind for c in found if c.axes == ("tensor",) and "transpose" not in (c.op_name or "")}

    assert "reduce-scatter" in over_tensor(sp) and "reduce-scatter" not in over_tensor(tp)
    assert "all-gather" in over_tensor(sp) and "all-reduce" in over_tensor(tp)


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_line(capsys):
    moe = "layers=2,d_model=256,heads=4,d_ff=512,vocab=1024,experts=6,top_k=2"
    assert main(["predict", "--model", moe, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=1,expert=4"]) == 2
    err = capsys.readouterr().err
    assert "expert=4 does not divide the model's 6 experts" in err and len(err.strip().splitlines()) == 1
    assert main(["predict", "--model", SMALL, "--target", "tpu:v5e:2x2", "--mesh", "expert=4"]) == 2
    assert "a dense model has no experts to split" in capsys.readouterr().err


def test_a_model_too_big_for_the_chips_says_by_how_much_and_what_would_fit(capsys):
    # 1600 narrow layers (6.7 B parameters, 16 bytes each with fp32 Adam) over 4 chips of 16 GiB; narrow, so that
    # the two- and four-layer compiles it is extrapolated from are quick
    big = "layers=1600,d_model=512,heads=4,d_ff=2048,vocab=1024,mlp=swiglu"
    args = ["predict", "--model", big, "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4", "--seq", "128"]
    assert main([*args, "--layers-compiled", "2", "--batch-per-device", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["over_by_bytes"] == out["memory_bytes"] - out["hbm_bytes"] > 0
    assert f"does not fit by {out['over_by_bytes'] / 2**30:.2f} GiB per chip" in out["advice"]
    assert "--batch-per-device 1" in out["advice"] and "tensor" in out["advice"] and "more chips" in out["advice"]


def test_a_step_too_big_to_compile_whole_is_read_from_two_layers(monkeypatch):
    from lab.predict import command
    from lab.predict.step import DoesNotFit

    real, asked = command._compile, []

    def refuse_the_whole_depth(model, layers, *args):
        asked.append(layers)
        if layers == model.layers:
            raise DoesNotFit("RESOURCE_EXHAUSTED: the whole depth")
        return real(model, layers, *args)

    monkeypatch.setattr(command, "_compile", refuse_the_whole_depth)
    deep = SMALL.replace("layers=2", "layers=12")
    p = run_prediction(Predict(model=deep, target="tpu:v5e:2x2", mesh="fsdp=4", seq=128))
    # two layers, not one: XLA compiles a one-layer scan without its loop (`compiled_layers_for`)
    assert asked == [12, 2] and p.layers_compiled == 2 and p.layers == 12 and p.step_s > 0


def test_two_layers_read_at_six_predict_what_six_compiled_do(monkeypatch):
    # the step and its memory, from one compile of 2 layers, against the 6 compiled whole (lab.predict.depth: three
    # times the layers it compiled, as for 80 layers read from 2, without libtpu compiling twelve: 15 s against 7.5);
    # the loss's chunk loop runs 2 trips too (chunks of 512 of 1024 tokens: libtpu's compile time grows with the
    # tokens, so the loop is made short rather than the sequence long), and batch 2 makes a carried activation of
    # leading dimension 2: neither may be taken for the layers
    from lab.predict import step

    monkeypatch.setattr(step, "chunked_next_token_loss", partial(step.chunked_next_token_loss, chunk=512))
    deep = SMALL.replace("layers=2", "layers=6")
    args = {"model": deep, "target": "tpu:v5e:2x2", "mesh": "fsdp=4", "seq": 1024, "batch_per_device": 2}
    whole = run_prediction(Predict(**args))
    read = run_prediction(Predict(**args, layers_compiled=2))
    assert whole.layers_compiled == 6 and read.layers_compiled == 2
    assert read.step_s == pytest.approx(whole.step_s, rel=0.03)
    assert read.memory_bytes == pytest.approx(whole.memory_bytes, rel=0.15)
    # the runs of a layer's ops are read at 6 layers: the hardware FLOPs of the step match
    assert read.hardware_flops_per_step == pytest.approx(whole.hardware_flops_per_step, rel=0.01)


def test_a_mixed_moe_stack_is_read_deeper_by_its_periods_with_its_dense_prefix_compiled_whole(monkeypatch):
    # DeepSeek-V3's and Llama 4's stacks in small: latent attention, one dense layer first (its own scan, outside the
    # layers' loop), then periods of a dense and an MoE layer with a shared expert; 2 periods read as 4 against 4
    from lab.predict import step

    monkeypatch.setattr(step, "chunked_next_token_loss", partial(step.chunked_next_token_loss, chunk=256))
    mixed = (
        "layers=9,d_model=256,heads=4,head_dim=64,d_ff=128,vocab=1024,mlp=swiglu,experts=4,top_k=2,shared_experts=1,"
        "dense_layers=1,moe_every=2,d_ff_dense=512,kv_rank=128,q_rank=96,rope_dim=32"
    )
    args = {"model": mixed, "target": "tpu:v5e:2x2", "mesh": "fsdp=2,expert=2", "seq": 512, "attention": "xla"}
    whole = run_prediction(Predict(**args))
    read = run_prediction(Predict(**args, layers_compiled=2))
    assert (whole.layers_compiled, read.layers_compiled, read.layers) == (9, 5, 9)  # 1 + 2 x 2 layers compiled
    assert read.step_s == pytest.approx(whole.step_s, rel=0.03)
    assert read.hardware_flops_per_step == pytest.approx(whole.hardware_flops_per_step, rel=0.01)
    assert (
        read.model_flops_per_step
        == whole.model_flops_per_step
        == model_flops(replace(parse_model(mixed), seq=512), 4 * 512)
    )


def test_a_pipeline_is_read_deeper_by_the_layers_each_stage_runs_inside_its_ticks():
    # stage=2: each stage's 3 of 6 layers compiled are a loop inside the pipeline's loop over its 2 ticks, read as the
    # 6 of 12 compiled whole; 2 per stage would share their leading dimension with the ticks' buffers: refused
    deep = SMALL.replace("layers=2", "layers=12")
    args = {"model": deep, "target": "tpu:v5e:2x2", "mesh": "stage=2,fsdp=2", "seq": 512}
    whole = run_prediction(Predict(**args))
    read = run_prediction(Predict(**args, layers_compiled=6))
    assert (whole.layers_compiled, read.layers_compiled, read.layers) == (12, 6, 12)
    assert read.hardware_flops_per_step == pytest.approx(whole.hardware_flops_per_step, rel=1e-6)
    # what the ticks' loop stacks per tick (each stage's saved layer stack) is not grown: 5% low on this 3 ms step,
    # 2% on a 24-layer one of width 1024 read from 6 (lab.predict.depth)
    assert read.step_s == pytest.approx(whole.step_s, rel=0.07)
    assert read.memory_bytes == pytest.approx(whole.memory_bytes, rel=0.1)
    with pytest.raises(
        LabError, match=r"--layers-compiled 4 with stage=2: .* not 2 \(the pipeline.s ticks.*\); give 6"
    ):
        read_step(Predict(**args, layers_compiled=4))


def test_a_step_whose_saved_layer_inputs_exceed_hbm_is_read_from_two_layers_without_trying_the_whole():
    # 80000 layers x 1 sequence x 512 tokens x 256 x 2 B = 19.5 GiB of saved inputs per chip against 16: libtpu
    # would refuse the whole program after compiling most of it, so lab predict goes straight to two layers (narrow
    # and deep rather than wide: the two layers it compiles are the small model's)
    from lab.predict import command

    deep = SMALL.replace("layers=2", "layers=80000")
    cmd = Predict(model=deep, target="tpu:v5e:2x2", mesh="fsdp=4", seq=512, batch_per_device=1)
    p = run_prediction(cmd)
    assert command._saved_inputs_bytes(parse_model(deep), cmd) > p.hbm_bytes
    assert p.layers_compiled == 2 and p.layers == 80000 and not p.fits


# --- GPU clusters (XLA:GPU compile-only, the CUDA plugin) --------------------------------------------------------


def test_a_small_step_on_two_h100_nodes_puts_fsdp_on_nvlink_and_data_on_infiniband(capsys):
    argv = ["predict", "--model", SMALL, "--target", "gpu:h100:2x8", "--mesh", "data=2,fsdp=8", "--seq", "256"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chips"] == 16 and out["attention"] == "xla" and out["step_s"] > out["compute_s"] > 0
    links = out["exposed_by_link"]
    assert any(k.startswith("fsdp on NVLink within one node") for k in links)  # the gather inside each node
    assert any(k.startswith("data on InfiniBand across 2 nodes") for k in links)  # the gradients across them
    # H100 has its own calibration run (results/gpu_predictions); XLA's attention and a flash kernel both priced
    h100 = calibration.MATMUL_EFFICIENCY["h100"]
    assert out["calibrated"] and out["calibrated_on"] == "h100" and out["efficiency"]["matmul"] == h100
    model = replace(parse_model(SMALL), seq=256)
    assert out["attention_flash_s"] == pytest.approx(flash_seconds(model, 1, "full", H100.peak_bf16_flops, h100))
    assert 0 < out["attention_xla_s"] < out["compute_s"]
    # XLA:GPU's own estimate of the same ops beside the lab's (lab.predict.xla_estimate)
    assert out["xla_compute_s"] > 0 and out["xla_comm_s"] > 0
    assert any(o["xla_seconds"] for o in out["top_ops"])
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "step with flash" in shown and "XLA's own" in shown


def test_the_ops_a_flash_kernel_replaces_are_the_attention_scores_not_a_width_the_size_of_the_sequence():
    """XLA's grouped-query scores [b, g, r, S, T], laid out as its fusions like, are found whole (both dots on them in
    every pass, the softmax between); the projections and the MLP are not, though the model's width, 256, is the
    sequence's length: their [b, S, D] arrays also have two dimensions of 256 (read from each op's JAX metadata)."""
    from experiments.kit import in_fresh_process
    from tests.predict.gqa_scores import score_ops_of_a_gqa_step

    found, scores, mixes, elsewhere = in_fresh_process(score_ops_of_a_gqa_step)
    assert len(scores) >= 3 and len(mixes) >= 3  # forward, the recompute, and the backward's gradients
    assert scores | mixes <= found
    assert elsewhere and not found & elsewhere


def test_other_gpus_borrow_the_h100_constant_and_say_so(capsys):
    # every GPU without a run borrows through the same lookup; one of them (compiled) shows the user that it does
    assert {calibration.source_chip(chip) for chip in ("h200", "b200")} == {"h100"}
    assert not calibration.calibrated("h200") and not calibration.calibrated("b200")
    argv = ["predict", "--model", SMALL, "--target", "gpu:b200:1x8", "--mesh", "fsdp=8", "--seq", "256"]
    assert main(argv) == 0
    assert "(h100's: this chip has no calibration run)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--attention", "flash"], "--attention flash is the Pallas TPU kernel"),
        (["--slices", "2"], "--slices 2: a GPU cluster's nodes are in its target"),
        (["--libtpu-flags", "--xla_tpu_enable_async_collective_fusion=true"], "a GPU target takes --xla-flags"),
        (["--model", f"{SMALL},experts=4,capacity=dropless"], "capacity=dropless compiles megablox's grouped matmul"),
    ],
)
def test_tpu_only_options_on_a_gpu_target_are_one_line_and_exit_2(extra, words, capsys):
    assert main(["predict", "--model", SMALL, "--target", "gpu:h100:1x8", "--seq", "256", *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_xla_flags_on_a_tpu_target_are_one_line_and_exit_2(capsys):
    assert main(["predict", "--model", SMALL, *LAYERS_2, "--xla-flags", "--xla_dump_to=/tmp/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a TPU target takes its flags as --libtpu-flags" in err


def test_xla_flags_reach_the_gpu_compiler(tmp_path):
    """A flag with a visible effect (XLA dumps what it compiles where --xla_dump_to says) set through --xla-flags,
    in a fresh process as a user runs it: XLA reads its flags once, when the plugin starts."""
    dump = tmp_path / "dump"
    argv = ["predict", "--model", SMALL, "--target", "gpu:h100:1x2", "--mesh", "fsdp=2", "--seq", "256"]
    assert run_lab_json([*argv, "--xla-flags", f"--xla_dump_to={dump}"])["step_s"] > 0
    assert any(p.name.endswith(".txt") for p in dump.iterdir()), "XLA wrote no dump: the flag did not reach it"


def test_flash_seconds_counts_flashattention2_flops_over_the_causal_tiles():
    model = replace(parse_model(SMALL), seq=256)  # 2 layers, 4 heads of 64; 2 query blocks of 128: 3 of 4 tiles
    flops = 2 * 14 * 3 * 4 * 256 * 256 * 64 * 3 / 4  # batch 3
    assert flash_seconds(model, 3, "minimal_flash", 1e15, 0.5) == pytest.approx(flops / 5e14)  # its output kept
    for remat in ("minimal", "full"):  # the kernel's output is no weight matmul's: its forward runs again
        assert flash_seconds(model, 3, remat, 1e15, 0.5) == pytest.approx(flops * 18 / 14 / 5e14)


def test_flash_seconds_of_a_windowed_stack_counts_only_the_tiles_its_window_reaches():
    """GPT-OSS's pattern: windowed, global, windowed, global; a window of 129 reaches its own block and 1 before."""
    model = replace(parse_model(SMALL), layers=4, seq=1024, window=129, global_every=2)  # 8 query blocks of 128
    windowed, whole = 1 + 2 * 7, 8 * 9 // 2  # live tiles of one layer: min(i + 1, 2) and i + 1 summed over 8 rows
    tile = 14 * 4 * 1024 * 1024 * 64 / 64  # batch 1, 4 heads of 64, a 64th of the grid
    assert flash_seconds(model, 1, "none", 1e15, 0.5) == pytest.approx(tile * 2 * (windowed + whole) / 5e14)
    unwindowed = replace(model, window=0, global_every=0)
    assert flash_seconds(unwindowed, 1, "none", 1e15, 0.5) == pytest.approx(tile * 4 * whole / 5e14)


def test_the_efficiency_solved_against_an_adjusted_step_matches_it():
    """The GPU calibration solves for the step with XLA's attention replaced (`step_s`), not the compiled one."""

    class Read:  # a step of 2 s of matmuls at e = 1 and 0.1 s of memory-bound work
        def predict(self, efficiency):
            return SimpleNamespace(step_s=2 / efficiency.matmul + 0.1)

    assert solve_matmul_efficiency(Read(), 4.1) == pytest.approx(0.5, abs=1e-6)
    minus_one = solve_matmul_efficiency(Read(), 4.1, step_s=lambda p, e: p.step_s - 1)  # 2/e + 0.1 - 1 = 4.1
    assert minus_one == pytest.approx(2 / 5, abs=1e-6)


def test_a_quantized_step_prices_its_dots_at_the_int8_peak_and_the_attention_kernel_at_bf16():
    reading = read_step(Predict(model=SMALL, target="tpu:v5e:2x2", mesh="fsdp=4", seq=256))
    efficiency = calibration.efficiency("v5e")
    bf16, int8 = (reading.read.predict(efficiency, precision) for precision in ("bf16", "int8"))
    kernels = {
        (computation, i.name)
        for computation, instructions in reading.read.schedule.computations.items()
        for i in instructions
        if i.opcode == "custom-call"
    }
    at_bf16 = {(o.computation, o.name): o for o in bf16.ops}
    priced = [(o, at_bf16[(o.computation, o.name)]) for o in int8.ops if o.flops]
    assert {(o.computation, o.name) for o, _ in priced} & kernels, "the flash kernels are priced ops"
    for quantized, whole in priced:
        ratio = 1 if (quantized.computation, quantized.name) in kernels else profile("v5e").peak_int8_ops / 1.97e14
        assert quantized.seconds_compute == pytest.approx(whole.seconds_compute / ratio, rel=1e-9)
        assert quantized.seconds_memory == whole.seconds_memory
    assert int8.compute_s < bf16.compute_s and int8.matmul_flops == bf16.matmul_flops
    p = price(replace(reading, command=replace(reading.command, matmul_precision="int8")))
    assert p.matmul_precision == "int8" and p.compute_s == pytest.approx(int8.compute_s)


def test_the_splash_kernels_flops_are_read_from_their_block_tables_as_the_closed_form_counts():
    """A windowed layer and a global one with sinks: the splash kernel computes the blocks its mask's table lists,
    2 of 4 per row for a 128-token window in blocks of 512, the causal 5 of 8 for the global layer."""
    from lab.plan.closed_form import _core_flops, layer_kinds

    spec = f"{SMALL},experts=4,top_k=2,biases=true,sinks=true,window=128,global_every=2"
    reading = read_step(Predict(model=spec, target="tpu:v5e:2x2", mesh="fsdp=4", seq=2048))
    kernels = [o for o in reading.read.predict(calibration.efficiency("v5e")).ops if o.name.startswith("splash")]
    scores = 4 * 2048 * 2048 * 64  # h · S · T · K of one sequence (a device's)
    # remat full: each layer's forward twice (4 units each), dq (6) and dkv (8) once: 22 units
    expected = 22 * scores * (2 / 4 + 5 / 8)
    assert sum(o.flops * o.runs for o in kernels) == pytest.approx(expected, rel=1e-9)
    model = replace(parse_model(spec), seq=2048, attention="flash")
    closed = sum(_core_flops(kind, 1) * n for n, kind in layer_kinds(model)) * 2048  # forward, per sequence
    assert closed == pytest.approx(4 * scores * (2 / 4 + 5 / 8), rel=1e-9)


@pytest.mark.parametrize(
    ("target", "more"),
    [("tpu:v5p:4x4x4", "a larger topology or more slices"), ("gpu:h100:2x8", "more nodes: gpu:<chip>:<nodes>x<gpus>")],
)
def test_advice_for_a_step_that_does_not_fit_names_the_targets_way_to_more_chips(target, more):
    from lab.predict.command import _advice

    advice = _advice(2**30, Predict(target=target), SimpleNamespace(shape={"tensor": 4}))
    assert advice == f"does not fit by 1.00 GiB per chip; try more chips on fsdp ({more})"
