"""The HLO text XLA's parser accepts, read as XLA reads it: every snippet written from the syntax of
openxla/xla xla/hlo/parser/hlo_parser.cc and the printer (hlo_instruction.cc, hlo_op_metadata.cc).

Printed text is one instruction per line; the parser reads tokens, so an
instruction may run over lines, a module may be indented, blanks may stand
anywhere between tokens, names and operands may lack their ``%``, operands may
carry shapes, and quoted metadata may hold any text, C-escaped. Also: the
collectives real dumps write that the printer's own tests show (combined tuples
with scalars, in-place permutes, XLA:GPU's pipelined send/recv).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.hlo import parse_collectives
from lab.hlo.text import computations, module_devices, parse_instruction
from tests.hlo.support import DATA, module

ADD = (
    "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
    "  ROOT %s = f32[] add(%x, %y)\n}\n"
)


def one(text: str, mesh=(2, 2), names=("x", "y")):
    (collective,), skipped = parse_collectives(text, mesh, names)
    assert skipped == ()
    return collective


# --------------------------------------------------------------------------- 1. combined tuples with a scalar


def test_combined_all_gather_and_reduce_scatter_with_a_scalar_member():
    gather = one(
        module(
            "%ag = (f32[], f32[8,4]{1,0}) all-gather(%s, %p), replica_groups={{0,1},{2,3}}, dimensions={0}", devices=4
        )
    )
    assert (gather.kind, gather.combined, gather.axes) == ("all-gather", True, ("y",))
    assert (gather.operand_shapes, gather.result_shapes) == (((), (4, 4)), ((), (8, 4)))
    assert gather.size_bytes == 4 + 8 * 4 * 4
    scatter = one(
        module(
            "%rs = (f32[4]{0}, bf16[]) reduce-scatter(%p, %s), replica_groups={{0,2},{1,3}}, dimensions={0}, "
            "to_apply=%add",
            devices=4,
        )
    )
    assert (scatter.operand_shapes, scatter.result_shapes, scatter.axes) == (((8,), ()), ((4,), ()), ("x",))
    assert scatter.size_bytes == 8 * 4 + 2


# --------------------------------------------------------------------------- 2. in-place collective-permute


def test_in_place_permute_is_sized_by_the_slices_it_sends():
    text = module(
        "%cp = f32[128,128]{0,1} collective-permute(%in, %out, %t1, %t2), source_target_pairs={{0,1},{1,2},{2,3}}, "
        "slice_sizes={{128,32}}",
        devices=4,
    )
    permute = one(text, (4,), ("x",))
    assert (permute.operand_shapes, permute.result_shapes) == (((128, 32),), ((128, 128),))
    assert permute.size_bytes == 128 * 32 * 4 and permute.source_target_pairs == ((0, 1), (1, 2), (2, 3))
    tuple_form = one(
        module(
            "%cp = (u32[2,8,128]{2,1,0}, u32[4,8,128]{2,1,0}) collective-permute(%ti, %to, %t8, %t9), "
            "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, slice_sizes={{1,8,128},{1,8,128},{2,8,128},{2,8,128}}",
            devices=4,
        ),
        (4,),
        ("x",),
    )
    assert tuple_form.size_bytes == (2 * 1 + 2 * 2) * 8 * 128 * 4
    started = one(
        module(
            "%cps = (f32[128,32]{0,1}, f32[128,128]{0,1}, u32[], u32[]) collective-permute-start(%in, %out, %t1, %t2), "
            "source_target_pairs={{0,1},{1,2},{2,3}}, slice_sizes={{64,32}}",
            "%cpd = f32[128,128]{0,1} collective-permute-done(%cps)",
            devices=4,
        ),
        (4,),
        ("x",),
    )
    assert started.is_async and started.size_bytes == 64 * 32 * 4
    plain = one(module("%cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}"), (8,), ("x",))
    assert plain.size_bytes == 8 * 4  # without slice_sizes: the operand, as before


# --------------------------------------------------------------------------- 3. XLA:GPU's pipelined send/recv

PIPELINED = (
    "HloModule pipelined, num_partitions=4\n\n"
    "%cond (c: (s32[], f32[16])) -> pred[] {\n  %c = (s32[], f32[16]) parameter(0)\n"
    "  %i = s32[] get-tuple-element(%c), index=0\n  %n = s32[] constant(3)\n"
    "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n\n"
    "%body (b: (s32[], f32[16])) -> (s32[], f32[16]) {\n  %b = (s32[], f32[16]) parameter(0)\n"
    "  %data = f32[16]{0} get-tuple-element(%b), index=1\n  %after-all = token[] after-all()\n"
    "  %recv = (f32[16]{0}, u32[], token[]) recv(%after-all), channel_id=2, frontend_attributes={\n"
    '    _xla_send_recv_source_target_pairs="{{0, 1}, {1, 2}, {2, 3}}"\n  }\n'
    "  %send = (f32[16]{0}, u32[], token[]) send(%data, %after-all), channel_id=2, control-predecessors={%recv}, "
    'frontend_attributes={_xla_send_recv_pipeline="0",_xla_send_recv_source_target_pairs={{0,1},{1,2},{2,3}}}, '
    'metadata={op_name="jit(step)/ppermute" source_file="model.py" source_line=42}\n'
    "  %recv-done = (f32[16]{0}, token[]) recv-done(%recv), channel_id=2\n"
    "  %send-done = token[] send-done(%send), channel_id=2\n"
    "  %got = f32[16]{0} get-tuple-element(%recv-done), index=0\n  %i = s32[] get-tuple-element(%b), index=0\n"
    "  ROOT %t = (s32[], f32[16]) tuple(%i, %got)\n}\n\n"
    "ENTRY %main (p: f32[16]) -> (s32[], f32[16]) {\n  %p = f32[16]{0} parameter(0)\n  %z = s32[] constant(0)\n"
    "  %init = (s32[], f32[16]) tuple(%z, %p)\n"
    "  ROOT %w = (s32[], f32[16]) while(%init), condition=%cond, body=%body, "
    'backend_config={"known_trip_count":{"n":"3"}}\n'
    "}\n"
)


def test_send_recv_pair_is_one_collective_permute():
    permute = one(PIPELINED, (4,), ("x",))
    assert (permute.kind, permute.form, permute.name, permute.is_async) == (
        "collective-permute",
        "send/recv",
        "send",
        True,
    )
    assert permute.source_target_pairs == ((0, 1), (1, 2), (2, 3)) and permute.axes == ("x",)
    assert (permute.operand_shapes, permute.size_bytes, permute.repeats) == (((16,),), 16 * 4, 3)
    assert (permute.op_name, permute.source_file, permute.source_line) == ("jit(step)/ppermute", "model.py", 42)


def test_send_recv_pairs_only_in_the_recv_and_what_cannot_be_read_is_skipped():
    only_recv = PIPELINED.replace(
        'frontend_attributes={_xla_send_recv_pipeline="0",_xla_send_recv_source_target_pairs={{0,1},{1,2},{2,3}}}, ', ""
    )
    assert one(only_recv, (4,), ("x",)).source_target_pairs == ((0, 1), (1, 2), (2, 3))
    text = module(
        "%tok = token[] after-all()",
        "%s1 = (f32[8]{0}, u32[], token[]) send(%p, %tok), channel_id=5",
        "%r1 = (f32[8]{0}, u32[], token[]) recv(%tok), channel_id=5",
        "%s2 = (f32[8]{0}, u32[], token[]) send(%p, %tok), channel_id=6, is_host_transfer=true",
        "%s3 = (f32[8]{0}, u32[], token[]) send(%p, %tok), channel_id=7, "
        'frontend_attributes={_xla_send_recv_source_target_pairs="{{0,1}}"}',
        devices=4,
    )
    collectives, skipped = parse_collectives(text, (4,), ("x",))
    assert collectives == ()
    reasons = " | ".join(s.reason for s in skipped)
    assert len(skipped) == 3 and all(s.line_number > 0 for s in skipped)
    for expected in (
        "host transfer",
        "without a matching recv on channel_id=7",
        "without _xla_send_recv_source_target",
    ):
        assert expected in reasons


def test_a_dcn_all_reduce_handed_to_the_megascale_runtime_is_one_collective_across_slices():
    # libtpu's form on several slices: the data goes out as a host send, the sum comes back through the recv of
    # the same rendezvous; the schedule waits at the recv-done
    attrs = (
        'frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
        '_xla_host_transfer_rendezvous="all-reduce.40_0",_xla_megascale_reduce_operation="SUM",'
        '_xla_megascale_transfer_type="ALL_REDUCE"}'
    )
    text = module(
        "%tok = token[] after-all()",
        f"%s = (bf16[17,8,128]{{2,1,0}}, u32[], token[]) send(%p, %tok), channel_id=4, is_host_transfer=true, {attrs}",
        f"%r = (bf16[17,8,128]{{2,1,0}}, u32[], token[]) recv(%tok), channel_id=3, is_host_transfer=true, {attrs}",
        "%sd = token[] send-done(%s), channel_id=4, is_host_transfer=true",
        "%rd = (bf16[17,8,128]{2,1,0}, token[]) recv-done(%r), channel_id=3, is_host_transfer=true",
        devices=4,
    )
    collectives, skipped = parse_collectives(text, (4,), ("x",))
    assert skipped == () and len(collectives) == 1
    c = collectives[0]
    assert (c.kind, c.across_slices, c.done, c.is_async) == ("all-reduce", True, "rd", True)
    assert c.size_bytes == 17 * 8 * 128 * 2 and c.axes is None and c.replica_groups == ()


# --------------------------------------------------------------------------- 4. what the parser accepts


def test_an_instruction_continued_over_lines_keeps_its_groups():
    text = module(
        "%ar = f32[8]{0} all-reduce(%p),",
        "    replica_groups={",
        "      {0,2},",
        "      {1,3}",
        "    }, to_apply=%add,",
        '    metadata={op_name="jit(f)/psum"',
        '      source_file="f.py" source_line=7}',
        "%next = f32[8]{0} add(%ar, %ar)",
        devices=4,
    )
    reduce = one(text)
    assert (reduce.replica_groups, reduce.axes, reduce.op_name, reduce.source_line) == (
        ((0, 2), (1, 3)),
        ("x",),
        "jit(f)/psum",
        7,
    )
    (entry,) = computations(text)
    assert [number for number, _ in entry.instruction_lines()] == [4, 11]  # a statement is numbered by its first line


def test_an_indented_module_keeps_its_loop_trip_count():
    text = (DATA / "cpu_scan_fsdp.hlo").read_text()
    indented = "\n".join(f"    {line}" if line else line for line in text.splitlines())
    before, _ = parse_collectives(text, (1, 1, 8, 1, 1))
    after, skipped = parse_collectives(indented, (1, 1, 8, 1, 1))
    assert skipped == () and {c.repeats for c in after} == {4}
    assert [dataclasses.replace(c) for c in after] == list(before)
    assert module_devices(indented) == 8


def test_blanks_around_equals_and_inside_shapes_and_lists():
    spaced = one(
        module(
            "ROOT  %ag  =  (f32[ 8, 4 ]{ 1, 0 }, f32[])  all-gather ( %p , %s ) , replica_groups = { {0,2}, {1,3} } , "
            "dimensions = { 0 }, channel_id = 1",
            devices=4,
        )
    )
    assert (spaced.replica_groups, spaced.axes, spaced.result_shapes, spaced.operand_shapes) == (
        ((0, 2), (1, 3)),
        ("x",),
        ((8, 4), ()),
        ((4, 4), ()),
    )
    iota = one(module("%ar = f32[8]{0} all-reduce(%p), replica_groups = [2, 2]<=[4], to_apply = %add", devices=4))
    assert iota.replica_groups == ((0, 1), (2, 3))
    assert module_devices("  HloModule m, num_partitions = 4, replica_count = 2\n") == 8


def test_operands_without_percent_and_with_shapes():
    typed = parse_instruction("  ar = f32[8]{0} all-reduce(f32[8]{0} p), replica_groups={}, to_apply=add")
    assert (typed.name, typed.operands, typed.callees) == ("ar", ("p",), ("add",))
    assert parse_instruction("ROOT ar = f32[8] all-reduce(p), to_apply=add").operands == ("p",)
    layouts = parse_instruction("%f = f32[8,4]{1,0} fusion(f32[8,4]{1,0} %a, (f32[], s32[2]{0}) b), calls=%c")
    assert layouts.operands == ("a", "b")
    text = (
        "HloModule m, num_partitions=2\n\nENTRY main {\n  p = f32[8] parameter(0)\n"
        "  ROOT ar = f32[8] all-reduce(p), replica_groups={{0,1}}, to_apply=add\n}\n"
    )
    assert one(text, (2,), ("x",)).axes == ("x",)


def test_attribute_text_inside_quoted_metadata_is_no_attribute():
    reduce = one(
        module(
            '%ar = f32[8]{0} all-reduce(%p), metadata={op_name="replica_groups={{0}}, dimensions={3}, to_apply=%x"}, '
            "replica_groups={{0,1},{2,3}}, to_apply=%add",
            devices=4,
        )
    )
    assert (
        reduce.replica_groups == ((0, 1), (2, 3))
        and reduce.op_name == "replica_groups={{0}}, dimensions={3}, to_apply=%x"
    )
    fusion = parse_instruction(
        '%f = f32[8] fusion(%p), kind=kLoop, metadata={op_name="calls=%evil body=%worse"}, calls=%c'
    )
    assert fusion.callees == ("c",) and fusion.attr(r"kind=(k\w+)") == "kLoop"


def test_escaped_quotes_in_op_name_are_read_whole():
    reduce = one(
        module(
            r'%ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_type="Psum" '
            r'op_name="jit(f)/\"x\"/psum \\ \303\251" source_file="a \"b\".py" source_line=3 source_end_line=4 '
            r"stack_frame_id=9}",
            devices=4,
        )
    )
    assert (reduce.op_name, reduce.source_file, reduce.source_line) == ('jit(f)/"x"/psum \\ é', 'a "b".py', 3)


def test_what_cannot_be_read_is_skipped_with_a_reason():
    text = module(
        '%ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, metadata={op_name="never closed}',
        "%ok = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add",
        "%bad = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}} junk, to_apply=%add",
        devices=4,
    )
    collectives, skipped = parse_collectives(text, (2, 2), ("x", "y"))
    assert [c.name for c in collectives] == ["ok"]
    assert ["never closed" in skipped[0].reason or "cut" in skipped[0].reason, "replica_groups" in skipped[1].reason]
    assert all(skipped[0].reason for _ in skipped) and len(skipped) == 2


# --------------------------------------------------------------------------- 5. metadata and source locations


def test_instruction_metadata_holds_everything_xla_prints():
    instruction = parse_instruction(
        '%x = f32[8] negate(%p), metadata={op_type="Neg" op_name="jit(f)/neg" source_file="f.py" source_line=3 '
        "source_end_line=5 source_column=2 stack_frame_id=7 profile_type={1,2}}"
    )
    assert instruction.metadata == {
        "op_type": "Neg",
        "op_name": "jit(f)/neg",
        "source_file": "f.py",
        "source_line": 3,
        "source_end_line": 5,
        "source_column": 2,
        "stack_frame_id": 7,
        "profile_type": "{1,2}",
    }
    assert parse_instruction("%y = f32[8] negate(%p)").metadata == {
        "op_name": None,
        "source_file": None,
        "source_line": None,
    }


def test_async_pairs_and_fusions_carry_the_source_of_the_instruction_that_holds_them():
    text = (
        "HloModule m, num_partitions=4\n\n"
        + ADD
        + "\n%fused (p: f32[16]) -> f32[16] {\n  %p = f32[16]{0} parameter(0)\n"
        "  ROOT %ar = f32[16]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add\n}\n\n"
        "ENTRY %main (a: f32[16]) -> f32[16] {\n  %a = f32[16]{0} parameter(0)\n"
        "  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%a), replica_groups={{0,1,2,3}}, dimensions={0}, "
        'metadata={op_name="jit(f)/all_gather" source_file="start.py" source_line=1}\n'
        "  %agd = f32[64]{0} all-gather-done(%ags), "
        'metadata={op_name="jit(f)/done" source_file="done.py" source_line=2}\n'
        '  ROOT %f = f32[16]{0} fusion(%a), kind=kCustom, calls=%fused, metadata={op_name="jit(f)/fused" '
        'source_file="fusion.py" source_line=3}\n}\n'
    )
    collectives, skipped = parse_collectives(text, (4,), ("x",))
    assert skipped == ()
    assert {c.kind: (c.op_name, c.source_file, c.source_line) for c in collectives} == {
        "all-gather": ("jit(f)/all_gather", "start.py", 1),
        "all-reduce": ("jit(f)/fused", "fusion.py", 3),
    }


# --------------------------------------------------------------------------- 6. properties: blanks, breaks, quotes

# one instruction as tokens; a blank may stand between any two, a line break after one that leaves it open
PIECES = (
    *("%ag.3", "=", "(", "f32[8,4]{1,0}", ",", "bf16[16]{0}", ")", "all-gather", "(", "%p.1", ",", "%q", ")", ","),
    *("channel_id", "=", "3", ",", "replica_groups", "=", "{", "{0,2}", ",", "{1,3}", "}", ",", "dimensions", "="),
    *("{0}", ",", "use_global_device_ids=true", ",", "metadata", "=", "{", 'op_name="jit(f)/all_gather"'),
    *(" ", "source_line=12", "}"),
)
OPENING = set(",({=")


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_same_instruction_with_any_blanks_indentation_and_breaks_parses_the_same(data):
    expected = one(module("".join(PIECES), devices=4))
    pieces = [data.draw(st.sampled_from(["", "  ", "\t", "    "]))]
    for piece in PIECES:
        pieces.append(piece)
        gap = data.draw(st.sampled_from(["", " ", "  ", "\t"]))
        if piece[-1] in OPENING and data.draw(st.booleans()):
            gap += "\n" + data.draw(st.sampled_from(["", "  ", "\t\t", "      "]))
        pieces.append(gap)
    indent = data.draw(st.sampled_from(["", "  ", "\t"]))
    text = "".join(pieces)
    hlo = f"{indent}HloModule t, num_partitions=4\n\n{indent}ENTRY %main (p: f32[8]) -> f32[8] {{\n{text}\n{indent}}}\n"
    got = one(hlo)
    assert dataclasses.replace(got, form=expected.form) == dataclasses.replace(expected, form=expected.form)


def _c_escape(text: str) -> str:
    """absl::CEscape, as XLA's printer escapes metadata strings."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return "".join(out)


@settings(max_examples=40, deadline=None)
@given(
    op_name=st.lists(
        st.sampled_from([*'ab/()[]{}=,"\\ %\n', "é", "replica_groups={{0}}"]), min_size=1, max_size=30
    ).map("".join),  # XLA prints no empty op_name
    source_file=st.text(alphabet=st.sampled_from(list('xy.=,{}"\\ ')), min_size=1, max_size=12),
    split=st.booleans(),
)
def test_quoted_metadata_with_quotes_escapes_braces_equals_and_commas_reads_back(op_name, source_file, split):
    metadata = f'metadata={{op_name="{_c_escape(op_name)}" source_file="{_c_escape(source_file)}" source_line=5}}'
    line = f"%ar = f32[8]{{0}} all-reduce(%p), {metadata}, replica_groups={{{{0,1}},{{2,3}}}}, to_apply=%add"
    if split:  # break after the metadata: only a reader that skips strings sees its braces as balanced
        line = line.replace(", replica_groups", ",\n    replica_groups")
    reduce = one(module(line, devices=4))
    assert (reduce.op_name, reduce.source_file, reduce.source_line) == (op_name, source_file, 5)
    assert reduce.replica_groups == ((0, 1), (2, 3)) and reduce.axes == ("y",)


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.hlo")))
def test_every_recorded_module_reads_the_same_when_reindented_and_respaced(name):
    text = (DATA / name).read_text()
    respaced = "\n".join(
        "  " + line.replace(", ", " ,  ") if line.startswith(("  ", "ENTRY", "%", "}")) else line
        for line in text.splitlines()
    )
    before, skipped_before = parse_collectives(text)
    after, skipped_after = parse_collectives(respaced)
    assert len(skipped_after) == len(skipped_before)
    assert [(c.kind, c.replica_groups, c.size_bytes, c.op_name, c.repeats) for c in after] == [
        (c.kind, c.replica_groups, c.size_bytes, c.op_name, c.repeats) for c in before
    ]
