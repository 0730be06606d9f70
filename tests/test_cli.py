"""The `lab` command: one line and exit code 2 on a mistake; real output otherwise."""

import json
import os
from pathlib import Path

import pytest

from lab.cli import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["inspect", "--mesh", "dta=2"], "unknown axis 'dta'"),
        (["inspect", "--mesh", "data=3"], "uses 3 devices but the target has 8"),
        (["inspect", "--target", "tpu:v9z:banana"], "unknown target"),
        (
            ["inspect", "--program", "ring-all-reduce", "--axes", "fsdp", "--size", "3"],
            "not a positive multiple of 4 bytes",
        ),
        (["inspect", "--hlo", "/no/such/file", "--mesh", "data=8"], "cannot read HLO file"),
        (["bench", "-b", "0"], "sizes must be positive"),
        (["report", "--only", "nope"], "unknown experiment 'nope'"),
        (["report", "--rejudge", "--stale"], "exclude each other"),
        (["report", "--only"], "--only needs experiment names"),
        (["run", "nonexistent"], "Unrecognized options: nonexistent"),
        (["bench", "--factor", "x"], "invalid literal"),
        (
            ["predict", "--batch-per-device", "0.125"],
            "--batch-per-device: invalid literal for int() with base 10: '0.125'",
        ),
        (["bench", "--ops"], "--ops is empty: name at least one"),
        (["run", "ring_allreduce", "--group-sizes", "1"], "a ring needs 2 or more devices"),
        (["predict", "--bogus", "1"], "Unrecognized options: --bogus, 1 (see lab predict --help)"),
        (["inspect", "--module", "3"], "--module goes with --dump"),
        (
            ["inspect", "--hlo", "tests/data/hlo/cpu_scan_fsdp.hlo", "--axes", "data", "--mesh", "data=8"],
            "--axes goes with the lab's own programs, not with --hlo",
        ),
    ],
)
def test_mistakes_give_one_line_and_exit_2(capsys, devices, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_lab_program_that_fails_to_compile_is_not_blamed_on_fn(capsys, devices, monkeypatch):
    from lab import cli

    def fails(*args, **kwargs):
        raise RuntimeError("XLA refused it")

    monkeypatch.setattr(cli, "compile_with_origins", fails)
    assert main(["inspect", "--program", "all-reduce", "--mesh", "data=8", "--axes", "data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lab: error: --program 'all-reduce over data': compiling it raised") and "--fn" not in err


def test_list_names_every_experiment_and_its_question(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("collectives", "ring_allreduce", "allreduce_equivalence"):
        assert name in out
    assert "#39" in out and "#40" in out


def test_inspect_prints_the_collectives_with_their_axes(capsys, devices, tmp_path):
    assert (
        main(
            [
                "inspect",
                "--program",
                "ring-all-reduce",
                "--axes",
                "fsdp",
                "--mesh",
                "fsdp=4,tensor=2",
                "--save-hlo",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "collective-permute" in out and "fsdp" in out and "memory per device" in out
    after = next(tmp_path.glob("*.after_optimizations.hlo"))
    # the dump reads back through --hlo to the same collectives
    assert main(["inspect", "--hlo", str(after), "--mesh", "fsdp=4,tensor=2", "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert [(t["kind"], t["axes"], t["collectives"]) for t in totals] == [("collective-permute", ["fsdp"], 6)]


def test_inspect_dump_with_a_device_order(capsys, tmp_path):
    text = (
        "HloModule m, num_partitions=4\n"
        "ENTRY %e (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8] parameter(0)\n"
        "  ROOT %ar = f32[8] all-reduce(%p), replica_groups={{0,2},{1,3}}, to_apply=%add\n"
        "}\n"
    )
    path = tmp_path / "dump.txt"
    path.write_text(text)

    def axes(*argv):
        assert main(["inspect", "--hlo", str(path), "--mesh", "data=2,tensor=2", "--json", *argv]) == 0
        return [c["axes"] for c in json.loads(capsys.readouterr().out)["collectives"]]

    assert axes() == [["data"]]
    # with devices 0,2,1,3 in mesh order, the groups {0,2},{1,3} are tensor neighbours
    assert axes("--device-order", "0", "2", "1", "3") == [["tensor"]]


def test_bench_prints_an_nccl_tests_table(capsys, devices):
    assert (
        main(["bench", "collectives", "-b", "1K", "-e", "2K", "-f", "2", "-n", "2", "-w", "1", "--ops", "all-reduce"])
        == 0
    )
    out = capsys.readouterr().out
    assert "busbw" in out and out.count("all-reduce") >= 2


def test_report_only_rejudge_and_stale(capsys, devices, tmp_path, monkeypatch):
    from lab.registry import get

    # a name given twice is one page, listed once
    assert main(["report", "--only", "allreduce_equivalence", "allreduce_equivalence", "--results", str(tmp_path)]) == 0
    page = tmp_path / "allreduce_equivalence"
    measured = json.loads((page / "result.json").read_text())
    assert (tmp_path / "README.md").read_text().count("(allreduce_equivalence/README.md)") == 1

    # --rejudge measures nothing: the same observations give the same checks, and the provenance is kept
    assert main(["report", "--rejudge", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 0
    rejudged = json.loads((page / "result.json").read_text())
    assert rejudged["checks"] == measured["checks"] and rejudged["provenance"] == measured["provenance"]

    # --stale: a fresh page is left alone; a page whose code hash differs is measured again
    capsys.readouterr()
    assert main(["report", "--stale", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 0
    assert "stale: none" in capsys.readouterr().out
    monkeypatch.setattr(type(get("allreduce_equivalence")), "code_hash", property(lambda self: "changed"))
    assert main(["report", "--stale", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 0
    assert "stale: allreduce_equivalence" in capsys.readouterr().out


def test_a_results_folder_it_cannot_write_is_one_line_before_measuring(capsys, tmp_path, monkeypatch):
    from lab.registry import Experiment

    def no_run(*args, **kwargs):
        raise AssertionError("measured before the results folder was checked")

    monkeypatch.setattr(Experiment, "run", no_run)
    (tmp_path / "a_file").write_text("")
    results = tmp_path / "a_file" / "results"
    assert main(["report", "--only", "allreduce_equivalence", "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "is not writable" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "damaged, words",
    [
        (b'{"observations": {"sizes": [1, 2', "is damaged (not JSON"),  # cut short
        (b"\xff\xfe{}", "is damaged (not JSON"),  # not UTF-8
        (b"[1, 2]", "a JSON list, not a page's object"),
        (b'{"observations": [1], "config": {}}', "holds no observations this experiment can read"),
    ],
)
def test_a_damaged_page_is_one_line_for_rejudge_and_measured_again_by_stale(capsys, tmp_path, damaged, words):
    page = tmp_path / "allreduce_equivalence"
    page.mkdir()
    (page / "result.json").write_bytes(damaged)
    assert main(["report", "--rejudge", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if damaged.startswith(b"[1"):  # --stale reads the page's code hash: a damaged page is one to measure again
        assert main(["report", "--stale", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 0
        assert "stale: allreduce_equivalence" in capsys.readouterr().out


def test_rejudge_without_a_measured_page_says_what_to_run(capsys, tmp_path):
    assert main(["report", "--rejudge", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 2
    assert "lab report --only allreduce_equivalence" in capsys.readouterr().err


def test_no_libtpu_noise_reaches_the_user_without_jax_platforms_set():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    for argv in (
        ["inspect", "--axes", "fsdp", "--mesh", "fsdp=4", "--target", "tpu:v5e:2x2"],
        ["inspect", "--size", "1K"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "lab", *argv], capture_output=True, text=True, timeout=300, env=env, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", done.stderr
        assert "all-" in done.stdout


def test_a_tpu_compile_leaves_no_libtpu_log_files(tmp_path):
    """libtpu's driver logs to /tmp/tpu_logs, or with TPU_LOG_DIR=disabled to $TMPDIR itself, in every process that
    starts it; the `lab` command keeps both empty (`lab.entry.libtpu_logs_off_disk`) unless the user names a
    directory. The child gets a $TMPDIR of its own, which glog falls back to, so other tests' files are not counted."""
    import os
    import subprocess
    import sys

    logs = Path("/tmp/tpu_logs")
    before = set(logs.iterdir()) if logs.exists() else set()
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_LOG_DIR", "TPU_MIN_LOG_LEVEL")}
    env["TMPDIR"] = str(tmp_path)
    argv = ["inspect", "--axes", "fsdp", "--mesh", "fsdp=4", "--target", "tpu:v5e:2x2"]
    done = subprocess.run([sys.executable, "-m", "lab", *argv], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (set(logs.iterdir()) if logs.exists() else set()) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tpu_")) == []


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("lab (sharding-lab) 0.1.0, jax 0.10")


def test_a_save_hlo_folder_that_cannot_be_made_is_one_line_with_no_report_before_it(capsys, devices):
    argv = ["inspect", "--program", "all-reduce", "--axes", "tensor", "--mesh", "fsdp=4,tensor=2"]
    assert main([*argv, "--save-hlo", "/proc/lab-hlo"]) == 2  # /proc takes no new folder, root or not
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.strip() == "lab: error: cannot write '/proc/lab-hlo': No such file or directory; choose another folder"
    )


def test_a_full_disk_mid_run_is_one_line_naming_the_path(capsys, devices, tmp_path, monkeypatch):
    import errno

    from lab import report

    def full(result, results_dir="results"):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / result.name / "README.md"))

    monkeypatch.setattr(report, "write", full)
    assert main(["report", "--only", "allreduce_equivalence", "--results", str(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lab: error")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "allreduce_equivalence" in errors[0]


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`lab --help | head -1`: the pipe closes before the help is written; no "cannot write ... free space" line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "lab", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    process.stdout.close()  # gone before the command has imported anything, let alone written
    with process.stderr:
        err = process.stderr.read()
    assert process.wait(timeout=60) == 141 and err == ""


def test_the_report_runs_timed_pages_alone_and_hands_the_untimed_ones_to_side_by_side(capsys, tmp_path, monkeypatch):
    from lab import side_by_side
    from lab.registry import Experiment, get

    names = ["allreduce_equivalence", "oracle_checks", "reduce_scatter_pairing"]  # the first one times
    assert [get(name).untimed for name in names] == [False, True, True]
    alone, beside = [], []

    def run(self, config):
        alone.append(self.name)
        return self.rejudge(Path("results") / self.name)

    def pool(chosen, target, results):
        beside.append((list(chosen), target))
        for name in chosen:
            yield get(name).rejudge(Path("results") / name), 1.0

    monkeypatch.setattr(Experiment, "run", run)
    monkeypatch.setattr(side_by_side, "run", pool)
    assert main(["report", "--only", *names, "--results", str(tmp_path)]) == 0
    assert alone == ["allreduce_equivalence"] and beside == [(names[1:], "cpu:8")]
    assert all(f"({name}/README.md)" in (tmp_path / "README.md").read_text() for name in names)
    assert "two at a time: oracle_checks, reduce_scatter_pairing" in "".join(capsys.readouterr())


def test_a_page_measured_beside_another_is_written_by_its_child_and_says_so(tmp_path):
    from lab import side_by_side
    from lab.provenance import command

    ((result, seconds),) = list(side_by_side.run(["oracle_checks"], "cpu:8", tmp_path))
    page = json.loads((tmp_path / "oracle_checks" / "result.json").read_text())
    assert page["provenance"]["beside"] == side_by_side.BESIDE and page["provenance"]["command"] == command()
    assert result.name == "oracle_checks" and result.checks and seconds > 0


def test_a_pages_compiler_flags_end_with_it_so_a_later_pages_child_processes_start_clean(monkeypatch):
    """layout_plans sets MaxText's libtpu flags in the report's environment; prediction_cost, measured after it in
    the same report, starts `lab predict` as a user types it and must not inherit them (it compiled differently:
    DeepSeek-V3's step 9.305 s against 10.189 s)."""
    from lab.cli import compiler_flags_kept

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/somewhere")
    with compiler_flags_kept():
        os.environ["LIBTPU_INIT_ARGS"] = "--xla_tpu_enable_async_collective_fusion=true"  # as libtpu.prepare sets it
        os.environ["XLA_FLAGS"] += " --xla_gpu_enable_latency_hiding_scheduler=true"
        assert "async_collective_fusion" in os.environ["LIBTPU_INIT_ARGS"]
    assert "LIBTPU_INIT_ARGS" not in os.environ
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/somewhere"
