"""Targets: where the lab's programs compile and run.

A target is named by a short string:

* ``cpu:N`` (the default, ``cpu:8``): N emulated XLA CPU devices in this one
  process. Numerics, compiled HLO and memory analysis are real; timings are
  relative only (every "device" shares this machine's cores and memory). The
  device count is a backend option, so it must be set *before* JAX starts its
  backends; asking for another count afterwards is an error, not a silently
  wrong mesh.
* ``gpu`` / ``tpu``: the real accelerators JAX finds (across processes once
  ``jax.distributed`` is initialised). Everything is real, timings included.
* ``tpu:<gen>:<topology>`` such as ``tpu:v5e:4x4`` or ``tpu:v5p:8x8x16``, with
  an optional `` slices=K`` for several slices joined by DCN: compile-only.
  libtpu builds devices for that topology with no TPU present; programs are
  lowered and compiled by the TPU compiler but never executed.
* ``gpu:<chip>:<nodes>x<gpus per node>`` such as ``gpu:h100:4x8``: compile-only
  NVIDIA GPU clusters. The CUDA plugin builds devices from a target config
  written from the chip's public specification (`lab.targets.gpu`), one NVLink
  domain per node, nodes joined by InfiniBand; XLA:GPU compiles for them with
  no GPU present.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import jax
from jax.experimental import topologies

from lab.errors import LabError
from lab.targets import gpu, libtpu, native

DEFAULT_TARGET = "cpu:8"
MAX_CPU_DEVICES = 512  # XLA:CPU compiles for every emulated device in one process: thousands never finish
# libtpu aborts past it: "Check failed: pr_mapper.NumSlices() < kMaxNumSlices (10000 vs. 512)"
# (cross_slice_rewrites_utils.cc, libtpu 0.0.x of jax 0.10), a SIGABRT no Python code can catch
MAX_SLICES = 511

_TOPOLOGY = re.compile(
    r"^tpu:(?P<gen>v\d+[a-z]*|tpu7x):(?P<dims>\d+(?:x\d+){1,2})(?:\s+slices=(?P<slices>\S+))?$", re.ASCII
)
_TARGET_FORMS = (
    "cpu:N (e.g. cpu:8), gpu, tpu, tpu:<gen>:<topology>[ slices=K] (e.g. tpu:v5e:4x4, tpu:v5p:8x8x16, "
    "tpu:tpu7x:4x4x4), "
    f"or {gpu.GPU_TARGET_FORM}"
)


@dataclass(frozen=True)
class Target:
    """A parsed target: platform, emulated device count, or a compile-only TPU topology or GPU cluster."""

    platform: str  # "cpu", "gpu" or "tpu"
    count: int | None = None  # cpu:N only
    topology: str | None = None  # "v5e:4x4" (TPU) or "h100:4x8" (GPU: nodes x GPUs per node): compile-only
    slices: int = 1

    @property
    def compile_only(self) -> bool:
        return self.topology is not None

    @property
    def generation(self) -> str | None:
        """TPU generation of a topology target ("v5e"), else None."""
        return self.topology.split(":")[0] if self.topology and self.platform == "tpu" else None

    def __str__(self) -> str:
        if self.count is not None:
            return f"cpu:{self.count}"
        if self.topology and self.platform == "gpu":
            return f"gpu:{self.topology}"
        if self.topology:
            return f"tpu:{self.topology}" + (f" slices={self.slices}" if self.slices > 1 else "")
        return self.platform


def parse_target(spec: str) -> Target:
    """Parse ``cpu:8``, ``gpu``, ``tpu``, ``tpu:v5e:4x4 slices=2``, ``gpu:h100:4x8`` into a Target."""
    text = spec.strip().lower()
    if text in ("gpu", "tpu"):
        return Target(platform=text)
    if text.startswith("gpu:"):
        chip, nodes, per_node = gpu.parse_cluster(text)
        return Target("gpu", topology=f"{chip}:{nodes}x{per_node}")
    if text.startswith("cpu:"):
        count = text[4:]
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise LabError(f"target {spec!r}: the device count must be a positive integer, as in cpu:8")
        if int(count) > MAX_CPU_DEVICES:
            raise LabError(
                f"target {spec!r}: this host emulates at most {MAX_CPU_DEVICES} CPU devices; for a larger mesh "
                "compile for a TPU topology instead (tpu:<gen>:<topology>)"
            )
        return Target("cpu", int(count))
    match = _TOPOLOGY.match(text)
    if match:
        slices = match["slices"] or "1"
        if not (slices.isascii() and slices.isdigit()) or int(slices) < 1:
            raise LabError(f"target {spec!r}: slices must be a positive integer, as in 'tpu:v5e:16x16 slices=4'")
        check_slices(f"target {spec!r}", int(slices))
        return Target("tpu", topology=f"{match['gen']}:{match['dims']}", slices=int(slices))
    raise LabError(f"unknown target {spec!r}; use {_TARGET_FORMS}")


def check_slices(what: str, slices: int) -> int:
    """A slice count libtpu compiles for: 1 to `MAX_SLICES` (past that it aborts the process)."""
    if not 1 <= slices <= MAX_SLICES:
        raise LabError(
            f"{what} asks for {slices} slices; libtpu compiles for 1 to {MAX_SLICES}: give a count in that range"
        )
    return slices


def one_slice(target: Target, slices: int) -> tuple[Target, int]:
    """A target written with its slices (``tpu:v5e:4x4 slices=2``), as one slice and the count, for the commands that
    take the count as ``--slices``; both given must agree."""
    if target.slices > 1 and slices not in (1, target.slices):
        raise LabError(f"--target {str(target)!r} and --slices {slices} give two slice counts: give the count once")
    return replace(target, slices=1), target.slices if target.slices > 1 else slices  # --slices as given: checked


def devices_for(target: Target | str) -> tuple:
    """Prepare JAX for `target` and return its devices, in JAX's order."""
    target = parse_target(target) if isinstance(target, str) else target
    if target.compile_only and target.platform == "gpu":
        return gpu_cluster_devices(target.topology)
    if target.compile_only:
        return topology_devices(target.topology, target.slices)
    if target.platform == "cpu":
        return _emulated_cpu_devices(target.count or 1)
    return _real_devices(target.platform)


def _emulated_cpu_devices(count: int) -> tuple:
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already started: checked below
    devices = tuple(jax.devices("cpu"))
    if len(devices) != count:
        raise LabError(
            f"target cpu:{count} asked for, but JAX already started with {len(devices)} CPU devices in this "
            f"process; choose the target before any JAX computation runs (or use cpu:{len(devices)})"
        )
    return devices


def _real_devices(platform: str) -> tuple:
    try:
        devices = tuple(jax.devices(platform))
    except RuntimeError:
        devices = ()
    if not devices:
        raise LabError(
            f"target {platform!r}: JAX finds no {platform.upper()} here; use "
            "cpu:8, or tpu:<gen>:<topology> to compile for a TPU without "
            "one"
        )
    return devices


@functools.cache
def topology_devices(topology: str, slices: int = 1) -> tuple:
    """Compile-only devices of a TPU topology ("v5e:4x4"), built by libtpu."""
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_platforms", "cpu")  # the host backend; the TPU is compile-only
    if not _libtpu_installed():
        raise LabError(
            f"target tpu:{topology} needs libtpu; install it with: pip install 'jax[tpu]' (or pip install -e '.[tpu]')"
        )
    check_slices(f"tpu:{topology}", slices)
    libtpu.check_environment()  # a flag libtpu rejects would end this process with no word of why
    # Compile-only use never touches a chip, so two processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {"num_slices": slices} if slices > 1 else {}
    if topology.startswith("v4:"):
        kwargs["chip_config_name"] = "megacore"  # one device per chip, as on real v4 (not one per TensorCore)
    with quiet_native_stderr() as noise:
        try:
            description = topologies.get_topology_desc(topology, "tpu", **kwargs)
        except jax.errors.JaxRuntimeError as err:  # libtpu's message runs to many lines
            detail = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            raise LabError(
                f"libtpu does not know topology {topology!r} ({detail}); use a form like v5e:4x4, v5p:4x4x4, v6e:16x16"
            ) from None
    del noise
    return tuple(description.devices)


@functools.cache
def gpu_cluster_devices(cluster: str) -> tuple:
    """Compile-only devices of a GPU cluster ("h100:4x8": 4 nodes of 8 GPUs), built by the CUDA plugin."""
    chip, nodes, per_node = gpu.parse_cluster(f"gpu:{cluster}")
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_platforms", "cpu")  # the host backend; the GPUs are compile-only
    if not gpu.cuda_plugin_installed():
        raise LabError(
            f"target gpu:{cluster} needs JAX's CUDA plugin (no GPU); install it with: pip install 'jax[cuda12]' "
            "(or pip install -e '.[gpu]')"
        )
    # The plugin checks the CUDA libraries against a driver only when CUDA is a platform to run on; say so anyway
    # in case the host's JAX_PLATFORMS asks for it: nothing here runs on a GPU.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    config = gpu.target_config(gpu.spec(chip))
    with quiet_native_stderr() as noise:
        try:
            description = topologies.get_topology_desc(
                platform="cuda", target_config=config, topology=gpu.xla_topology(nodes, per_node)
            )
        except (NotImplementedError, RuntimeError) as err:  # JaxRuntimeError is a RuntimeError
            detail = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            raise LabError(
                f"the CUDA plugin could not build gpu:{cluster} ({detail}); reinstall it with pip install -e '.[gpu]'"
            ) from None
    del noise
    return tuple(description.devices)


def pod_devices(topology: str, slices: int = 1) -> tuple:
    """Compile-only devices of `slices` copies of one slice: a TPU topology ("v5e:16x16") joined by DCN, or one
    GPU node ("h100:1x8", one node of 8) joined by InfiniBand, as `lab plan` lays a model on either."""
    chip, _, shape = topology.partition(":")
    if chip in gpu.SPECS:
        return gpu_cluster_devices(f"{chip}:{slices}x{shape.rpartition('x')[2]}")
    return topology_devices(topology, slices)


def topology_shape(topology: str) -> tuple[int, ...]:
    """Chips along each torus dimension of a topology name: "v5e:4x4" -> (4, 4)."""
    return tuple(int(size) for size in topology.split(":")[1].split("x"))


def _libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[list[str]]:
    """Silence C++ logging written to file descriptor 2 (libtpu's start-up noise).

    Python's ``sys.stderr`` redirection cannot catch it: libtpu writes to the
    descriptor directly. The captured lines are handed back for debugging.
    """
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.extend(sink.read().decode(errors="replace").splitlines())


def describe_devices(devices: Sequence) -> str:
    """One line: how many devices of which kind."""
    kinds = sorted({getattr(d, "device_kind", "?") for d in devices})
    return f"{len(devices)} x {', '.join(kinds)}"


# --- Several processes: jax.distributed -----------------------------------------------------------------------------


def distributed_devices(
    target: Target | str,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 60,
    heartbeat_s: int = 10,
) -> tuple:
    """Join the other processes of a run through ``jax.distributed`` and return the devices of all of them.

    With no coordinator, process count or id, JAX reads them from the environment a TPU VM slice, SLURM
    (``SLURM_*``) or Open MPI provides. For ``cpu:N`` each process emulates N devices and the processes talk
    over gloo (TCP). `timeout_s` bounds the wait for the others to join; a process that stops sending
    heartbeats for `heartbeat_s` makes the coordination service stop every other process. From this call on,
    JAX's native log goes to a file and its fatal aborts become one line on the terminal (`lab.targets.native`).
    """
    target = parse_target(target) if isinstance(target, str) else target
    if target.compile_only:
        raise LabError(
            f"target {target} is compile-only: nothing runs, so there are no processes to join; use cpu:N, gpu or tpu"
        )
    if (coordinator is None) != (num_processes is None) or (coordinator is None) != (process_id is None):
        raise LabError(
            "give --coordinator, --num-processes and --process-id together, "
            "or none of them to read them from the TPU/SLURM environment"
        )
    if process_id is not None and not 0 <= process_id < num_processes:
        raise LabError(
            f"--process-id {process_id} must be in 0..{num_processes - 1} for --num-processes {num_processes}"
        )
    if coordinator is not None and process_id != 0:
        _wait_for_coordinator(coordinator, timeout_s)
    if coordinator is not None and process_id == 0 and not _port_is_free(coordinator):
        raise _port_taken(coordinator)
    if target.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", target.count or 1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    # JAX's preemption notifier would take SIGTERM over (to save at a sync point, which lab train does not use);
    # without it SIGTERM stops the process as the lab's own handler says: one line, exit 143.
    jax.config.update("jax_enable_preemption_service", False)
    # From here on the runtime's C++ log goes to a file, and its fatal aborts (a peer's heartbeats stop, the others
    # never join, an id joins twice) become one line on the terminal: see lab.targets.native.
    native.divert(f"process{process_id if process_id is not None else 'x'}", timeout_s)
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_s,
        )
    except (RuntimeError, ValueError) as err:
        detail = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        if "Failed to start RPC server" in detail:  # process 0 could not listen on the coordinator's port
            raise _port_taken(coordinator) from None
        raise LabError(
            f"could not join the distributed run at {coordinator or 'the address the environment gives'} "
            f"within {timeout_s} s ({detail}); start every process with the "
            "same --coordinator and --num-processes"
        ) from None
    devices = tuple(jax.devices())
    if not devices or devices[0].platform != target.platform:
        raise LabError(
            f"target {target}: the distributed run found {describe_devices(devices)}; use the platform these hosts have"
        )
    return devices


def _port_taken(coordinator: str | None) -> LabError:
    return LabError(
        f"process 0 cannot listen on the coordinator's address {coordinator or ''} (another program or run "
        "holds the port); choose a free port and give it to every process"
    )


def _port_is_free(address: str) -> bool:
    """Whether process 0 can listen where JAX's coordination service will (``[::]:port``, every interface).

    Asked before JAX is: jaxlib 0.10.2 does not raise when that port is taken, it dies of SIGSEGV right after
    logging "Failed to add port to server", so the process would end with no word at all."""
    port = address.rpartition(":")[2]
    if not port.isdigit():
        return True  # JAX says what is wrong with the address itself
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "")
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a closing run is no owner
            probe.bind((host, int(port)))
    except OSError as err:
        if family == socket.AF_INET6 and err.errno == errno.EAFNOSUPPORT:
            return True  # no IPv6 on this host: leave it to JAX
        return err.errno != errno.EADDRINUSE
    return True


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until the coordinator's port accepts connections: past the deadline, JAX would abort the process from
    C++ (DEADLINE_EXCEEDED on RegisterTask) instead of raising, so the unreachable case is caught here first."""

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LabError(f"--coordinator {address!r}: give host:port, e.g. 10.0.0.1:1234 (the address of process 0)")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise LabError(
                    f"the coordinator {address} did not answer within {timeout_s:g} "
                    "s; start process 0 first, with the same --coordinator, and "
                    "check that this host can reach it"
                ) from None
            time.sleep(0.2)
