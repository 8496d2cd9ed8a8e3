"""bench.ns_flops: a TFLOP/s figure counts the FLOPs its path computes, so none passes
what the GPU can do."""

from __future__ import annotations

import pytest
import torch

from bench.ns_flops import arm_flops, path_flops
from bench.shapes import QWEN3_8B_LAYER
from muon import KELLER_JORDAN
from muon.newton_schulz import (
    NewtonSchulzPath,
    gram_flops_symmetric,
    ns_flops,
    ns_flops_symmetric,
)


def _dense_gram(rows: int, cols: int) -> int:
    """Gram Newton-Schulz with every product whole: per segment of L iterations R = X X^T
    and Q X (2 m^2 n each), per iteration Z = b R + c R^2, after each but the last W = P R
    and R = P W, for each but the first Q = P Q (2 m^3 each)."""
    m, n = min(rows, cols), max(rows, cols)
    total = 0
    for segment in KELLER_JORDAN.gram_segments():
        steps = len(segment)
        total += 4 * m * m * n + 2 * m**3 * (steps + 2 * (steps - 1) + (steps - 1))
    return total


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (96, 96)])
def test_each_path_counts_the_products_it_computes(shape):
    def flops(algorithm: str, backend: str) -> int:
        path = NewtonSchulzPath(algorithm, backend, torch.float16)
        return path_flops(*shape, path, KELLER_JORDAN)

    assert flops("standard", "torch") == ns_flops(*shape, KELLER_JORDAN.steps)
    assert flops("gram", "torch") == _dense_gram(*shape)
    assert flops("standard", "triton") == ns_flops_symmetric(*shape, KELLER_JORDAN.steps)
    assert flops("gram", "triton") == gram_flops_symmetric(*shape, KELLER_JORDAN)


def test_the_h200_runs_newton_schulz_rate_is_below_its_matmul_peak_counted_as_computed():
    """bench/measured/muon_step_square_h200.log: "NS only (triton, auto)" took 223.8 ms for
    12 Qwen3-8B layers; counted as the dense iteration that was 1005 TFLOP/s, against a
    778.4 TFLOP/s bf16 matmul in the same run."""
    shapes = QWEN3_8B_LAYER * 12
    seconds, peak = 223.8e-3, 778.4
    dense = sum(ns_flops(r, c, KELLER_JORDAN.steps) for r, c in shapes) / seconds / 1e12
    assert dense == pytest.approx(1005.4, abs=0.5)  # the log's ms are rounded
    computed = arm_flops(shapes, "triton", "auto", "cuda", 9) / seconds / 1e12
    assert computed < peak
