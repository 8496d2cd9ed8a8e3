"""How the host's speed and the host link's copy rates move over time on one machine.

    python -m bench.machine_drift [--seconds 60] [--json PATH]

An offloaded step moves with both (`bench/machine.py` takes one sample of each per arm's
process); a ratio measured over one window of a run holds only while they hold. This
samples them back to back: the fixed Python loop of `bench.machine.host_loop_ms`, then
`LINK_PROBE_BYTES` copied host -> GPU, GPU -> host and both ways at once (pinned memory,
`bench.offload_step.copy_floor`), again and again for `--seconds`. Prints each series'
spread, the share of samples more than `SLOW_SHARE` slower than the series' fastest tenth
and the longest stretch of them, and writes every sample to JSON. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.machine import LINK_PROBE_BYTES, host_loop_ms
from bench.offload_step import copy_floor
from bench.report import write_json
from offload.host_memory import allocate_host_slabs

ROOT = Path(__file__).resolve().parents[1]
SLOW_SHARE = 0.2
"""A sample this much slower than its series' fastest tenth counts as slow: the reference
is the machine at its best, since a machine slow for most of the run has a slow median."""
SERIES = ("host_loop_ms", "h2d_gb_s", "d2h_gb_s", "both_gb_s")
"""What each sample holds; the host loop in ms (more is slower), the rest in GB/s."""


def slow_bound(values: list[float], higher_is_slower: bool) -> float:
    """The value past which a sample is slow: `SLOW_SHARE` beyond the fastest tenth's edge
    (the 10th percentile where higher is slower, else the 90th)."""
    deciles = statistics.quantiles(values, n=10)
    return deciles[0] * (1 + SLOW_SHARE) if higher_is_slower else deciles[-1] / (1 + SLOW_SHARE)


def longest_slow_stretch(
    times_s: list[float], values: list[float], higher_is_slower: bool
) -> float:
    """Seconds of the longest run of consecutive slow samples (`slow_bound`; each sample
    taken at `times_s`): from the first slow sample's time to the first time after it that
    is not slow (the last sample's time at the end)."""
    bound = slow_bound(values, higher_is_slower)
    longest, start = 0.0, None
    for t, v in zip(times_s, values, strict=True):
        slow = v > bound if higher_is_slower else v < bound
        if slow and start is None:
            start = t
        elif not slow and start is not None:
            longest, start = max(longest, t - start), None
    if start is not None:
        longest = max(longest, times_s[-1] - start)
    return longest


def summary(times_s: list[float], values: list[float], higher_is_slower: bool) -> dict[str, float]:
    """Median, 10th and 90th percentile, least, most, the share of slow samples
    (`slow_bound`) and the longest slow stretch (`longest_slow_stretch`) of one series."""
    deciles = statistics.quantiles(values, n=10)
    bound = slow_bound(values, higher_is_slower)
    slow = [v > bound if higher_is_slower else v < bound for v in values]
    return {
        "median": statistics.median(values),
        "p10": deciles[0],
        "p90": deciles[-1],
        "min": min(values),
        "max": max(values),
        "slow_share": sum(slow) / len(values),
        "longest_slow_s": longest_slow_stretch(times_s, values, higher_is_slower),
    }


def sample(host: torch.Tensor) -> dict[str, float]:
    """One sample of every series in `SERIES`."""
    seconds = copy_floor(LINK_PROBE_BYTES, repeats=1, host=host)
    rates = {
        f"{way}_gb_s": LINK_PROBE_BYTES / seconds[f"{way}_s"] / 1e9
        for way in ("h2d", "d2h", "both")
    }
    return {"host_loop_ms": host_loop_ms(repeats=5), **rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long to sample (at least 2 samples)"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/machine_drift.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/machine_drift.py needs CUDA")
    host = allocate_host_slabs({torch.uint8: 2 * LINK_PROBE_BYTES}, torch.device("cuda"))[
        torch.uint8
    ]
    samples, times_s = [], []
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < args.seconds or len(samples) < 2:
        times_s.append(now)
        samples.append(sample(host))
    rows = {
        name: summary(times_s, [s[name] for s in samples], higher_is_slower=name == "host_loop_ms")
        for name in SERIES
    }
    device = torch.cuda.get_device_name()
    print(f"{device}: {len(samples)} samples over {times_s[-1]:.0f} s")
    print(
        f"{'series':<13} {'median':>7} {'p10':>7} {'p90':>7} {'min':>7} {'max':>7} "
        f"{'slow':>6} {'longest slow s':>15}"
    )
    for name, r in rows.items():
        print(
            f"{name:<13} {r['median']:>7.2f} {r['p10']:>7.2f} {r['p90']:>7.2f} {r['min']:>7.2f} "
            f"{r['max']:>7.2f} {r['slow_share']:>6.1%} {r['longest_slow_s']:>15.1f}"
        )
    print(f"slow: more than {SLOW_SHARE:.0%} slower than the series' fastest tenth")
    write_json(
        args.json,
        {
            "device": device,
            "seconds": args.seconds,
            "probe_bytes": LINK_PROBE_BYTES,
            "slow_share": SLOW_SHARE,
            "summary": rows,
            "times_s": times_s,
            "samples": samples,
        },
    )


if __name__ == "__main__":
    main()
