"""Dropless experts: the buffered layer's numbers on this target, the experts' FLOPs as compiled for a TPU."""

import pytest

from experiments.q42_dropless import Config, column_tiles, tile_visits
from lab.registry import get
from tests.experiments.support import pinned

pytestmark = pytest.mark.long  # a libtpu compile

SMALL = Config(seq=128, capacities=("dropless",))


@pytest.fixture(scope="module")
def result(devices):
    return get("dropless").run(SMALL)


def test_dropless_matches_the_buffer_and_the_compiled_flops_match_the_count(result):
    assert pinned(result) == {
        "fsdp=4,tensor=2: the loss, dropless against a whole-sequence buffer's": "agrees",
        "fsdp=4,tensor=2: the gradients' global norm, dropless against a whole-sequence buffer's": "agrees",
        "tpu:v5e:2x2 capacity=dropless: the experts' matmul FLOPs per chip, read from the compiled step, against the "
        "count from the sizes": "agrees",
        "tpu:v5e:2x2 capacity=dropless: lab plan's closed form, the step's matmul FLOPs per chip against the "
        "compiled step's": "agrees",
    }
    # 2 sequences of 128 tokens to 2 experts: 512 rows, one tile, visited once more for each of 7 boundaries;
    # SwiGLU's three matmuls, four runs each (remat full), in 2 layers, each 1024 x 1536 multiplied as 1024 x 2048
    assert result.checks[2].observed == 2 * 3 * 4 * 2 * (8 * 512) * 1024 * 2048
    assert not result.claims  # the claim needs the buffer at 1.25 and none beside dropless


def test_the_tile_overhead_shrinks_as_the_rows_outnumber_the_experts():
    assert tile_visits(512, 8) == 8.0
    assert tile_visits(16 * 4096 * 8, 128) == pytest.approx((1024 + 127) / 1024)


def test_a_width_that_is_no_multiple_of_its_tile_is_multiplied_to_the_next_whole_tile():
    assert column_tiles(4096, 1536) == pytest.approx(2048 / 1536)  # Qwen3-235B's experts
    assert column_tiles(2880, 2880) == pytest.approx((3072 / 2880) ** 2)  # GPT-OSS's, both widths
    assert column_tiles(7168, 2048) == 1.0  # DeepSeek-V3's: whole tiles
    assert column_tiles(256, 512) == 1.0  # widths under a tile are their own tile
