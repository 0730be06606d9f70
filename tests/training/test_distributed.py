"""Several processes through jax.distributed on loopback: 2 processes x 4 CPU devices behave as 1 x 8."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from lab.errors import LabError
from lab.targets.devices import distributed_devices
from lab.training.run import RunConfig, run

pytestmark = pytest.mark.long  # several processes, each starting JAX: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
RUN = RunConfig(target="cpu:4", mesh="data=2,fsdp=2,tensor=2", steps=4, global_batch=8, page=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(code: str, process_id: int, port: int, tmp_path: Path, log: str | None = None) -> subprocess.Popen:
    """One process of the run; its output goes to a file (`log`, default process<id>.log) so that a full pipe never
    blocks it."""
    # TMPDIR: JAX's native log (lab.targets.native) goes to the test's folder, not the machine's /tmp
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    with open(tmp_path / (log or f"process{process_id}.log"), "w") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(process_id), f"127.0.0.1:{port}", str(tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )


def _finish(processes, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(None)
    return codes


TRAIN = f"""
    import json, sys
    from dataclasses import replace
    from pathlib import Path
    from lab.training.run import RunConfig, run
    process_id, coordinator, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    config = RunConfig(**{ {k: getattr(RUN, k) for k in ("target", "mesh", "steps", "global_batch", "page")}!r})
    log = run(replace(config, coordinator=coordinator, num_processes=2, process_id=process_id, results=folder))
    (folder / f"losses{{process_id}}.json").write_text(json.dumps(log.losses))
"""


def test_two_processes_of_four_devices_match_one_process_of_eight(devices, tmp_path):
    port = _free_port()
    processes = [_start(TRAIN, i, port, tmp_path) for i in (0, 1)]
    single = run(
        RunConfig(mesh=RUN.mesh, steps=RUN.steps, global_batch=RUN.global_batch, results=tmp_path / "single"), devices
    )
    codes = _finish(processes, timeout=240)
    assert codes == [0, 0], (tmp_path / "process0.log").read_text()[-3000:]
    for process_id in (0, 1):
        losses = json.loads((tmp_path / f"losses{process_id}.json").read_text())
        np.testing.assert_allclose(losses, single.losses, rtol=1e-5)
    assert (tmp_path / "train.metrics.jsonl").read_text().count("\n") == RUN.steps  # process 0 alone wrote the log


# `lab train` as typed, with the test's bound on the wait for the others to join (the command waits 60 s)
TRAIN_CLI = f"""
    import sys
    from lab.cli import main
    from lab.training import run
    run.JOIN_TIMEOUT_S = 6
    process_id, coordinator, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.exit(main(["train", "--target", "cpu:4", "--mesh", {RUN.mesh!r}, "--global-batch", "8", "--steps", "100000",
                   "--no-page", "--results", folder, "--coordinator", coordinator, "--num-processes", "2",
                   "--process-id", str(process_id)]))
"""


def _one_line(path: Path) -> str:
    """What a process printed, which must be one `lab: error:` line: no C++ log, no stack dump, no traceback."""
    out = path.read_text()
    assert out.startswith("lab: error: ") and out.count("\n") == 1, out[-3000:]
    return out


DIE = """
    import os, sys, time
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lab.targets import native
    from lab.targets.devices import distributed_devices
    process_id, coordinator = int(sys.argv[1]), sys.argv[2]
    devices = distributed_devices("cpu:4", coordinator, 2, process_id, timeout_s=60, heartbeat_s=5)
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    ones = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")), lambda index: np.ones(8, np.float32)[index])
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    for step in range(1000):
        try:
            assert float(total(ones)) == 8.0
        except jax.errors.JaxRuntimeError as err:  # gloo noticed first; lab train's loop does the same
            native.await_verdict(err, heartbeat_s=5)
        if process_id == 1 and step == 2:
            os._exit(3)  # dies without a word to the others
        time.sleep(0.2)
"""


def test_when_one_process_dies_the_other_stops_with_one_line(tmp_path):
    port = _free_port()
    processes = [_start(DIE, i, port, tmp_path) for i in (0, 1)]
    codes = _finish(processes, timeout=120)
    assert codes[1] == 3
    assert codes[0] == 1  # stopped by the coordination service's heartbeat check, not hung until killed
    assert "process 1 of this run stopped sending heartbeats" in _one_line(tmp_path / "process0.log")


def test_a_duplicate_id_a_missing_peer_and_a_busy_port_each_stop_every_process_with_one_line(tmp_path):
    """Three broken runs at once (each on its own port): every process stops within the join timeout, one line."""
    for case in ("duplicate", "alone", "busy"):
        (tmp_path / case).mkdir()
    ports = {case: _free_port() for case in ("duplicate", "alone")}
    with socket.socket() as holder:  # another program listening on the port the busy run is told to use
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports["busy"] = holder.getsockname()[1]
        started = {
            ("duplicate", "process0"): _start(TRAIN_CLI, 0, ports["duplicate"], tmp_path / "duplicate"),
            ("duplicate", "process1"): _start(TRAIN_CLI, 1, ports["duplicate"], tmp_path / "duplicate"),
            ("duplicate", "again1"): _start(TRAIN_CLI, 1, ports["duplicate"], tmp_path / "duplicate", "again1.log"),
            ("alone", "process0"): _start(TRAIN_CLI, 0, ports["alone"], tmp_path / "alone"),
            ("busy", "process0"): _start(TRAIN_CLI, 0, ports["busy"], tmp_path / "busy"),
            ("busy", "process1"): _start(TRAIN_CLI, 1, ports["busy"], tmp_path / "busy"),
        }
        codes = dict(zip(started, _finish(started.values(), timeout=120)))
    assert all(code not in (0, None) for code in codes.values()), codes
    said = {key: _one_line(tmp_path / key[0] / f"{key[1]}.log") for key in started}
    assert "two processes joined with --process-id 1" in said["duplicate", "process0"]
    assert "did not all join within 6 s" in said["alone", "process0"]
    assert codes["busy", "process0"] == 2 and "cannot listen on the coordinator's address" in said["busy", "process0"]
    assert "did not all join within 6 s" in said["busy", "process1"]  # what holds the port is no coordinator


def test_unreachable_coordinator_is_a_clear_error_after_a_bounded_wait():
    with pytest.raises(LabError, match=r"did not answer within 1 s"):
        distributed_devices("cpu:4", f"127.0.0.1:{_free_port()}", 2, 1, timeout_s=1)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("127.0.0.1:1", None, None), "together"),
        (("127.0.0.1:1", 2, 2), "must be in 0..1"),
        (("127.0.0.1", 2, 1), "give host:port"),
    ],
)
def test_bad_distributed_flags_are_clear_errors(arguments, message):
    with pytest.raises(LabError, match=message):
        distributed_devices("cpu:4", *arguments, timeout_s=1)


MISMATCH = f"""
    import sys
    from pathlib import Path
    from lab.cli import main
    process_id, coordinator, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    steps = ["--steps", "4" if process_id == 0 else "6"]  # started with different step counts by mistake
    sys.exit(main(["train", "--target", "cpu:4", "--mesh", {RUN.mesh!r}, "--global-batch", "8", *steps, "--no-page",
                   "--results", str(folder), "--coordinator", coordinator, "--num-processes", "2",
                   "--process-id", str(process_id)]))
"""


def test_processes_started_with_different_options_refuse_to_start_naming_the_field(tmp_path):
    port = _free_port()
    started = time.monotonic()
    processes = [_start(MISMATCH, i, port, tmp_path) for i in (0, 1)]
    codes = _finish(processes, timeout=120)
    assert codes == [2, 2] and time.monotonic() - started < 100
    for process_id in (0, 1):
        out = (tmp_path / f"process{process_id}.log").read_text()
        assert "lab: error: the processes of this run disagree on --steps" in out, out[-2000:]
