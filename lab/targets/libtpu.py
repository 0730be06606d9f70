"""libtpu's start-up flags: ``LIBTPU_INIT_ARGS``, set before libtpu starts and checked before any compile.

libtpu reads its flags once, from ``LIBTPU_INIT_ARGS``, when the first TPU
backend or topology starts in a process. Two things follow:

* flags given after that would be ignored, so `prepare` refuses them with a
  `LabError` instead (the lab's own ``--xla_tpu_no_crash_on_oom=true``, which
  lets a step that does not fit HBM still report its memory, is merely
  skipped: the compile then says it does not fit);
* a flag libtpu does not know (recipes carry build-specific ones such as
  ``--2a886c8_chip_config_name=...``) or a value it cannot parse makes libtpu
  print ``ERROR: ...`` and end the process, with nothing for Python to catch.
  `check` therefore starts libtpu once in a child process with the user's
  flags and turns its ``ERROR:`` lines into one `LabError`, before the lab's
  own process commits to them: those given as ``--libtpu-flags`` when a
  command prepares them, and those the user exported in ``LIBTPU_INIT_ARGS``
  when libtpu is about to start (`check_environment`; without it such a flag
  ended ``lab predict`` with exit 1 and not a word). A flag that passed is not
  tried again in the same process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from lab.errors import LabError

NO_CRASH_ON_OOM = "--xla_tpu_no_crash_on_oom=true"
_FLAG = re.compile(r"^--[A-Za-z0-9_]+(=.*)?$")
_ERROR = re.compile(r"^ERROR: (.*)$", re.MULTILINE)
_CHILD = "import sys\nfrom jax.experimental import topologies\ntopologies.get_topology_desc(sys.argv[1], 'tpu')\n"
CHECK_TOPOLOGY = "v5e:2x2"  # any topology: libtpu parses its flags when it starts, before it reads one
CHECK_TIMEOUT_S = 300


def split_flags(
    flags: str, option: str = "--libtpu-flags", example: str = "--xla_tpu_enable_async_collective_fusion=true"
) -> tuple[str, ...]:
    """``LIBTPU_INIT_ARGS`` (or ``XLA_FLAGS``) syntax -> its flags; anything not ``--name`` or ``--name=value`` is a
    one-line error naming `option`, the command's option that gave them."""
    split = tuple(flags.split())
    bad = [flag for flag in split if not _FLAG.match(flag)]
    if bad:
        raise LabError(f'{option}: {bad[0]!r} is not a flag; write each as --name=value, e.g. {option} "{example}"')
    return split


def prepare(flags: str = "") -> None:
    """Check `flags` (``LIBTPU_INIT_ARGS`` syntax) and put them, with no-crash-on-OOM, where libtpu reads them."""
    given = split_flags(flags)
    if given:
        check(given)
    wanted = list(dict.fromkeys([NO_CRASH_ON_OOM, *given]))
    current = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    missing = [flag for flag in wanted if flag not in current]
    if not missing:
        return
    if _started:
        if missing == [NO_CRASH_ON_OOM]:
            return  # a step that does not fit then fails to compile, and `compile_step` says so
        raise LabError(
            f"libtpu already started in this process without {' '.join(missing)}; run lab predict in a fresh "
            "process (or export LIBTPU_INIT_ARGS before it starts)"
        )
    os.environ["LIBTPU_INIT_ARGS"] = " ".join([*current, *missing])


def check_environment() -> None:
    """The flags of ``LIBTPU_INIT_ARGS`` as libtpu is about to read them, those not yet passed checked (`check`);
    from here on this process's libtpu has its flags (`prepare` can add none)."""
    global _started
    check(tuple(os.environ.get("LIBTPU_INIT_ARGS", "").split()), "LIBTPU_INIT_ARGS")
    _started = True


_started = False  # whether libtpu has read its flags in this process: set by `check_environment`, just before


_PASSED = {NO_CRASH_ON_OOM}  # the flags libtpu took in this process's checks


def check(flags: tuple[str, ...], source: str = "--libtpu-flags") -> None:
    """Start libtpu in a child process with those of `flags` not passed before; what it rejects becomes one
    `LabError` naming the flag and where it came from, `source`."""
    flags = tuple(flag for flag in flags if flag not in _PASSED)
    if not flags:
        return
    env = {**os.environ, "LIBTPU_INIT_ARGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip is touched
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, CHECK_TOPOLOGY],
            capture_output=True,
            text=True,
            env=env,
            timeout=CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"libtpu did not start within {CHECK_TIMEOUT_S} s with {source} {' '.join(flags)!r}") from None
    if done.returncode == 0:
        _PASSED.update(flags)
        return
    errors = _ERROR.findall(done.stderr + done.stdout)
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    detail = "; ".join(dict.fromkeys(errors)) if errors else last
    raise LabError(f"libtpu rejects {source} {' '.join(flags)!r}: {detail[:300]}")
