"""A while loop's trip count: XLA's own where it wrote one, else the bound its condition compares a counter with."""

from lab.hlo import parse_collectives
from lab.hlo.loops import trip_count
from lab.hlo.text import parse_instruction

# libtpu's scan over 4 layers: no known_trip_count in the while's backend config, the bound in its condition
TPU_SCAN = """HloModule jit_step, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %constant.81 = s32[]{:T(128)} constant(4)
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt.13 = pred[] compare(%i, %constant.81), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %r = f32[8] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]) tuple(%j, %r)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %x)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8] get-tuple-element(%w), index=1
}
"""


def _loop(attributes: str = ""):
    return parse_instruction(f"  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body{attributes}", "e", 1)


def _condition(bound: str):
    lines = [
        "%c = s32[] constant(4)",
        "%i = s32[] parameter(0)",
        f"ROOT %lt = pred[] compare(%i, {bound}), direction=LT",
    ]
    return [parse_instruction(f"  {line}", "cond", n) for n, line in enumerate(lines)]


def test_xla_s_known_trip_count_comes_first():
    assert trip_count(_loop(', backend_config={"known_trip_count":{"n":"12"}}'), _condition("%c")) == 12


def test_a_counter_below_a_constant_runs_that_many_times():
    assert trip_count(_loop(), _condition("%c")) == 4


def test_a_bound_passed_in_is_unknown():
    assert trip_count(_loop(), _condition("%n")) is None


def test_a_collective_in_a_tpu_scan_runs_once_per_layer():
    (collective,), skipped = parse_collectives(TPU_SCAN, (2,), ("data",))
    assert not skipped and (collective.axes, collective.repeats) == (("data",), 4)
