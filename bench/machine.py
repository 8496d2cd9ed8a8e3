"""What the machine under a bench gives at the moment it runs: the host's speed at a fixed
piece of Python, and the host link's copy rates.

Fresh machines of one kind differ, and so do the cores of one machine
(`bench/measured/host_jitter_h200.log`). A step the host paces moves with the first, a
step the copies pace with the second, so each arm's process records both beside its
times.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

HOST_LOOP_ADDS = 20_000
"""Additions in the timed Python loop."""
LINK_PROBE_BYTES = 256 << 20
"""Bytes copied each way to time the host link (a few ms at PCIe 5 rates)."""


def host_loop_ms(repeats: int = 200) -> float:
    """Median ms this thread takes for a fixed pure-Python loop of `HOST_LOOP_ADDS` additions."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(HOST_LOOP_ADDS):
            total += i
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def link_gb_per_s(nbytes: int = LINK_PROBE_BYTES) -> dict[str, float]:
    """Pinned host <-> GPU copy rates in GB/s: each way alone (h2d, d2h), and each way's
    rate while both run at once (both). The probe's memory is given back after."""
    from bench.offload_step import copy_floor

    floor = copy_floor(nbytes)
    torch.cuda.empty_cache()
    return {way: nbytes / floor[f"{way}_s"] / 1e9 for way in ("h2d", "d2h", "both")}


def probe(device: torch.device) -> dict[str, Any]:
    """`host_loop_ms`, and on a GPU the link's rates (`h2d_gb_s`, `d2h_gb_s`, `both_gb_s`;
    None elsewhere)."""
    rates = link_gb_per_s() if device.type == "cuda" else {}
    return {
        "host_loop_ms": host_loop_ms(),
        **{f"{way}_gb_s": rates.get(way) for way in ("h2d", "d2h", "both")},
    }


def describe(machine: dict[str, Any]) -> str:
    """One line: the host loop's ms and, where measured, the link's rates."""
    text = f"host loop {machine['host_loop_ms']:.2f} ms"
    if machine.get("h2d_gb_s") is not None:
        text += (
            f", link {machine['h2d_gb_s']:.1f} / {machine['d2h_gb_s']:.1f} GB/s "
            f"(both ways at once {machine['both_gb_s']:.1f} each)"
        )
    return text
