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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from lab.errors import LabError


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
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(policy.every, 1),
            max_to_keep=policy.keep,
            enable_async_checkpointing=policy.asynchronous,
            create=True,
        )
        # the handler named up front: a manager that has not saved yet can then read an existing folder's metadata
        self.manager = ocp.CheckpointManager(directory, options=options, item_handlers=ocp.StandardCheckpointHandler())

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` as `step` when the policy says so (or `force`); returns whether a save started."""
        if not force and (self.policy.every <= 0 or step % self.policy.every):
            return False
        plain = {name: _relabel(array, _without_reduced(array.sharding)) for name, array in flat_names(state).items()}
        return self.manager.save(step, args=ocp.args.StandardSave(plain), force=force)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint (half-written ones do not count)."""
        return self.manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any]:
        """(step, state) with each leaf placed as `abstract_state`'s ShapeDtypeStruct says (its sharding, its mesh)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise LabError(
                f"no checkpoint in {str(self.policy.directory)!r}; train without "
                "--resume first, or point --checkpoint-dir at a lab train checkpoint"
            )
        expected = flat_names(abstract_state)
        self._check_matches(step, expected)
        plain = {
            name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_without_reduced(a.sharding))
            for name, a in expected.items()
        }
        try:
            restored = self.manager.restore(step, args=ocp.args.StandardRestore(plain))
        except Exception as err:
            raise LabError(
                f"checkpoint step {step} in {str(self.policy.directory)!r} cannot "
                f"be read ({type(err).__name__}); it is corrupt: delete that "
                "step folder to fall back to an older one"
            ) from None
        return step, unflatten_like(
            abstract_state, {name: _relabel(restored[name], a.sharding) for name, a in expected.items()}
        )

    def _check_matches(self, step: int, expected: dict[str, Any]) -> None:
        """A checkpoint of another model or optimizer fails here, with the first difference named."""
        try:
            saved = self.manager.item_metadata(step)
        except Exception as err:
            raise LabError(
                f"{str(self.policy.directory)!r} step {step} is not a readable "
                f"orbax checkpoint ({type(err).__name__}); point --checkpoint-dir "
                "at a lab train checkpoint"
            ) from None
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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


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
