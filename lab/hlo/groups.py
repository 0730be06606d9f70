"""Replica groups: which devices a collective's instruction names, in XLA's three notations, and their mesh axes.

A collective's *replica groups* name the devices that talk to each other. The
ids are positions in the program's device assignment, which for a jitted
program over a mesh is the mesh's flat device order (``mesh.devices.flat``),
not ``device.id``: on a TPU topology mesh whose device ids are permuted, a
psum over ``tensor`` still prints ``{{0,1,2,3},...}``. So groups map back to
mesh axes with `lab.mesh.axes_of_groups`. XLA prints groups in three notations:

* explicit ``{{0,2},{1,3}}`` (``{}`` means every device in one group);
* iota ``[2,4]<=[4,2]T(1,0)``: ``arange(8).reshape(4,2).transpose(1,0)``
  read as 2 groups of 4 (``IotaReplicaGroupList``);
* mesh ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: a compiler-side mesh (its
  own axis names, optionally ``, device_ids=(...)``) and the axes a group
  spans, sub-axes written ``'x':(pre)size`` (``MeshAxesReplicaGroupList``).

A collective-permute has no groups but ``source_target_pairs``; the devices
its pairs link are its groups here, and its axes are those along which some
pair moves data.

The chain: `replica_groups_text` finds the value in an instruction's
attributes, `expand_replica_groups` turns any notation into explicit groups of
device positions, `collective_axes` names the mesh axes they span.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from lab.hlo.text import Shape, compact, split_attributes
from lab.mesh import axes_of_groups

Groups = tuple[tuple[int, ...], ...]

_IOTA = re.compile(r"^\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$")
_NESTED_PARENS = r"(?:[^()]|\([^()]*\))*"
# The mesh notation, as printed by MeshAxesReplicaGroupList::ToString and Mesh::ToString in
# openxla/xla xla/hlo/ir/replica_group.cc and mesh_and_axis.cc: "mesh[a=2,b=4]" plus
# ", device_ids=(<ids>)" when the compiler mesh is not a plain iota, then " {a,b:(1)2}".
# Current XLA/libtpu quote the names (mesh['axis_0'=4] {'axis_0'}); older XLA printed
# "@mesh<a=2,b=4>(devices=[2,4]<=[8]) {a}". All three spellings are read.
_MESH = re.compile(
    rf"^(?:mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>{_NESTED_PARENS})\))?"
    rf"|@mesh<(?P<old_axes>[^>]*)>(?:\(devices=(?P<old_ids>{_NESTED_PARENS})\))?)"
    r"\s*\{(?P<refs>[^}]*)\}$"
)
_GROUPS_VALUE = re.compile(  # an iota or mesh replica_groups value at the start of the attributes that follow it
    rf"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    rf"|(?:mesh\[[^\]]*\](?:,\s*device_ids=\({_NESTED_PARENS}\))?|@mesh<[^>]*>(?:\({_NESTED_PARENS}\))?)\s*\{{[^}}]*\}}"
)
_AXIS_REF = re.compile(r"^(?P<name>[^:]+?)(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")


# --------------------------------------------------------------------------- reading the value


def replica_groups_text(attrs: str | Mapping[str, str]) -> str | None:
    """The replica_groups value in an instruction's attributes (their text, or `Instruction.attributes`), in any
    notation (a mesh value holds commas, spaces and braces); None when there is none. Only a top-level attribute
    counts (text quoted in metadata is none), and blanks are allowed around ``=`` and inside explicit and iota
    lists. Raises ValueError on a value it cannot delimit."""
    found = split_attributes(attrs) if isinstance(attrs, str) else attrs
    value = found.get("replica_groups")
    if value is None:
        return None
    if not value.startswith(("mesh", "@mesh")):
        value = compact(value)
    if value.startswith("{"):
        end = _closing_brace(value)
        if value[end:].strip():
            raise ValueError(f"unknown replica_groups notation {value[:80]!r}")
        return value[:end]
    match = _GROUPS_VALUE.fullmatch(value)
    if not match:
        raise ValueError(f"unknown replica_groups notation {value[:80]!r}")
    return match.group()


def _closing_brace(text: str) -> int:
    depth = 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return index + 1
    raise ValueError(f"unbalanced braces in {text[:80]!r}")


# --------------------------------------------------------------------------- notations -> groups


@functools.lru_cache(maxsize=4096)  # a program repeats the same few groups many times
def expand_replica_groups(text: str, num_devices: int | None = None) -> Groups:
    """Expand any of XLA's replica-group notations into explicit groups of device positions.

    `num_devices` is needed only for ``{}`` (all devices in one group).
    Raises ValueError on a notation it does not know.
    """
    text = text.strip()
    if text == "{}":
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices, but the device count is unknown")
        return (tuple(range(num_devices)),)
    if text.startswith("{"):
        return tuple(tuple(int(i) for i in g.split(",") if i.strip()) for g in re.findall(r"\{([^{}]*)\}", text[1:-1]))
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith(("mesh[", "@mesh<")):
        return _mesh_groups(text)
    raise ValueError(f"unknown replica_groups notation {text[:80]!r}")


def _ints(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i.strip()]


def _iota_groups(text: str) -> Groups:
    """``[G,S]<=[d0,d1,..]T(p..)``: iota reshaped to d, transposed by p, read as G groups of S."""
    match = _IOTA.match(text)
    if not match:
        raise ValueError(f"bad iota replica groups {text!r}")
    dims, reshape = _ints(match["dims"]), _ints(match["reshape"])
    perm = _ints(match["perm"]) if match["perm"] else list(range(len(reshape)))
    array = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(dims[0], -1)
    return tuple(tuple(row) for row in array.tolist())


def _mesh_groups(text: str) -> Groups:
    """Groups of a mesh-form list, computed as MeshAxesReplicaGroupList::flattened_replica_groups does."""
    match = _MESH.match(text)
    if not match:
        raise ValueError(f"bad mesh replica groups {text[:80]!r}")
    names, sizes = [], []
    for part in (match["axes"] if match["axes"] is not None else match["old_axes"]).split(","):
        name, _, size = part.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    devices = _mesh_device_ids(match["ids"], match["old_ids"], math.prod(sizes)).reshape(sizes)
    refs = []
    for part in filter(None, (p.strip() for p in match["refs"].split(","))):
        ref = _AXIS_REF.match(part)
        name = ref["name"].strip().strip("'\"") if ref else None
        if name not in names:
            raise ValueError(f"mesh replica groups name axis {part!r}, not one of {names}")
        refs.append(
            (names.index(name), int(ref["pre"]) if ref["pre"] else None, int(ref["size"]) if ref["size"] else None)
        )
    return _groups_over_axis_refs(devices, refs)


def _mesh_device_ids(ids: str | None, old_ids: str | None, count: int) -> np.ndarray:
    """The compiler mesh's device list: iota unless printed as "[4,2]T(1,0)", "8,3,7,.." or (old) "[..]<=[..]T(..)"."""
    if ids is None and old_ids is None:
        return np.arange(count)
    text = (ids if ids is not None else old_ids).strip()
    if old_ids is not None and "<=" in text:
        rest = text.partition("<=")[2]
        return np.asarray(_iota_groups(f"[1,{count}]<={rest}")).reshape(-1)
    if old_ids is not None:
        text = text.split("]", 1)[1]  # "[10]8,3,7,..": the dims, then the ids
    iota = re.match(r"^\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$", text)
    if iota:
        perm = f"T({iota['perm']})" if iota["perm"] else ""
        return np.asarray(_iota_groups(f"[1,{count}]<=[{iota['reshape']}]{perm}")).reshape(-1)
    return np.asarray(_ints(text))


def _groups_over_axis_refs(devices: np.ndarray, refs: list[tuple[int, int | None, int | None]]) -> Groups:
    """Split each referenced mesh dim into (pre, size, rest) pieces, move the grouped pieces last, read groups.

    Mirrors GetDimToReshapeAndAggregateAxes / ComputeReindexedAxes in openxla/xla
    xla/hlo/ir/replica_group.cc: a sub-axis ``(pre)size`` is the piece of size
    `size` after the `pre` major elements of its axis.
    """
    by_dim: dict[int, list[tuple[int | None, int | None]]] = defaultdict(list)
    for dim, pre, size in refs:
        by_dim[dim].append((pre, size))
    pieces: dict[int, tuple[list[int], list[int]]] = {
        d: _split_dim(devices.shape[d], parts) for d, parts in by_dim.items()
    }
    reindexed, offsets = [], []
    for dim, size in enumerate(devices.shape):
        offsets.append(len(reindexed))
        reindexed.extend(pieces[dim][0] if dim in pieces else [size])
    consumed: Counter[int] = Counter()
    grouped = []
    for dim, _, _ in refs:
        grouped.append(offsets[dim] + pieces[dim][1][consumed[dim]])
        consumed[dim] += 1
    perm = [i for i in range(len(reindexed)) if i not in grouped] + grouped
    group_size = math.prod(reindexed[g] for g in grouped)
    rows = devices.reshape(reindexed).transpose(perm).reshape(-1, group_size)
    return tuple(tuple(int(i) for i in row) for row in rows)


def _split_dim(full: int, parts: list[tuple[int | None, int | None]]) -> tuple[list[int], list[int]]:
    """Reshape dims of one mesh dim and which of them are grouped, in the refs' order."""
    if len(parts) == 1:
        pre, size = parts[0]
        return ([full], [0]) if pre is None else ([pre, size, full // (pre * size)], [1])
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])
    reshape, grouped_sorted, prefix = [], [], 1
    for i in order:
        pre, size = parts[i]
        if pre != prefix:  # the piece between the previous sub-axis and this one
            reshape.append(pre // prefix)
            prefix = pre
        grouped_sorted.append(len(reshape))
        reshape.append(size)
        prefix *= size
    if prefix != full:
        reshape.append(full // prefix)
    grouped = [0] * len(parts)
    for k, i in enumerate(order):
        grouped[i] = grouped_sorted[k]
    return reshape, grouped


# --------------------------------------------------------------------------- permutes


def groups_of_pairs(pairs: Sequence[tuple[int, int]]) -> Groups:
    """Devices linked by a permute's pairs, as groups (a ring over an axis gives that axis's groups)."""
    return _groups_of_pairs(tuple(map(tuple, pairs)))


@functools.lru_cache(maxsize=1024)  # a program's permutes repeat a few rings (each stage or step of a loop)
def _groups_of_pairs(pairs: tuple[tuple[int, int], ...]) -> Groups:
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            parent[i] = i = parent[parent[i]]  # halve the path: a ring's chain is walked once, not once a pair
        return i

    for source, target in pairs:
        parent[root(source)] = root(target)
    members: dict[int, list[int]] = defaultdict(list)
    for device in sorted(parent):
        members[root(device)].append(device)
    return tuple(sorted(tuple(m) for m in members.values()))


# --------------------------------------------------------------------------- groups -> mesh axes


def collective_axes(kind: str, groups: Groups, pairs, mesh) -> tuple[str, ...] | None:
    """The mesh axes a collective's groups span (a permute: the axes its pairs move along); None if unknown.

    `mesh` is ``(shape, axis names)``, or None when the mesh is unknown.
    """
    if mesh is None:
        return None
    shape, names = mesh
    if kind == "collective-permute":
        return _permute_axes(pairs, shape, names)
    return _cached_axes_of_groups(shape, names, groups)


@functools.lru_cache(maxsize=4096)
def _cached_axes_of_groups(shape: Shape, names: tuple[str, ...], groups: Groups) -> tuple[str, ...] | None:
    if any(i >= math.prod(shape) for g in groups for i in g):
        return None
    return axes_of_groups(shape, names, groups)


def _permute_axes(pairs, shape: Shape, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The mesh axes along which some pair moves data (coordinates of source and target differ)."""
    if not pairs or any(i >= math.prod(shape) for pair in pairs for i in pair):
        return None
    sources, targets = (np.stack(np.unravel_index([p[k] for p in pairs], shape)) for k in (0, 1))
    moved = np.any(sources != targets, axis=1)
    return tuple(name for name, used in zip(names, moved) if used)
