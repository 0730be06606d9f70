"""Damaged or odd HLO text: refused in one line when it cannot be a whole module, read through when it only looks odd.

Each case is a file a user could hand to ``lab inspect --hlo``: one cut while
copied, one saved by an editor with a byte-order mark, a header edited to
zero devices, and a collective over an axis of size 1.
"""

import json
from pathlib import Path

import pytest

from lab.cli import main
from lab.hlo import text as hlo_text
from lab.hlo.collectives import parse_collectives

DATA = Path(__file__).parents[1] / "data" / "hlo"
SIXTEEN = DATA / "tpu_v5e_4x4_shard_map_primitives.hlo"  # a 16-partition module

SINGLETONS = """HloModule jit_f, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[512,512]) -> f32[512,512] {
  %p = f32[512,512]{1,0} parameter(0)
  ROOT %ar = f32[512,512]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0},{1},{2},{3}}, to_apply=%add
}
"""


def _refused(capsys, path: Path, *mesh: str) -> str:
    assert main(["inspect", "--hlo", str(path), *mesh]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("cut_at", ["replica_groups={{0,4},{1,", "ENTRY %", "\n}\n\nENTRY"])
def test_a_module_cut_short_is_refused_not_read_as_fewer_collectives(capsys, tmp_path, cut_at):
    text = SIXTEEN.read_text()
    cut = tmp_path / "cut.hlo"
    cut.write_text(text[: text.index(cut_at) + len(cut_at)])
    err = _refused(capsys, cut, "--mesh", "fsdp=4,tensor=4")
    assert "no whole HLO module" in err and ("stops inside" in err or "no ENTRY" in err)


def test_the_whole_module_is_not_damaged():
    for path in DATA.glob("*.hlo"):
        assert hlo_text.damage(path.read_text()) is None, path.name


def test_a_header_with_zero_partitions_is_refused(capsys, tmp_path):
    path = tmp_path / "zero.hlo"
    path.write_text(SIXTEEN.read_text().replace("num_partitions=16", "num_partitions=0", 1))
    assert "num_partitions=0" in _refused(capsys, path, "--mesh", "fsdp=2,tensor=2")


def test_a_byte_order_mark_hides_neither_the_header_nor_the_device_count(capsys, tmp_path):
    path = tmp_path / "bom.hlo"
    path.write_bytes(b"\xef\xbb\xbf" + SIXTEEN.read_bytes())
    assert "runs on 16 devices" in _refused(capsys, path, "--mesh", "fsdp=2,tensor=2")
    read = []
    for file in (path, SIXTEEN):
        assert main(["inspect", "--hlo", str(file), "--mesh", "fsdp=4,tensor=4", "--json"]) == 0
        read.append(json.loads(capsys.readouterr().out))
    assert read[0] == read[1] and read[0]["module"] == "jit_body" and read[0]["collectives"]


def test_a_collective_over_single_device_groups_moves_nothing(capsys, tmp_path):
    (collective,), _ = parse_collectives(SINGLETONS)
    assert collective.moves_nothing and collective.size_bytes == 0 and collective.operand_bytes == 2**20
    path = tmp_path / "one.hlo"
    path.write_text(SINGLETONS)
    assert main(["inspect", "--hlo", str(path), "--mesh", "data=1,fsdp=4", "--json"]) == 0
    (found,) = json.loads(capsys.readouterr().out)["collectives"]
    assert found["size_bytes"] == 0 and found["origin"]["why"].startswith("moves nothing")
