"""Timing shared by the benchmarks: device-synchronized, CUDA events on the GPU."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


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


def synced_seconds(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """Wall seconds per call after `warmup` untimed calls, the device synchronized before
    and after each call: for work on several streams, which events on one stream miss."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def in_rounds(arms: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each arm's results over `rounds` rounds, every round running every arm once in the
    given order (A B C A B C): a machine that drifts moves every arm alike, a ratio can
    pair two arms of one round, and the rounds show how far each figure moves."""
    results: dict[str, list[T]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            results[name].append(arm())
    return results


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


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2**30) -> float:
    """Measured device-to-device copy rate, bytes read plus bytes written per second / 1e9:
    the ceiling for memory-bound passes (on the CPU, a large memcpy)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = statistics.median(time_calls(lambda: dst.copy_(src), device, 2, 5))
    return 2 * nbytes / seconds / 1e9


def timed_window(
    step: Callable[[], object], steps: int, device: torch.device
) -> tuple[list[float], float]:
    """Run `step` `steps` times with the device synchronized only before the first and
    after the last; return each step's seconds and the window's.

    Each step's time is the gap between marks made at step boundaries without a
    sync: CUDA events on the current stream on the GPU (a step whose work trails
    into the next one, an overlapped optimizer step, is counted where the stream
    runs it), perf_counter on the CPU.
    """
    sync(device)
    start_s = time.perf_counter()
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            step()
            mark.record()
        sync(device)
        per_step = [a.elapsed_time(b) / 1e3 for a, b in zip(marks[:-1], marks[1:], strict=True)]
    else:
        stamps = [time.perf_counter()]
        for _ in range(steps):
            step()
            stamps.append(time.perf_counter())
        per_step = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    sync(device)
    return per_step, time.perf_counter() - start_s


class GcPauses:
    """Python's garbage collections while entered: (generation, ms) each, in order.

    A full collection (generation 2) walks every tracked object of the process, which
    holds the trainer's host thread for tens to hundreds of ms: a step that has one shows
    as a lone slow step in a window whose median it leaves alone.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.events.append((info["generation"], 1e3 * (time.perf_counter() - self._started)))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def full_collections(pauses: GcPauses, step_events: list[tuple[int, int]]) -> dict[str, list]:
    """The full collections among `pauses` that fell inside a step (`step_events[k]`: how
    many events had been recorded when step k started and when it returned): the step
    each fell in and its ms; and the ms of those outside every step (the window's set-up
    and tail, which no step's time holds)."""
    steps, ms, outside = [], [], []
    for index, (generation, took) in enumerate(pauses.events):
        if generation != 2:
            continue
        step = next((k for k, (a, b) in enumerate(step_events) if a <= index < b), None)
        if step is None:
            outside.append(took)
        else:
            steps.append(step)
            ms.append(took)
    return {"steps": steps, "ms": ms, "outside_steps_ms": outside}
