"""lab.hlo.text: the one HLO instruction reader: computations, instruction lines, shapes, op names."""

from lab.hlo.text import arrays, computations, nbytes, op_names, parse_instruction


def test_op_names_link_each_instruction_to_the_jax_code_that_made_it():
    text = (
        "ENTRY %main {\n"
        "  %p0 = f32[4]{0} parameter(0)\n"
        "  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=%fused, "
        'metadata={op_name="jit(step)/optimizer/mul"}\n'
        "  ROOT %all-reduce.1 = f32[4]{0} all-reduce(%fusion.3), replica_groups={}, "
        'metadata={op_name="jit(step)/forward_backward/reshard"}\n'
        "}\n"
    )
    assert op_names(text) == {
        "fusion.3": ("fusion", "jit(step)/optimizer/mul"),
        "all-reduce.1": ("all-reduce", "jit(step)/forward_backward/reshard"),
    }


def test_one_reader_for_every_form_of_an_instruction_line():
    line = (
        "  ROOT %fusion.2 = (f32[8,4]{1,0}, bf16[2]{0}) fusion(f32[8,4]{1,0} %p0, /*index=1*/%p1), kind=kLoop, "
        'calls=%fused.2, metadata={op_name="jit(f)/mul"}'
    )
    fusion = parse_instruction(line, "main", 7)
    assert (fusion.name, fusion.opcode, fusion.operands, fusion.callees) == (
        "fusion.2",
        "fusion",
        ("p0", "p1"),
        ("fused.2",),
    )
    assert (fusion.computation, fusion.line_number) == ("main", 7) and fusion.attr(r"kind=(k\w+)") == "kLoop"
    assert arrays(fusion.shape) == [("f32", (8, 4)), ("bf16", (2,))]
    # a literal in the parentheses is no operand; a while loop calls its body
    assert parse_instruction("  %c = f32[] constant(0.1)").operands == ()
    loop = parse_instruction("  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body")
    assert loop.operands == ("t",) and loop.callees == ("body",)
    assert parse_instruction("this mentions all-reduce but is no instruction") is None


def test_bytes_round_sub_byte_types_up_and_read_bounded_dims():
    assert nbytes(arrays("(s4[3]{0}, pred[2]{0}, token[])")) == 2 + 2
    assert arrays("f32[<=8,4]{1,0}") == [("f32", (8, 4))]


def test_computations_keep_printed_order_and_find_the_entry():
    text = (
        "HloModule m, num_partitions=2\n\n%add (a: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n}\n\n"
        "ENTRY %main () -> f32[] {\n  %x = f32[] constant(1)\n  ROOT %y = f32[] negate(%x)\n}\n"
    )
    found = computations(text)
    assert [(c.name, c.is_entry, [n for n, _ in c.instruction_lines()]) for c in found] == [
        ("add", False, [4]),
        ("main", True, [8, 9]),
    ]
    assert [(c.name, len(list(c.instruction_lines()))) for c in computations("  %a = f32[] parameter(0)\n")] == [
        ("", 1)
    ]
