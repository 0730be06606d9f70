"""Communication XLA did not insert: kernels that send to other devices themselves.

A Pallas TPU kernel may copy to other devices by remote DMA
(``pltpu.make_async_remote_copy``): a ppermute, an all-gather or a
reduce-scatter written by hand, a collective matmul's ring. XLA sees one
``tpu_custom_call``; it marks it ``"has_communication": true`` in the backend
config and names the mesh axes the kernel addresses in its frontend
attributes (``kernel_metadata={"mesh_axes": ...}``). What the kernel sends is
in its serialized Mosaic body, which the lab does not read, so such a kernel
is listed beside the collectives (its name, its line, its axes, the bytes it
takes and makes) and is neither counted among them nor priced.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from lab.hlo.text import Instruction, arrays, computations, nbytes, parse_instruction

_COMMUNICATES = '"has_communication":true'


@dataclass(frozen=True)
class Kernel:
    """One custom call that communicates by itself."""

    instruction: Instruction
    axes: tuple[str, ...]  # the mesh axes it addresses, as its kernel metadata names them; () when not named
    operand_bytes: int
    result_bytes: int

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
                yield Kernel(instruction, _mesh_axes(instruction), taken, nbytes(arrays(instruction.shape)))


def _mesh_axes(instruction: Instruction) -> tuple[str, ...]:
    """The axes in ``kernel_metadata={"mesh_axes": "[\\"data\\"]"}``, Pallas's record of the mesh it addresses."""
    try:
        metadata = json.loads(instruction.frontend_attributes.get("kernel_metadata", "{}"))
        return tuple(json.loads(metadata.get("mesh_axes", "[]")))
    except (json.JSONDecodeError, AttributeError, TypeError):
        return ()
