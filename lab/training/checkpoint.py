"""Checkpoints with orbax: save a sharded training state, restore it onto any mesh.

Each device writes only its own shards (orbax's array handler, tensorstore
underneath), so a checkpoint never passes through one host's memory. A save
goes to a temporary directory that orbax renames to ``<step>/`` once every
shard and the metadata are written: a process killed in the middle of a save
leaves a half-written temporary directory that is ignored, and the previous
step stays the latest one that restores.

Saving asynchronously copies the arrays to host memory and returns; the
writing happens in a background thread while the next steps run, so a save
costs the training loop little more than that copy (orbax's
``enable_async_checkpointing``).

A checkpoint records arrays by name and global shape, not by layout. To restore
we hand orbax the *target* state as ShapeDtypeStructs carrying the new mesh's
shardings, and each device reads just the slices its new shard covers: a state
saved under ``fsdp=8`` restores directly into ``data=2,tensor=4``.

Every save also records a checksum of each array, and a restore recomputes it
on what it read. The checksum is a position-weighted sum of the array's bits
in uint32 arithmetic, computed on the devices: addition modulo 2^32 does not
depend on the order of the terms, so the sum is the same however the array is
sharded, and a state saved on one mesh verifies on another. A step whose files
cannot be read, whose checksums differ, or whose values are not finite is
skipped for the next older one, and moved aside (``<step>.corrupt``, or
``.corrupt.2`` when a copy is already there: moving aside never fails) so that
keeping the newest ``keep`` steps never deletes the intact step the run
resumed from. Each save also records its own step number beside the
checksums, so a step folder copied under another number is refused the same
way. Nothing is trained on weights that failed the check.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lab.errors import LabError
from lab.training.lock import hold

STEP_KEY = "__step__"  # saved beside the checksums: the step a checkpoint holds


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often to save."""

    directory: Path
    every: int = 0  # save every this many steps; 0: only when asked with force=True
    asynchronous: bool = False
    keep: int = 2  # older checkpoints are deleted once a newer one is complete


def flat_names(tree: Any) -> dict[str, Any]:
    """A pytree as {"params.blocks.mlp.w_in.value": leaf}: names survive a change of pytree classes, paths do too."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in leaves}


def unflatten_like(template: Any, named: dict[str, Any]) -> Any:
    """The inverse of `flat_names`, using `template` for the pytree structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(
        treedef, [named[jax.tree_util.keystr(p, simple=True, separator=".")] for p, _ in leaves]
    )


class Checkpoints:
    """Periodic saves of a pytree of jax Arrays under one directory, and restores onto any sharding."""

    def __init__(self, policy: CheckpointPolicy):
        self.policy = policy
        directory = Path(policy.directory).absolute()
        if directory.exists() and not directory.is_dir():
            raise LabError(
                f"checkpoint path {str(directory)!r} is a file; give a directory (new or written by lab train)"
            )
        self._lock = _lock(directory) if jax.process_index() == 0 else None
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(policy.every, 1),
            max_to_keep=policy.keep,
            enable_async_checkpointing=policy.asynchronous,
            create=True,
        )
        # the handlers named up front: a manager that has not saved yet can then read an existing folder's metadata
        handlers = {"state": ocp.StandardCheckpointHandler(), "checksums": ocp.JsonCheckpointHandler()}
        try:
            self.manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        except BaseException:
            if self._lock is not None:
                self._lock.close()
            raise
        self.skipped: list[str] = []  # the steps a restore passed over, and why

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` as `step` when the policy says so (or `force`); returns whether a save started."""
        if not force and (self.policy.every <= 0 or step % self.policy.every):
            return False
        plain = {name: _relabel(array, _without_reduced(array.sharding)) for name, array in flat_names(state).items()}
        sums = checksums(plain)  # before the save starts: an async save must not race the next step's donation
        sums[STEP_KEY] = step  # the step knows its own number: a folder copied under another is caught on restore
        args = ocp.args.Composite(state=ocp.args.StandardSave(plain), checksums=ocp.args.JsonSave(sums))
        return self.manager.save(step, args=args, force=force)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint (half-written ones do not count)."""
        return self.manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any]:
        """(step, state) with each leaf placed as `abstract_state`'s ShapeDtypeStruct says (its sharding, its mesh).

        Without `step`, the newest step that verifies; the ones passed over are in `skipped` and moved aside.
        """
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise LabError(
                f"no checkpoint in {str(self.policy.directory)!r}; train without "
                "--resume first, or point --checkpoint-dir at a lab train checkpoint"
            )
        expected = flat_names(abstract_state)
        self.skipped = []
        for candidate in steps:
            try:
                restored = self._verified(candidate, expected)
            except _Corrupt as err:
                if step is not None:
                    raise LabError(f"checkpoint step {step} in {str(self.policy.directory)!r}: {err}") from None
                self.skipped.append(f"step {candidate}: {err}")
                continue
            for bad in steps[: steps.index(candidate)]:
                self._move_aside(bad)
            return candidate, unflatten_like(
                abstract_state, {name: _relabel(restored[name], a.sharding) for name, a in expected.items()}
            )
        raise LabError(
            f"no intact checkpoint in {str(self.policy.directory)!r} ({'; '.join(self.skipped)}); "
            "train without --resume, or restore a backup of the folder"
        )

    def _verified(self, step: int, expected: dict[str, Any]) -> dict[str, jax.Array]:
        """The arrays of `step`, read and checked against the checksums saved with them."""
        self._check_matches(step, expected)
        plain = {
            name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_without_reduced(a.sharding))
            for name, a in expected.items()
        }
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(plain), checksums=ocp.args.JsonRestore())
            )
        except Exception as err:  # orbax and tensorstore raise many types for a truncated or missing file
            raise _Corrupt(f"its files cannot be read ({type(err).__name__})") from None
        state, saved = restored["state"], dict(restored["checksums"] or {})
        recorded = saved.pop(STEP_KEY, step)  # checkpoints from before the step was recorded pass
        if recorded != step:
            raise _Corrupt(f"it holds step {recorded}'s state under the number {step} (a copied folder)")
        found = checksums(state)
        wrong = sorted(name for name in expected if saved.get(name) != found[name])
        if wrong:
            raise _Corrupt(f"the checksum of {wrong[0]} differs from the one saved with it ({len(wrong)} arrays)")
        nonfinite = [name for name, finite in _finite(state).items() if not finite]
        if nonfinite:
            raise _Corrupt(f"{nonfinite[0]} holds NaN or Inf")
        return state

    def _move_aside(self, step: int) -> None:
        """Rename a step that failed verification, so it is neither restored nor counted among the kept ones."""
        folder = Path(self.policy.directory).absolute() / str(step)
        if jax.process_index() == 0 and folder.is_dir():
            folder.rename(_unused(folder.with_name(f"{step}.corrupt")))
        self.manager.reload()

    def _check_matches(self, step: int, expected: dict[str, Any]) -> None:
        """A checkpoint of another model or optimizer fails here, with the first difference named."""
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as err:  # a missing or truncated metadata file: this step is unreadable, an older may not be
            raise _Corrupt(f"it is not a readable lab train checkpoint ({type(err).__name__})") from None
        saved = dict(saved or {})
        missing = sorted(set(expected) - set(saved))
        if missing:
            raise LabError(
                f"checkpoint step {step} in {str(self.policy.directory)!r} is "
                f"from another model: it has no {missing[0]!r}; use the same "
                "--model and strategy, or a new --checkpoint-dir"
            )
        for name, want in expected.items():
            shape = tuple(getattr(saved[name], "shape", ()))
            if shape != tuple(want.shape):
                raise LabError(
                    f"checkpoint step {step} in {str(self.policy.directory)!r} "
                    f"is from another model: {name} has shape {shape}, this run "
                    f"needs {tuple(want.shape)}; use the same --model, or a new "
                    "--checkpoint-dir"
                )

    def wait(self) -> None:
        """Block until an asynchronous save is on disk."""
        self.manager.wait_until_finished()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None


def _without_reduced(sharding):
    """The same device layout without a ``reduced`` set, which orbax's sharding metadata cannot record."""
    spec = getattr(sharding, "spec", None)
    if spec is None or not (spec.reduced or spec.unreduced):
        return sharding
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec.partitions))


def _relabel(array: jax.Array, sharding) -> jax.Array:
    """The same per-device buffers under another sharding type: no copy. Valid between a spec and its reduced
    twin because an array reduced over an axis is physically whole on each of that axis's devices."""
    if array.sharding == sharding:
        return array
    return jax.make_array_from_single_device_arrays(
        array.shape, sharding, [shard.data for shard in array.addressable_shards]
    )


def _unused(path: Path) -> Path:
    """`path`, or `path`.2, .3, ...: the first name nothing holds (a step corrupted twice keeps both copies)."""
    candidates = (path.with_name(f"{path.name}.{n}") if n > 1 else path for n in itertools.count(1))
    return next(c for c in candidates if not c.exists())


def _lock(directory: Path):
    """Hold the folder's lock for this run: a second run on the same folder is refused, not interleaved."""
    return hold(
        directory / ".lock",
        f"checkpoint folder {str(directory)!r}",
        "wait for it, or give this run its own --checkpoint-dir",
    )


class _Corrupt(Exception):
    """A step that cannot be trusted: unreadable files, a checksum that differs, values that are not finite."""


def checksums(named: dict[str, jax.Array]) -> dict[str, int]:
    """A checksum of each array, the same whatever its sharding (see the module docstring)."""
    return {name: int(value) for name, value in jax.device_get(_checksums(named)).items()}


@jax.jit
def _checksums(named):
    return {name: _checksum(array) for name, array in named.items()}


def _checksum(x: jax.Array) -> jax.Array:
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = (x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, width)).astype(jnp.uint32)
    position = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
    return jnp.sum(bits * (position * np.uint32(2654435761) + np.uint32(1)), dtype=jnp.uint32)  # Knuth's multiplier


def _finite(named: dict[str, jax.Array]) -> dict[str, bool]:
    floating = {name: a for name, a in named.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    return {name: bool(v) for name, v in jax.device_get(_all_finite(floating)).items()}


@jax.jit
def _all_finite(named):
    return {name: jnp.all(jnp.isfinite(a)) for name, a in named.items()}
