"""Newton-Schulz FLOPs as each path computes them, for TFLOP/s figures a GPU can reach.

The dense iteration's count (`ns_flops`: 4 m^2 n + 2 m^3 an iteration) overstates what
the other paths compute: the Triton kernels compute half of each symmetric product, and
Gram Newton-Schulz fewer products on wide matrices. Held against the dense count, their
time gave 1005 "TFLOP/s" beside a 778 TFLOP/s bf16 matmul
(bench/measured/muon_step_square_h200.log): a faster algorithm read as a faster GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch.utils.flop_counter import FlopCounterMode

from muon.newton_schulz import (
    NewtonSchulzPath,
    gram_flops_symmetric,
    ns_flops_symmetric,
    ns_path,
    zeropower_along,
)
from muon.ns_schedules import DEFAULT_EPS, KELLER_JORDAN, NewtonSchulzSchedule


def path_flops(rows: int, cols: int, path: NewtonSchulzPath, schedule: NewtonSchulzSchedule) -> int:
    """FLOPs one rows x cols matrix takes along `path`. Triton: the symmetric kernels'
    counts (`ns_flops_symmetric`, `gram_flops_symmetric`: half of each symmetric product;
    the diagonal tiles they compute whole are not counted, so a rate is at most
    understated). Plain torch: the products the iteration runs, counted by torch's
    `FlopCounterMode` over it on meta tensors."""
    if path.backend == "triton":
        if path.algorithm == "gram":
            return gram_flops_symmetric(rows, cols, schedule)
        return ns_flops_symmetric(rows, cols, schedule.steps)
    x = torch.empty(rows, cols, dtype=path.dtype, device="meta")
    one = dataclasses.replace(path, per_matrix=False)  # one matrix: the same products
    with FlopCounterMode(display=False) as counter:
        zeropower_along(x, schedule, DEFAULT_EPS, one)
    return counter.get_total_flops()


def arm_flops(
    shapes: Iterable[tuple[int, int]],
    backend: str,
    algorithm: str,
    device_type: str,
    capability: int | None,
    schedule: NewtonSchulzSchedule = KELLER_JORDAN,
) -> int:
    """FLOPs of Newton-Schulz on bf16 matrices of `shapes` along the paths `backend` and
    `algorithm` take for each (`ns_path`) on a device of `device_type` and `capability`
    (the CUDA major version; None elsewhere)."""
    total = 0
    for rows, cols in shapes:
        path = ns_path(rows, cols, torch.bfloat16, device_type, capability, backend, algorithm)
        total += path_flops(rows, cols, path, schedule)
    return total
