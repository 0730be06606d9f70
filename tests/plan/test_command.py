"""`lab plan` through `lab.cli.main`: mistakes are one line and exit 2; --json keys; a small compiled re-ranking."""

import json

import numpy as np
import pytest

from lab.cli import main
from tests.conftest import run_lab_json, run_python

SMALL = "layers=2,d_model=128,heads=4,d_ff=256,vocab=512"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--target", "tpu:v5e:2x4", "--chips", "6"], "--chips 6: tpu:v5e:2x4 has 8 chips"),
        (["--target", "cpu:8"], "lab plan lays a model on tpu:<gen>:<topology>"),
        (["--global-batch", "1000", "--seq", "128"], "is not a whole number of --seq 128"),
        (
            [
                "--model",
                "layers=1,d_model=64,heads=1,d_ff=64,vocab=64",
                "--seq",
                "16",
                "--attention",
                "xla",
                "--global-batch",
                "48",
                "--target",
                "tpu:v5e:2x4",
            ],
            "no layout of 8 chips divides a batch of 3 sequences",
        ),
        (["--model", "nope"], "unknown model preset"),
        (["--seq", "100"], "--seq 100: the flash attention kernel tiles the sequence"),
    ],
)
def test_mistakes_give_one_line_and_exit_2(capsys, argv, words):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_tpu7x_plans_its_devices_and_compiles_the_best(capsys):
    """`--chips` counts TPU7x's chips (4), the layouts its devices (8); the best one compiles for those devices."""
    argv = ["plan", "--model", SMALL, "--seq", "128", "--target", "tpu:tpu7x:2x2x1", "--chips", "4"]
    assert main([*argv, "--compile-top", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert np.prod([int(part.split("=")[1]) for part in best["mesh"].split(",")]) == 8
    assert best["compiled"]["step_s"] > 0 and best["compiled"]["memory_bytes"] > 0


def test_a_model_nothing_fits_is_a_result_naming_the_least_memory_layout(capsys):
    assert main(["plan", "--model", "llama3-405b", "--target", "tpu:v5e:2x2", "--compile-top", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["candidates"] == []
    assert out["nothing_fits"].startswith("nothing fits: the least memory per chip") and "fsdp=4" in out["nothing_fits"]
    # 126 layers' saved inputs of 8192 tokens x 16384 wide exceed a v5e's 16 GiB on their own: more chips cannot help
    assert "its activations alone take" in out["nothing_fits"] and "give a shorter --seq" in out["nothing_fits"]


def test_when_more_chips_would_fit_a_model_nothing_fits_says_about_how_many(capsys):
    argv = ["plan", "--model", "llama3-405b", "--target", "gpu:h100:2x8", "--seq", "4096", "--compile-top", "0"]
    assert main([*argv, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["nothing_fits"]
    # 405.9 B parameters x 16 bytes (fp32 weights and gradients, AdamW's two moments) spread over the chips
    assert "optimizer state (5.91 TiB in all) fit spread over about" in said and "more --slices" in said
    needed = int(said.split("over about ")[1].split()[0].replace(",", ""))
    assert 5.91 * 2**40 / (74.5 * 2**30) < needed < 10_000  # more than the states alone fill, HBM-full


def test_json_has_the_plan_keys_and_a_small_compiled_reranking(capsys, tmp_path):
    argv = [
        "plan",
        "--model",
        SMALL,
        "--seq",
        "128",
        "--target",
        "tpu:v5e:2x4",
        "--compile-top",
        "2",
        "--json",
        "--plot",
        str(tmp_path / "plan.png"),
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"enumerated", "ranked_s", "rank_correlation", "candidates"} <= set(out)
    assert out["enumerated"] >= len(out["candidates"]) > 2
    first = out["candidates"][0]
    assert {"mesh", "slices_axis", "remat", "micro_batches", "step_s", "mfu", "memory_bytes", "compiled"} <= set(first)
    compiled = [c for c in out["candidates"] if c["compiled"]]
    assert len(compiled) == 2 and compiled == out["candidates"][:2]  # re-ranked first, by the compiled step
    assert compiled[0]["compiled"]["step_s"] <= compiled[1]["compiled"]["step_s"]
    assert compiled[0]["compiled"]["memory_bytes"] > 0
    assert (tmp_path / "plan.png").stat().st_size > 0


@pytest.mark.parametrize(
    "target, devices", [("tpu:v5e:2x2", 4), ("tpu:v5p:2x2x1", 4), ("tpu:v6e:2x2", 4), ("tpu:tpu7x:2x2x1", 8)]
)
@pytest.mark.parametrize("slices", [1, 2])
def test_every_generation_plans_one_slice_and_several(capsys, target, devices, slices):
    """Every device is laid out: TPU7x's 4 chips are 8 devices (two chiplets a chip), as lab predict counts them."""
    argv = ["plan", "--model", SMALL, "--seq", "128", "--target", target, "--slices", str(slices)]
    assert main([*argv, "--compile-top", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["candidates"]
    chips = devices * slices
    for c in out["candidates"]:
        sizes = [int(part.split("=")[1]) for part in c["mesh"].split(",")]
        assert np.prod(sizes) == chips and c["step_s"] > 0 and 0 < c["mfu"] < 1
        assert (c["slices_axis"] is None) == (slices == 1)


@pytest.mark.parametrize(
    "name, words",
    [
        ("plan.txt", "give a file name ending in an image format matplotlib writes"),
        ("plan", "give a file name ending in an image format"),  # matplotlib would write plan.png beside it
        ("folder", "is a folder; give a file name"),
    ],
)
def test_a_plot_name_matplotlib_cannot_write_is_one_line_before_the_plan(capsys, tmp_path, monkeypatch, name, words):
    from lab.plan import command

    (tmp_path / "folder").mkdir()

    def no_plan(*args, **kwargs):
        raise AssertionError("planned before the plot's name was checked")

    monkeypatch.setattr(command, "make_plan", no_plan)
    assert main(["plan", "--model", SMALL, "--seq", "128", "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # nothing written


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--target", "gpu:h100:2x8", "--slices", "2"], "--slices 2: a GPU cluster's nodes are in its target"),
        (["--target", "gpu:a100:1x8"], "unknown GPU 'a100'"),
        (["--target", "gpu:h100:1x16"], "at most 8 GPUs"),
        (["--target", "gpu:h100:1x8", "--attention", "flash"], "--attention flash is the Pallas TPU kernel"),
    ],
)
def test_gpu_mistakes_give_one_line_and_exit_2(capsys, argv, words):
    assert main(["plan", "--model", SMALL, "--seq", "128", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("target, chips", [("gpu:h100:1x8", 8), ("gpu:b200:2x4", 8), ("gpu:h200:4x8", 32)])
def test_gpu_clusters_plan_with_nodes_as_slices(capsys, target, chips):
    assert main(["plan", "--model", SMALL, "--seq", "128", "--target", target, "--compile-top", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["candidates"]
    nodes = int(target.split(":")[2].split("x")[0])
    for c in out["candidates"]:
        assert np.prod([int(part.split("=")[1]) for part in c["mesh"].split(",")]) == chips
        assert (c["slices_axis"] is None) == (nodes == 1)


def test_on_gpu_the_axis_across_nodes_is_priced_on_infiniband_and_compiled_there(capsys):
    from lab.mesh import MeshSpec
    from lab.plan.closed_form import estimate
    from lab.plan.command import Plan, problem_of
    from lab.plan.compiled import compile_layout
    from lab.plan.space import Layout

    problem = problem_of(Plan(model=SMALL, seq=128, target="gpu:h100:2x4"))
    assert (problem.topology, problem.slices, problem.model.attention) == ("h100:1x4", 2, "xla")
    layout = Layout(MeshSpec(fsdp=8), "fsdp", "full")
    links = {a.axis: a.link for a in estimate(problem, layout).axes}
    assert "InfiniBand x2" in links["fsdp"] and "nvlink" in links["fsdp"].lower()
    compiled = compile_layout(problem, layout)
    assert not isinstance(compiled, str) and compiled.step_s > 0 and compiled.memory_bytes > 0
    assert compiled.axes["fsdp"]["bytes"] > 0


@pytest.mark.parametrize("target, slices", [("gpu:h100:4x4", 1), ("tpu:v5e:2x4", 4)])
def test_the_closed_form_prices_a_collective_across_nodes_or_slices_as_the_compiled_program_places_it(target, slices):
    """On GPU the NVLink and InfiniBand tiers of NCCL's hierarchical ring are pipelined (the slower bounds it), on
    TPU the ICI and DCN tiers run in turn: the closed form builds its link from one node's placement and the node
    count, the compiled side places the collective over the whole cluster's mesh; both price it alike."""
    from lab.mesh import MeshSpec
    from lab.plan.closed_form import _links, _seconds
    from lab.plan.command import Plan, problem_of
    from lab.plan.space import Layout
    from lab.predict.priced import build_mesh
    from lab.targets.devices import pod_devices
    from lab.targets.topology import placement, predict

    problem = problem_of(Plan(model=SMALL, seq=128, target=target, slices=slices))
    chips = problem.chips
    layout = Layout(MeshSpec(fsdp=chips), "fsdp", "full")
    link = _links(problem, layout)["fsdp"]
    mesh = build_mesh(
        f"fsdp={chips // problem.slices}", pod_devices(problem.topology, problem.slices), problem.slices, "fsdp"
    )
    where = placement(mesh, ("fsdp",), problem.chip)
    assert where.nodes == problem.slices > 1
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        size = 2.0**30
        assert _seconds(kind, size, link) == pytest.approx(predict(kind, size, where, problem.chip).seconds, rel=1e-9)


def test_on_gpu_a_step_over_the_schedulers_memory_limit_waits_for_every_collective_as_xla_schedules_it():
    """XLA:GPU's latency-hiding scheduler overlaps collectives only within its memory limit: Llama 3 70B on 32 H100
    nodes under remat minimal (70 of 75 GiB) is scheduled for memory and waits for every FSDP collective, under
    remat full (26 GiB) it hides them; the closed form says the same before compiling."""
    from lab.mesh import MeshSpec
    from lab.plan.closed_form import estimate
    from lab.plan.command import Plan, problem_of
    from lab.plan.compiled import compile_layout
    from lab.plan.space import Layout

    problem = problem_of(Plan(model="llama3-70b", seq=4096, target="gpu:h100:32x8"))
    for remat, waits in (("minimal", True), ("full", False)):
        layout = Layout(MeshSpec(fsdp=256), "fsdp", remat)
        closed = {a.axis: a for a in estimate(problem, layout).axes}["fsdp"]
        compiled = compile_layout(problem, layout).axes["fsdp"]
        assert (closed.exposed_s == pytest.approx(closed.seconds)) is waits
        assert (compiled["exposed_s"] > 0.9 * compiled["seconds"]) is waits


_OVERLAP_PROBE = """
    import json
    from dataclasses import replace
    from lab.mesh import MeshSpec
    from lab.plan.closed_form import estimate
    from lab.plan.command import Plan, problem_of
    from lab.plan.compiled import compile_layout
    from lab.plan.overlap import overlaps
    from lab.plan.space import Layout
    from lab.targets import libtpu

    libtpu.prepare({flags!r})
    for generation in {generations!r}:
        torus = "2x2x1" if generation == "tpu7x" else "2x4"
        problem = problem_of(Plan(model="layers=2,d_model=512,heads=8,d_ff=2048,vocab=512", seq=512,
                                  target=f"tpu:{{generation}}:{{torus}}"))
        problem = replace(problem, overlap=overlaps(generation))
        layout = Layout(MeshSpec(data=2, fsdp=4), None, "full")
        closed = {{a.axis: a for a in estimate(problem, layout).axes}}["fsdp"]
        compiled = compile_layout(problem, layout).axes["fsdp"]
        print(json.dumps([generation, [problem.overlap.gathers, problem.overlap.scatters],
                          closed.exposed_s / closed.seconds, compiled["exposed_s"] / compiled["seconds"]]))
"""


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("", {"v5e": [True, False], "v6e": [False, False], "tpu7x": [True, True]}),
        ("CF_FOR_ALL_GATHER", {"v6e": [True, False]}),
    ],
)
def test_on_tpu_the_closed_form_hides_what_libtpu_runs_asynchronously_and_nothing_else(flags, expected):
    """libtpu's defaults overlap an FSDP gather on v5e and TPU7x, not on v6e, where MaxText's collective-fusion
    flags make it asynchronous; the gradients' reduce-scatters only on TPU7x, with or without them. The probe says
    which (in a process of its own: libtpu takes its flags once); where nothing runs asynchronously the closed form
    prices every collective of a data=2, fsdp=4 layout exposed and the compiled program waits for them too; where
    something does, both hide some of it."""
    from lab.predict import calibration

    code = _OVERLAP_PROBE.format(flags=getattr(calibration, flags, ""), generations=tuple(expected))
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(expected), done.stdout
    for line in lines:
        generation, overlapped, closed_exposed, compiled_exposed = json.loads(line)
        assert overlapped == expected[generation], generation
        if any(overlapped):
            assert closed_exposed < 0.95 and compiled_exposed < 0.95, generation
        else:
            assert closed_exposed == pytest.approx(1.0) and compiled_exposed > 0.9, generation


@pytest.mark.parametrize(
    "target, option, flags, words",
    [
        ("tpu:v5e:2x4", "--libtpu-flags", "--xla_tpu_enable_async_collective_fusion=maybe", "Illegal value 'maybe'"),
        ("gpu:h100:1x8", "--xla-flags", "--xla_gpu_enable_async_all_gather=true", "unknown to this XLA"),
        ("tpu:v5e:2x4", "--xla-flags", "--xla_gpu_enable_triton_gemm=false", "a TPU target takes its flags as"),
        ("gpu:h100:1x8", "--libtpu-flags", "--xla_tpu_enable_async_collective_fusion=true", "a GPU target takes"),
    ],
)
def test_the_compilers_flags_are_checked_as_lab_predict_checks_them(capsys, target, option, flags, words):
    assert main(["plan", "--model", SMALL, "--seq", "128", "--target", target, option, flags]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_a_recipes_xla_flags_reach_the_compiled_layouts(tmp_path):
    """XLA dumps what it compiles where --xla_dump_to says, when the flag reaches it."""
    dump = tmp_path / "dump"
    argv = ["plan", "--model", SMALL, "--seq", "128", "--target", "gpu:h100:1x2", "--compile-top", "1"]
    assert run_lab_json([*argv, "--xla-flags", f"--xla_dump_to={dump}"])["candidates"]
    assert any(p.name.endswith(".txt") for p in dump.iterdir()), "XLA wrote no dump: the flag did not reach it"
