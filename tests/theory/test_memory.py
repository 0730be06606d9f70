"""lab.theory.memory: ZeRO's model states and traffic, and activation memory under TP and SP."""

import pytest

from lab.errors import LabError
from lab.theory.memory import (
    ModelStateBytes,
    activation_bytes_per_layer,
    step_wire_bytes,
    zero_model_states,
    zero_step_collectives,
)

# --- ZeRO: model-state memory and data-parallel traffic -----------------------


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1_7_5b_parameters_on_64_devices(stage, gigabytes):
    # ZeRO paper, Figure 1: Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    assert zero_model_states(stage, 7.5e9, 64).total / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_zero_stages_partition_one_more_term_each():
    psi, n = 1000, 8
    assert zero_model_states(0, psi, n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi)
    assert zero_model_states(1, psi, n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi / n)
    assert zero_model_states(2, psi, n) == ModelStateBytes(2 * psi, 2 * psi / n, 12 * psi / n)
    assert zero_model_states(3, psi, n) == ModelStateBytes(2 * psi / n, 2 * psi / n, 12 * psi / n)


def test_zero3_moves_one_and_a_half_times_ddp_unless_it_keeps_the_gathered_weights():
    psi, n = 1e9, 8
    ddp = step_wire_bytes(zero_step_collectives(0, psi), n)
    assert ddp == pytest.approx(2 * 7 / 8 * psi)
    assert step_wire_bytes(zero_step_collectives(1, psi), n) == pytest.approx(ddp)  # RS + AG = AR
    assert step_wire_bytes(zero_step_collectives(3, psi), n) / ddp == pytest.approx(1.5)
    assert step_wire_bytes(zero_step_collectives(3, psi, regathered_bytes=0), n) / ddp == pytest.approx(1.0)


def test_zero_rejects_an_unknown_stage():
    with pytest.raises(LabError, match="ZeRO stage 4"):
        zero_model_states(4, 10, 2)
    with pytest.raises(LabError, match="ZeRO stage"):
        zero_step_collectives(-1, 10)


# --- activation memory under tensor and sequence parallelism -------------------


def test_activation_memory_matches_korthikanti_formulas():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer (the paper's Table 3 model)
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, 8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, 8, sequence_parallel=True) == pytest.approx(
        sbh * (34 + 5 * a * s / h) / 8
    )
    assert activation_bytes_per_layer(s, b, h, a, 1, sequence_parallel=True) == activation_bytes_per_layer(s, b, h, a)


def test_activation_memory_without_dropout_drops_masks():
    assert activation_bytes_per_layer(16, 2, 64, 4, dropout=False) == pytest.approx(
        16 * 2 * 64 * (32 + 2 * 4 * 16 / 64)
    )
    assert activation_bytes_per_layer(16, 2, 64, 4, 4, dropout=False) == pytest.approx(
        16 * 2 * 64 * (8 + 6 + 2 * 4 * 16 / 256)
    )
    with pytest.raises(LabError, match="positive sizes"):
        activation_bytes_per_layer(16, 2, 64, 4, 0)
