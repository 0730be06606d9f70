"""The op-by-op pricing's byte count on hand-written scheduled HLO: what a fusion reads of a stacked buffer."""

from lab.hlo.schedule import parse_schedule
from lab.predict.ops import op_bytes

# A layer's slice of a stack saved for the backward pass, the way the TPU compiler writes it when the saved tiling
# differs from the one the reader wants: a nested copy fusion relays the whole stack out, then the slice is taken.
# Inside one fusion nothing is materialized: the kernel reads the slice.
STACK_READ = """HloModule m, is_scheduled=true

%copy_fusion (input: bf16[8,4,128]) -> bf16[8,4,128] {
  %input = bf16[8,4,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %copy = bf16[8,4,128]{2,1,0:T(8,128)(2,1)} copy(%input)
}

%fused (p0: bf16[8,4,128], p1: s32[], p2: bf16[4,128]) -> bf16[4,128] {
  %p0 = bf16[8,4,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %relaid = bf16[8,4,128]{2,1,0:T(8,128)(2,1)} fusion(%p0), kind=kLoop, calls=%copy_fusion
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %slice = bf16[1,4,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%relaid, %p1, %zero, %zero), dynamic_slice_sizes={1,4,128}
  %layer = bf16[4,128]{1,0:T(8,128)(2,1)} bitcast(%slice)
  %p2 = bf16[4,128]{1,0:T(8,128)(2,1)} parameter(2)
  ROOT %add = bf16[4,128]{1,0:T(8,128)(2,1)} add(%layer, %p2)
}

ENTRY %main (stack: bf16[8,4,128], i: s32[], x: bf16[4,128]) -> bf16[4,128] {
  %stack = bf16[8,4,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[4,128]{1,0:T(8,128)(2,1)} parameter(2)
  ROOT %f = bf16[4,128]{1,0:T(8,128)(2,1)} fusion(%stack, %i, %x), kind=kLoop, calls=%fused
}
"""


def test_a_fusion_reads_the_slice_of_a_relaid_stack_and_its_index_once():
    schedule = parse_schedule(STACK_READ)
    fusion = next(i for i in schedule.computations["main"] if i.name == "f")
    layer = 4 * 128 * 2
    # the slice (not the 8-layer stack), the 4-byte index (not a slice's worth), the addend, the output
    assert op_bytes(schedule, "main", fusion) == layer + 4 + layer + layer
    # an elementwise op over the whole stack does read all of it
    whole = STACK_READ.replace("fusion(%p0), kind=kLoop, calls=%copy_fusion", "negate(%p0)")
    schedule = parse_schedule(whole)
    fusion = next(i for i in schedule.computations["main"] if i.name == "f")
    assert op_bytes(schedule, "main", fusion) == 8 * layer + 4 + layer + layer
