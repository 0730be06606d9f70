"""`lab train`: every layout's loss curve matches the 1-device control; resume continues the same trajectory."""

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from lab.cli import main
from lab.errors import LabError
from lab.model import preset
from lab.training.metrics_log import StepMetrics
from lab.training.page import result
from lab.training.run import RunConfig, flops_per_token, run, synthetic_batch

pytestmark = pytest.mark.long  # runs, resumes and profiles a dozen training runs (40 s): scheduled first

STEPS = 4
PARITY_RTOL = 1e-5  # fp32: the layouts sum the same numbers in another order


@pytest.fixture(scope="module")
def control(devices, tmp_path_factory):
    """The 1-device run of the same global batch: the reference every layout is held to."""
    folder = tmp_path_factory.mktemp("control")
    return run(RunConfig(mesh="data=1", steps=STEPS, global_batch=8, results=folder), devices[:1])


@pytest.fixture(scope="module")
def layout(devices, tmp_path_factory):
    """data=2,fsdp=2,tensor=2 on 8 devices, saving asynchronously every 2 steps."""
    folder = tmp_path_factory.mktemp("layout")
    config = RunConfig(
        mesh="data=2,fsdp=2,tensor=2",
        steps=STEPS,
        global_batch=8,
        results=folder,
        checkpoint_dir=folder / "checkpoints",
        checkpoint_every=2,
        async_checkpoint=True,
    )
    return run(config, devices)


def test_data_is_a_function_of_seed_and_step_only():
    first = synthetic_batch(256, 4, 9, seed=1, step=3)
    np.testing.assert_array_equal(first, synthetic_batch(256, 4, 9, seed=1, step=3))
    assert not np.array_equal(first, synthetic_batch(256, 4, 9, seed=1, step=4))
    stride = (first[:, 1] - first[:, 0]) % 256
    np.testing.assert_array_equal((first[:, 1:] - first[:, :-1]) % 256, np.repeat(stride[:, None], 8, axis=1))


def test_flops_per_token_is_six_psi_plus_attention():
    model = preset("tiny")
    assert flops_per_token(model) == 6 * model.parameters + 12 * 2 * 4 * 16 * 32


def test_layout_matches_the_one_device_control(control, layout):
    np.testing.assert_allclose(layout.losses, control.losses, rtol=PARITY_RTOL)
    assert control.losses[-1] < control.losses[0]  # it learns, so the comparison covers real updates


def test_log_has_one_line_per_step_with_metrics(layout):
    lines = [json.loads(line) for line in (layout.config.results / "train.metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    assert [line["checkpoint"] for line in lines] == [False, True, False, True]
    assert all(line["tokens_per_s"] > 0 and line["mfu"] > 0 and line["grad_norm"] > 0 for line in lines)
    assert all(0 <= line["data_s"] < line["seconds"] and 0 <= line["save_s"] < line["seconds"] for line in lines)
    assert [line["loss"] for line in lines] == layout.losses


def test_resume_on_another_mesh_continues_the_same_trajectory(devices, control, layout, tmp_path):
    """Keep only the step-2 checkpoint of the 8-device run (as if it crashed after it) and resume on 1 device."""
    saved = tmp_path / "checkpoints"
    shutil.copytree(layout.config.checkpoint_dir / "2", saved / "2")
    resumed = run(
        RunConfig(mesh="data=1", steps=STEPS, global_batch=8, results=tmp_path, checkpoint_dir=saved, resume=True),
        devices[:1],
    )
    assert resumed.start_step == 2 and [s.step for s in resumed.steps] == [2, 3]
    np.testing.assert_allclose(resumed.losses, control.losses[2:], rtol=PARITY_RTOL)


def test_a_slow_loader_shows_as_waiting_for_data_and_the_profile_names_the_parts_of_the_step(devices, tmp_path):
    """One run, two instruments: the loop's own clock (data_s) and the jax.profiler trace (device time by scope)."""
    config = RunConfig(
        mesh="fsdp=4", steps=3, global_batch=8, results=tmp_path, input_ms=30, profile=tmp_path / "trace"
    )
    log = run(config, devices[:4])
    assert all(s.data_s >= 0.03 for s in log.steps)  # the loader's sleep is inside the measured wait
    assert all(s.data_s < s.seconds and s.grad_norm > 0 and s.save_s >= 0 for s in log.steps)
    assert list((tmp_path / "trace").glob("plugins/profile/*/perfetto_trace.json.gz"))
    parts = set(log.profile)
    assert {"forward attention", "backward attention", "forward mlp", "backward mlp", "optimizer"} <= parts
    assert any(part.startswith("communication: ") for part in parts)  # fsdp=4 gathers weights
    table = result(log).tables[-1]
    assert table.title.startswith("device time by part of the step") and sum(
        row[2] for row in table.rows
    ) == pytest.approx(1.0)


def test_page_has_loss_and_step_time_plots(layout):
    page = result(layout)
    assert set(page.plots) == {"loss", "step_time"}
    assert len(page.tables[0].rows) == STEPS and page.observations["steps"][0]["loss"] == layout.losses[0]


@pytest.mark.parametrize(
    "config, message",
    [
        (RunConfig(steps=0), "at least 1"),
        (RunConfig(resume=True), "--resume needs --checkpoint-dir"),
        (RunConfig(mesh="data=2,fsdp=2,tensor=2", global_batch=6), "not divisible"),
        (RunConfig(strategy="zero9"), "unknown strategy"),
        (RunConfig(prefetch=-1), "--prefetch -1: must be at least 0"),
        (RunConfig(input_ms=-5), "--input-ms -5: must be at least 0"),
        (RunConfig(profile=Path(__file__)), "is a file"),
        (RunConfig(name="x" * 300), "300 bytes; give at most 241"),
        (RunConfig(coordinator="localhost", num_processes=2, process_id=0), "give host:port"),
        (RunConfig(coordinator="127.0.0.1:99999", num_processes=2, process_id=0), "port 1..65535"),
    ],
)
def test_bad_input_is_one_clear_error(devices, config, message):
    with pytest.raises(LabError, match=message):
        run(config, devices)


def test_cli_reports_a_mesh_that_does_not_fit_with_exit_code_2(capsys):
    assert main(["train", "--mesh", "data=3"]) == 2
    assert "mesh data=3 uses 3 devices" in capsys.readouterr().err


def test_an_moe_run_logs_and_shows_its_expert_load(devices, tmp_path):
    log = run(RunConfig(model="tiny-moe", mesh="expert=2", steps=2, global_batch=4, results=tmp_path), devices[:2])
    assert all({"expert_load_max_over_mean", "dropped_fraction"} <= set(s.extra) for s in log.steps)
    assert all(
        s.extra["expert_load_max_over_mean"] >= 1.0 for s in log.steps
    )  # the busiest expert is at least the mean
    table = result(log).tables[0]
    assert "expert_load_max_over_mean" in table.columns


def _line(step: int) -> str:
    return json.dumps(asdict(StepMetrics(step, 1.0, 1.0, 0.1, 0.0, 0.0, 1.0, 0.1)))


def test_a_resumed_log_keeps_the_steps_up_to_the_checkpoint_and_redoes_none(tmp_path):
    from lab.training.metrics_log import logged, writer

    log = tmp_path / "metrics.jsonl"
    # the killed run logged steps 0..12 and half of 13; its last checkpoint holds 10 steps (0..9)
    log.write_text("".join(_line(k) + "\n" for k in range(13)) + _line(13)[:20])
    resumed = RunConfig(log=log, resume=True, checkpoint_dir=tmp_path)
    assert [s.step for s in logged(resumed)] == list(range(13))
    writer(resumed, [s for s in logged(resumed) if s.step < 10])
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(10))
    writer(RunConfig(log=log), [])  # a fresh run starts a fresh log
    assert log.read_text() == ""


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("[1, 2]", "is not a line lab train wrote"),
        ('{"step": 3}', "is not a line lab train wrote"),
        ("\udcff", "damaged"),
    ],
    ids=["not-an-object", "not-lab-train", "not-utf8"],
)
def test_a_damaged_log_is_refused_before_the_restore_and_the_compile(tmp_path, damage, words, monkeypatch):
    from lab.training import run as training_run

    log = tmp_path / "metrics.jsonl"
    log.write_bytes(f"{_line(0)}\n{damage}\n{_line(1)}\n".encode("utf-8", errors="surrogateescape"))
    monkeypatch.setattr(training_run, "_checkpoints", lambda config: pytest.fail("restored before the log was read"))
    with pytest.raises(LabError, match=words):
        run(RunConfig(log=log, resume=True, checkpoint_dir=tmp_path, results=tmp_path))


def test_the_log_beside_the_page_survives_it_and_a_resumed_page_shows_every_step(tmp_path, capsys):
    results, checkpoints = tmp_path / "results", tmp_path / "checkpoints"
    argv = ["train", "--mesh", "fsdp=8", "--results", str(results), "--name", "t"]
    argv += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"]
    assert main([*argv, "--steps", "3"]) == 0
    assert (results / "t" / "README.md").is_file()
    assert [json.loads(line)["step"] for line in (results / "t.metrics.jsonl").read_text().splitlines()] == [0, 1, 2]

    # lab doctor with the run's own options (as the divergence message advises) leaves its checkpoints alone
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    assert main(["doctor", *argv[1:], "--steps", "5", "--resume"]) == 0
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before

    assert main([*argv, "--steps", "5", "--resume"]) == 0
    logged = [json.loads(line)["step"] for line in (results / "t.metrics.jsonl").read_text().splitlines()]
    observed = json.loads((results / "t" / "result.json").read_text())["observations"]
    assert logged == [0, 1, 2, 3, 4]
    assert [s["step"] for s in observed["earlier_steps"]] == [0, 1, 2] and [s["step"] for s in observed["steps"]] == [
        3,
        4,
    ]


def test_a_second_run_with_the_same_results_and_name_is_refused(devices, tmp_path):
    from lab.training import lock

    held = lock.hold(tmp_path / ".t.lock", "the first run", "")
    with pytest.raises(LabError, match=r"--name 't' is in use by another run \(pid \d+\)"):
        run(RunConfig(mesh="fsdp=8", steps=1, results=tmp_path, name="t"), devices)
    held.close()


def test_a_log_path_that_is_a_link_or_a_device_is_refused(devices, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere.jsonl")
    for log, kind in ((tmp_path / "link", "is a link"), (Path("/dev/null"), "is a device or pipe")):
        with pytest.raises(LabError, match=kind):
            run(RunConfig(log=log, results=tmp_path), devices)
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_a_run_whose_loss_becomes_nan_stops_with_one_line_pointing_at_the_doctor(devices, tmp_path, monkeypatch):
    from lab.training import run as training_run

    iterate = training_run._Loop.iterate

    def diverging(self, step, state, data):  # the real step, with the loss a diverged run would report from step 2
        state, metrics = iterate(self, step, state, data)
        return state, replace(metrics, loss=float("nan")) if metrics.step >= 2 else metrics

    monkeypatch.setattr(training_run._Loop, "iterate", diverging)
    log = tmp_path / "metrics.jsonl"
    config = RunConfig(mesh="fsdp=8", steps=5, results=tmp_path, page=False, log=log)
    with pytest.raises(LabError, match=r"step 2: the loss is nan: training diverged .* run `lab doctor`"):
        run(config)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]  # logged up to the NaN
