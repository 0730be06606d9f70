"""A Pallas TPU kernel as its custom call carries it: the grid it runs and the block each operand moves.

On TPU, ``pallas_call`` lowers to one ``tpu_custom_call`` whose backend config
holds the kernel's Mosaic module: MLIR bytecode, in base64, under ``"body"``.
Its kernel function says how the kernel runs, which the operands' shapes do not:

* ``iteration_bounds``: the grid, one bound per dimension; a bound known only
  when it runs (megablox's count of row tiles to visit) is written as the
  smallest int64, read here as None;
* ``window_params``: for each array operand and result, in the kernel's order,
  the block (``window_bounds``) one grid step moves into VMEM and computes on.

A kernel's work follows from those: megablox's grouped matmul multiplies whole
(tm, tk) x (tk, tn) blocks at every grid step, where k or n is not a multiple
of its tile too (the remainder is masked to zero, not skipped), and its
backward reuses the forward's tiles with k and n swapped.

Decoding needs jaxlib's MLIR bindings and the TPU dialect (both ship with
every jaxlib); a body they cannot read is reported as None, never guessed.
"""

from __future__ import annotations

import base64
import functools
import re
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]*)"')


@dataclass(frozen=True)
class Kernel:
    """A Mosaic kernel's grid (None: a bound known only at run time) and the block of each windowed operand."""

    grid: tuple[int | None, ...]
    blocks: tuple[tuple[int, ...], ...]


def kernel(attrs: str) -> Kernel | None:
    """The kernel of a ``tpu_custom_call`` from its attributes as written (`lab.hlo.text.Instruction.attrs`), or
    None when it carries no Mosaic body this jaxlib can read."""
    body = _BODY.search(attrs)
    return _decode(body.group(1)) if body else None


@functools.lru_cache(maxsize=512)  # a scanned model calls each kernel from many places
def _decode(body: str) -> Kernel | None:
    with ir.Context() as context, ir.Location.unknown():
        context.allow_unregistered_dialects = True
        tpu.register_dialect(context)
        try:
            module = ir.Module.parse(base64.b64decode(body))
        except (ValueError, ir.MLIRError):
            return None
        for op in module.body.operations:
            attributes = op.attributes
            if "iteration_bounds" not in attributes or "window_params" not in attributes:
                continue
            grid = tuple(b if b >= 0 else None for b in ir.DenseI64ArrayAttr(attributes["iteration_bounds"]))
            windows = [ir.DictAttr(w) for w in ir.ArrayAttr(attributes["window_params"])]
            blocks = tuple(tuple(ir.DenseI64ArrayAttr(w["window_bounds"])) for w in windows if "window_bounds" in w)
            return Kernel(grid, blocks)
    return None
