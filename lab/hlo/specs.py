"""An HLO sharding as the PartitionSpec a user wrote: ``{devices=[2,4,1]<=[8]}`` on a data=2,fsdp=4 mesh is
``P('data', 'fsdp', None)``.

XLA writes a sharding as a tile grid (how many pieces each dimension is cut
into) and the devices that hold the tiles, in order: an iota (``<=[8]``, or
``<=[4,2]T(1,0)``: arange(8) reshaped and transposed) or a list. With
``last_tile_dim_replicate`` the grid's last dimension is not the array's: the
devices along it hold the same tile. A device's id is its place in the mesh
(``mesh.devices.flat``), so each tile dimension is split by the mesh axes
whose coordinate changes along it, major to minor in the order that counts
its tiles (the mesh's, or another: ``('tensor', 'data')``); a grid that no
such reading reproduces (a device order the mesh does not have) has no spec,
and the caller shows XLA's text.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

_TILES = re.compile(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))")


def partition_spec(sharding: str, mesh: dict[str, int]) -> str | None:
    """``{devices=[...]...}`` on a mesh of `mesh`'s axes and sizes (in order) as ``P(...)``; None when it is not a
    tiling of those axes (replicated, maximal, manual subgroups, another device order)."""
    found = _TILES.search(sharding)
    if found is None or "last_tile_dims" in sharding:
        return None
    tiles = [int(t) for t in found[1].split(",")]
    ids = _device_ids(found, math.prod(tiles))
    if ids is None or not np.array_equal(np.sort(ids), np.arange(math.prod(mesh.values()))):
        return None  # not each of the mesh's devices once (a module of another size, or of some of them)
    grid = ids.reshape(tiles)
    dims = len(tiles) - ("last_tile_dim_replicate" in sharding)
    coords = np.unravel_index(grid, tuple(mesh.values()))
    parts = [_axes_along(grid, coords, d, list(mesh.items())) for d in range(dims)]
    if any(p is None for p in parts):
        return None
    return f"P({', '.join(_entry(p) for p in parts)})"


def _device_ids(found: re.Match, count: int) -> np.ndarray | None:
    if found[4] is not None:  # an explicit list
        ids = np.array([int(i) for i in found[4].split(",") if i])
        return ids if ids.size == count else None
    shape = [int(r) for r in found[2].split(",")]
    if math.prod(shape) != count:
        return None
    order = [int(p) for p in found[3].split(",")] if found[3] else list(range(len(shape)))
    return np.arange(count).reshape(shape).transpose(order).ravel()


def _axes_along(grid: np.ndarray, coords: tuple, dim: int, axes: list[tuple[str, int]]) -> list[str] | None:
    """The mesh axes that cut tile dimension `dim`, major to minor; None when they do not count its tiles."""
    if grid.shape[dim] == 1:
        return []
    moving = [k for k, c in enumerate(coords) if np.any(np.diff(c, axis=dim))]
    if math.prod(axes[k][1] for k in moving) != grid.shape[dim]:
        return None
    shape = [1] * grid.ndim
    shape[dim] = grid.shape[dim]
    expected = np.broadcast_to(np.arange(grid.shape[dim]).reshape(shape), grid.shape)
    for order in itertools.permutations(moving):  # the mesh's order first; ('tensor', 'data') is another
        index = np.ravel_multi_index(tuple(coords[k] for k in order), [axes[k][1] for k in order])
        if np.array_equal(index, expected):
            return [axes[k][0] for k in order]
    return None


def _entry(axes: list[str]) -> str:
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else f"({', '.join(map(repr, axes))})"
