"""Timing shared by the benchmarks: device-synchronized, CUDA events on the GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """Seconds per call after `warmup` calls: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return times


def matmul_tflops(device: torch.device, n: int, warmup: int, repeats: int) -> float:
    """Measured bf16 n^3 matmul rate: the ceiling TFLOP/s figures are held against."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = statistics.median(time_calls(lambda: a @ b, device, warmup, repeats))
    return 2 * n**3 / seconds / 1e12


def sustained_matmul_tflops(device: torch.device, n: int, seconds: float = 0.6) -> float:
    """bf16 n^3 matmuls back to back for about `seconds`, timed as one region.

    Long enough for the GPU to reach its power-limited clock, as a Muon step does: the
    ceiling for work that keeps the tensor cores busy for hundreds of milliseconds.
    """
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    one = statistics.median(time_calls(lambda: a @ b, device, 2, 3))
    calls = max(1, round(seconds / one))
    total = time_calls(lambda: [a @ b for _ in range(calls)], device, 0, 1)[0]
    return 2 * n**3 * calls / total / 1e12
