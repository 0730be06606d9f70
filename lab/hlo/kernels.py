"""Communication XLA did not insert: kernels that send to other devices themselves.

A Pallas TPU kernel may copy to other devices by remote DMA
(``pltpu.make_async_remote_copy``): a ppermute, an all-gather or a
reduce-scatter written by hand, a collective matmul's ring. XLA sees one
``tpu_custom_call``; it marks it ``"has_communication": true`` in the backend
config and names the mesh axes the kernel addresses in its frontend
attributes (``kernel_metadata={"mesh_axes": ...}``). Its Mosaic body (the
module `lab.hlo.mosaic` decodes) names the kernel function and holds each
copy it issues: a ``tpu.enqueue_dma`` given a device id sends its source
buffer to that device. How often each runs (the grid, the kernel's own loops,
which device) is decided when it runs, so such a kernel is listed beside the
collectives (its function, its line, its axes, the bytes each remote copy
sends) and is neither counted among them nor priced.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

from lab.hlo.text import Instruction, arrays, bits, computations, nbytes, parse_instruction

_COMMUNICATES = '"has_communication":true'
_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]*)"')
_DEVICE_ID = 4  # enqueue_dma's operands: source, its semaphore, target, its semaphore, device id, core id


@dataclass(frozen=True)
class Kernel:
    """One custom call that communicates by itself."""

    instruction: Instruction
    axes: tuple[str, ...]  # the mesh axes it addresses, as its kernel metadata names them; () when not named
    operand_bytes: int
    result_bytes: int
    function: str | None = None  # the kernel function's name, from its Mosaic body
    remote_copies: tuple[int, ...] = ()  # bytes each remote DMA in its code sends, once per time it runs

    @property
    def name(self) -> str:
        return self.instruction.name

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "op_name": self.instruction.metadata.get("op_name"),
            "axes": list(self.axes),
            "operand_bytes": self.operand_bytes,
            "result_bytes": self.result_bytes,
            "function": self.function,
            "remote_copies": list(self.remote_copies),
        }


def communicating_kernels(hlo_text: str) -> Iterator[Kernel]:
    """Every custom call of the module whose backend config says it communicates, in printed order."""
    for computation in computations(hlo_text):
        shapes: dict[str, str] = {}
        for number, statement in computation.instruction_lines():
            instruction = parse_instruction(statement, computation.name, number)
            if instruction is None:
                continue
            shapes[instruction.name] = instruction.shape
            if instruction.opcode == "custom-call" and _COMMUNICATES in instruction.line.replace(" ", ""):
                taken = sum(nbytes(arrays(shapes.get(o, ""))) for o in instruction.operands)
                body = _BODY.search(instruction.attrs)
                function, copies = _remote_copies(body.group(1)) if body else (None, ())
                made = nbytes(arrays(instruction.shape))
                yield Kernel(instruction, _mesh_axes(instruction), taken, made, function, copies)


def _mesh_axes(instruction: Instruction) -> tuple[str, ...]:
    """The axes in ``kernel_metadata={"mesh_axes": "[\\"data\\"]"}``, Pallas's record of the mesh it addresses."""
    try:
        metadata = json.loads(instruction.frontend_attributes.get("kernel_metadata", "{}"))
        return tuple(json.loads(metadata.get("mesh_axes", "[]")))
    except (json.JSONDecodeError, AttributeError, TypeError):
        return ()


@functools.lru_cache(maxsize=64)
def _remote_copies(body: str) -> tuple[str | None, tuple[int, ...]]:
    """(The kernel function's name, the bytes of each DMA in it that names a device) of a Mosaic body; (None, ())
    where this jaxlib cannot read it."""
    with ir.Context() as context, ir.Location.unknown():
        context.allow_unregistered_dialects = True
        tpu.register_dialect(context)
        try:
            module = ir.Module.parse(base64.b64decode(body))
        except (ValueError, ir.MLIRError):
            return None, ()
        for function in module.body.operations:
            name = ir.StringAttr(function.attributes["sym_name"]).value if "sym_name" in function.attributes else None
            copies = tuple(_sent(op) for op in _operations(function.operation) if _is_remote_copy(op))
            return name, copies
    return None, ()


def _operations(op) -> Iterator:
    """Every operation nested in `op`'s regions, loops' bodies included."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _operations(inner.operation)


def _is_remote_copy(op) -> bool:
    if not op.operation.name.endswith("tpu.enqueue_dma") or "operandSegmentSizes" not in op.attributes:
        return False
    segments = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    return len(segments) > _DEVICE_ID and segments[_DEVICE_ID] > 0


def _sent(op) -> int:
    """Bytes of the buffer a DMA copies (its source)."""
    source = ir.MemRefType(op.operands[0].type)
    return math.prod(source.shape) * bits(str(source.element_type)) // 8
