"""XLA:GPU's start-up flags: ``XLA_FLAGS``, set before the CUDA plugin starts and checked before any compile.

XLA reads ``XLA_FLAGS`` once in a process, when its backend starts; the CUDA
plugin's compiler, compile-only or not, takes its debug options from there.
That is where GPU training recipes put what shapes the compiled program: the
latency-hiding scheduler, the collectives' combine thresholds, pipelined
collectives, passes disabled (MaxText's GPU recipes:
``--xla_disable_hlo_passes=rematerialization``). As for libtpu's flags
(`lab.targets.libtpu`):

* flags given once the plugin has started would be ignored, so `prepare`
  refuses them with a `LabError`;
* a flag this XLA does not know (recipes carry flags later releases removed,
  such as ``--xla_gpu_enable_async_all_gather``) ends the process with a fatal
  log line, nothing for Python to catch. `check` therefore parses them first in
  a child process, on the CPU backend (the same flag table), and turns that
  line into one `LabError`; so does a value XLA cannot read as the flag's
  type (``--xla_gpu_memory_limit_slop_factor=abc``), which XLA reports in one
  line before printing its whole usage table. The answer is cached per set of
  flags.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

from lab.errors import LabError
from lab.targets.libtpu import split_flags

OPTION, EXAMPLE = "--xla-flags", "--xla_gpu_enable_latency_hiding_scheduler=true"
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag ([^\s.]+)")
_CHILD = "import jax\njax.devices()\n"
CHECK_TIMEOUT_S = 120


def prepare(flags: str = "") -> None:
    """Check `flags` (``XLA_FLAGS`` syntax) and add them to ``XLA_FLAGS`` before the CUDA plugin starts."""
    given = split_flags(flags, OPTION, EXAMPLE)
    if not given:
        return
    check(given)
    current = os.environ.get("XLA_FLAGS", "").split()
    missing = [flag for flag in given if flag not in current]
    if not missing:
        return
    if _started():
        raise LabError(
            f"XLA:GPU already started in this process without {' '.join(missing)}; run lab predict in a fresh "
            "process (or export XLA_FLAGS before it starts)"
        )
    os.environ["XLA_FLAGS"] = " ".join([*current, *missing])


@functools.cache
def check(flags: tuple[str, ...]) -> None:
    """Parse `flags` in a child process; one this XLA does not know becomes one `LabError` naming it."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=CHECK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"XLA did not start within {CHECK_TIMEOUT_S} s with {OPTION} {' '.join(flags)!r}") from None
    if done.returncode == 0:
        return
    unknown, bad = _UNKNOWN.findall(done.stderr), _BAD_VALUE.findall(done.stderr)
    if bad:
        value, name = bad[0]
        raise LabError(f"XLA cannot read {value!r} as a value of --{name}; give it a value of the flag's type")
    detail = f"unknown to this XLA: {unknown[0]}" if unknown else (done.stderr.strip().splitlines() or ["?"])[-1]
    raise LabError(f"XLA rejects {OPTION} {' '.join(flags)!r}: {detail[:300]}; drop it or use an XLA that has it")


def _started() -> bool:
    # local: the cluster cache is the only record of whether the CUDA plugin has started in this process
    from lab.targets.devices import gpu_cluster_devices

    return gpu_cluster_devices.cache_info().currsize > 0
