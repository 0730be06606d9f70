"""Targets: parsing, emulated CPU devices, compile-only TPU topologies."""

import pytest

from lab.errors import LabError
from lab.targets.devices import Target, devices_for, one_slice, parse_target, topology_devices
from tests.conftest import run_python


@pytest.mark.parametrize(
    "text, target",
    [
        ("cpu:8", Target("cpu", 8)),
        ("gpu", Target("gpu")),
        ("tpu", Target("tpu")),
        ("tpu:v5e:4x4", Target("tpu", topology="v5e:4x4")),
        ("tpu:v5p:8x8x16 slices=2", Target("tpu", topology="v5p:8x8x16", slices=2)),
    ],
)
def test_parse_round_trips(text, target):
    assert parse_target(text) == target
    assert str(target) == text


@pytest.mark.parametrize(
    "text, words",
    [
        ("cpu:0", "positive integer"),
        ("cpu:x", "positive integer"),
        ("tpu:v5e:4x4 slices=0", "slices must be"),
        ("tpuv5", "unknown target"),
    ],
)
def test_bad_targets_say_what_is_wrong(text, words):
    with pytest.raises(LabError, match=words):
        parse_target(text)


def test_compile_only_property():
    assert parse_target("tpu:v5e:2x2").compile_only and parse_target("tpu:v5e:2x2").generation == "v5e"
    assert not parse_target("cpu:8").compile_only


def test_cpu_target_gives_the_emulated_devices(devices):
    assert len(devices_for("cpu:8")) == 8


def test_another_count_after_jax_started_is_an_error(devices):
    with pytest.raises(LabError, match="already started with 8 CPU devices"):
        devices_for("cpu:4")


def test_a_fresh_process_gets_the_count_it_asks_for():
    done = run_python(
        """
        from lab.targets.devices import devices_for
        print(len(devices_for("cpu:3")))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


def test_topology_devices_are_compile_only_tpus_and_quiet(capfd):
    chips = topology_devices("v5e:2x2")
    assert len(chips) == 4 and chips[0].platform == "tpu"
    assert "TPU_ACCELERATOR_TYPE" not in capfd.readouterr().err


def test_multislice_topology_has_slice_indices():
    chips = topology_devices("v5e:2x2", 2)
    assert len(chips) == 8 and {c.slice_index for c in chips} == {0, 1}


def test_unknown_topology_is_a_lab_error():
    with pytest.raises(LabError, match="does not know topology"):
        topology_devices("v5e:banana")


@pytest.mark.parametrize(
    "text, cluster", [("gpu:h100:4x8", "h100:4x8"), ("gpu:h200:32x8", "h200:32x8"), ("gpu:b200:32x8", "b200:32x8")]
)
def test_gpu_cluster_targets_are_compile_only(text, cluster):
    target = parse_target(text)
    assert target == Target("gpu", topology=cluster) and str(target) == text
    assert target.compile_only and target.generation is None  # not a TPU generation
    assert not parse_target("gpu").compile_only


@pytest.mark.parametrize("text", ["gpu:a100:1x8", "gpu:h100:4x9", "gpu:h100:4x"])
def test_bad_gpu_cluster_targets_say_what_is_wrong(text):
    with pytest.raises(LabError, match=r"target|GPU"):
        parse_target(text)


def test_a_target_written_with_its_slices_is_one_slice_and_the_count_for_predict_and_plan():
    one = parse_target("tpu:v5e:4x4")
    assert one_slice(parse_target("tpu:v5e:4x4 slices=2"), 1) == (one, 2)
    assert one_slice(parse_target("tpu:v5e:4x4 slices=2"), 2) == (one, 2)  # both given, agreeing
    assert one_slice(one, 3) == (one, 3)
    with pytest.raises(LabError, match="give two slice counts"):
        one_slice(parse_target("tpu:v5e:4x4 slices=2"), 3)


def test_flags_given_after_libtpu_started_are_refused_in_one_line():
    done = run_python(
        """
        from lab.errors import LabError
        from lab.targets import libtpu
        from lab.targets.devices import topology_devices
        libtpu.prepare("")
        libtpu.prepare("")  # before libtpu starts, flags may be added as often as asked
        topology_devices("v5e:2x2")
        libtpu.prepare("")  # the same flags again: nothing to add
        try:
            libtpu.prepare("--xla_tpu_enable_async_collective_fusion=true")
        except LabError as err:
            print(err)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "libtpu already started in this process without --xla_tpu_enable_async_collective_fusion" in done.stdout
