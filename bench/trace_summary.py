"""Summarize a Chrome trace that `bench.train_step --trace` wrote: where the time goes.

    python -m bench.trace_summary bench/results/train_step.adamw-offload-overlap.trace.json.gz

Prints, over the traced steps: each CUDA stream's busy time (kernels and copies, with
the copies' GB/s and whether their host memory was pinned), the compute stream's idle
gaps and what the other streams did meanwhile, each `optimizer.step()` call's host time
and how much of it the compute stream sat idle, the host's CUDA runtime calls (the
longest ones are where the host blocked), and a coarse timeline, one row per stream.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SHADES = " .:-=+*#"


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def union_ms(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals, in the trace's microseconds / 1e3."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total / 1e3


def busy_between(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Fraction of [lo, hi) that `intervals` cover."""
    clipped = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
    return union_ms(clipped) * 1e3 / max(hi - lo, 1e-9)


def summarize(
    events: list[dict[str, Any]], steps: int, bins: int, kernels: int = 12
) -> dict[str, Any]:
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise SystemExit("no CUDA activity in this trace (a CPU run?)")
    lanes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    kernel_us: Counter[int] = Counter()
    kernel_names: dict[int, Counter[str]] = defaultdict(Counter)
    copies: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, bytes, us
    for e in device:
        stream = _stream(e)
        lanes[stream].append((e["ts"], e["ts"] + e["dur"]))
        if e["cat"] == "kernel":
            kernel_us[stream] += e["dur"]
            kernel_names[stream][e["name"][:60]] += e["dur"]
        elif e["cat"] == "gpu_memcpy":
            c = copies[f"{e['name']} (stream {stream})"]
            c[0] += 1
            c[1] += e.get("args", {}).get("bytes", 0)
            c[2] += e["dur"]
    start = min(lo for ivs in lanes.values() for lo, _ in ivs)
    end = max(hi for ivs in lanes.values() for _, hi in ivs)
    compute = kernel_us.most_common(1)[0][0]
    compute_ivs = lanes[compute]
    ordered = sorted(compute_ivs)
    gaps, last = [], start
    for lo, hi in ordered:
        if lo - last > 1000:  # 1 ms
            gaps.append((last, lo))
        last = max(last, hi)
    others = {s: ivs for s, ivs in lanes.items() if s != compute}
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, us, max
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            r = runtime[e["name"]]
            r[0] += 1
            r[1] += e["dur"]
            r[2] = max(r[2], e["dur"])
    trainer_copies = _trainer_copy_waits(events, compute)
    width = (end - start) / bins
    timeline = {
        stream: "".join(
            SHADES[
                min(
                    len(SHADES) - 1,
                    round(busy_between(ivs, start + i * width, start + (i + 1) * width) * 7),
                )
            ]
            for i in range(bins)
        )
        for stream, ivs in sorted(lanes.items())
    }
    return {
        "span_ms_per_step": (end - start) / 1e3 / steps,
        "compute_stream": compute,
        "streams": {
            s: {
                "busy_ms_per_step": union_ms(ivs) / steps,
                "kernel_ms_per_step": kernel_us[s] / 1e3 / steps,
            }
            for s, ivs in sorted(lanes.items())
        },
        "copies": {
            name: {
                "count_per_step": c[0] / steps,
                "gib_per_step": c[1] / 2**30 / steps,
                "ms_per_step": c[2] / 1e3 / steps,
                "gb_per_s": c[1] / max(c[2], 1e-9) / 1e3,
            }
            for name, c in sorted(copies.items())
        },
        "compute_gaps": {
            "count_per_step": len(gaps) / steps,
            "ms_per_step": sum(hi - lo for lo, hi in gaps) / 1e3 / steps,
            "longest": [
                {
                    "at_ms": (lo - start) / 1e3,
                    "ms": (hi - lo) / 1e3,
                    "others_busy": {
                        s: round(busy_between(o, lo, hi), 2) for s, o in others.items()
                    },
                }
                for lo, hi in sorted(gaps, key=lambda g: g[0] - g[1])[:12]
            ],
        },
        "compute_busy_ms_per_step": union_ms(compute_ivs) / steps,
        # the compute stream's kernels by name: a phase slowed by the copies shows here
        "compute_kernels_ms_per_step": {
            name: us / 1e3 / steps for name, us in kernel_names[compute].most_common(kernels)
        },
        "runtime_calls": {
            name: {
                "count_per_step": r[0] / steps,
                "ms_per_step": r[1] / 1e3 / steps,
                "longest_ms": r[2] / 1e3,
            }
            for name, r in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:12]
        },
        "optimizer_steps": optimizer_steps(events, compute),
        "trainer_copies": {
            "count_per_step": len(trainer_copies) / steps,
            "waited_ms_per_step": sum(w for w, _ in trainer_copies) / 1e3 / steps,
            "longest_ms": max((w for w, _ in trainer_copies), default=0.0) / 1e3,
            "waited_behind_ms_per_step": sum(w for w, behind in trainer_copies if behind)
            / 1e3
            / steps,
        },
        "timeline": timeline,
        "timeline_bin_ms": width / 1e3,
    }


def optimizer_steps(events: list[dict[str, Any]], compute: int) -> list[dict[str, float]]:
    """Per `optimizer.step()` call on the host (torch's `Optimizer.step#...` annotation):
    when it started (ms from the trace's first event), its host ms, and how much of that
    the compute stream sat idle: the step's host work the device did not cover (a re-plan
    of "auto", with the backward's device work already done, shows here)."""
    start = min(e["ts"] for e in events)
    compute_ivs = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and _stream(e) == compute
    ]
    steps = sorted(
        (
            e
            for e in events
            if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step#")
        ),
        key=lambda e: e["ts"],
    )
    out = []
    for e in steps:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        busy = union_ms([(max(a, lo), min(b, hi)) for a, b in compute_ivs if b > lo and a < hi])
        out.append(
            {
                "at_ms": (lo - start) / 1e3,
                "host_ms": e["dur"] / 1e3,
                "compute_idle_ms": e["dur"] / 1e3 - busy,
            }
        )
    return out


def _trainer_copy_waits(events: list[dict[str, Any]], compute: int) -> list[tuple[float, bool]]:
    """Per host <-> device copy on the compute stream (the trainer's own: FSDP2's, an
    `.item()`): how long (us) it started after it could have (the later of its stream's
    previous work ending and its launch call returning), and whether another stream's copy
    was running at its ready time (it queued in the copy engine behind ours)."""
    launched = {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    on_compute = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and _stream(e) == compute),
        key=lambda e: e["ts"],
    )
    copy_ivs = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "gpu_memcpy" and _stream(e) != compute and "DtoD" not in e["name"]
    )
    waits, previous_end = [], float("-inf")
    for e in on_compute:
        if e["cat"] == "gpu_memcpy" and "DtoD" not in e["name"]:
            ready = max(previous_end, launched.get(e.get("args", {}).get("correlation"), 0.0))
            behind = any(lo <= ready < hi for lo, hi in copy_ivs)
            waits.append((max(0.0, e["ts"] - ready), behind))
        previous_end = max(previous_end, e["ts"] + e["dur"])
    return waits


def _stream(event: dict[str, Any]) -> int:
    return int(event.get("args", {}).get("stream", event.get("tid", -1)))


def print_summary(name: str, s: dict[str, Any]) -> None:
    print(f"== {name}: {s['span_ms_per_step']:.1f} ms per step (device span)")
    print(
        f"compute stream {s['compute_stream']}: busy {s['compute_busy_ms_per_step']:.1f} ms, "
        f"idle gaps > 1 ms: {s['compute_gaps']['count_per_step']:.1f} a step, "
        f"{s['compute_gaps']['ms_per_step']:.1f} ms"
    )
    for stream, t in s["streams"].items():
        print(
            f"  stream {stream:>4}: busy {t['busy_ms_per_step']:7.1f} ms, "
            f"kernels {t['kernel_ms_per_step']:7.1f} ms"
        )
    for copy, c in s["copies"].items():
        print(
            f"  {copy:<45} {c['count_per_step']:6.0f}x {c['gib_per_step']:6.2f} GiB "
            f"{c['ms_per_step']:7.1f} ms {c['gb_per_s']:6.1f} GB/s"
        )
    print("  compute stream's kernels by ms a step:")
    for kernel, ms in s["compute_kernels_ms_per_step"].items():
        print(f"    {ms:7.2f}  {kernel}")
    print("  longest compute gaps (at ms, ms, other streams' busy fraction):")
    for g in s["compute_gaps"]["longest"]:
        print(f"    {g['at_ms']:8.1f} {g['ms']:6.1f}  {g['others_busy']}")
    t = s["trainer_copies"]
    print(
        f"  the compute stream's own host<->device copies: {t['count_per_step']:.0f} a step, "
        f"started {t['waited_ms_per_step']:.1f} ms after they could have "
        f"({t['waited_behind_ms_per_step']:.1f} ms while another stream copied; "
        f"longest {t['longest_ms']:.1f} ms)"
    )
    print("  optimizer.step() calls (at ms, host ms, of which the compute stream sat idle):")
    for o in s["optimizer_steps"]:
        print(f"    {o['at_ms']:8.1f} {o['host_ms']:7.1f} {o['compute_idle_ms']:7.1f}")
    print("  host CUDA calls (per step: count, ms; longest single call ms):")
    for call, r in s["runtime_calls"].items():
        print(
            f"    {call:<32} {r['count_per_step']:7.0f} {r['ms_per_step']:8.1f} "
            f"{r['longest_ms']:8.2f}"
        )
    print(f"  timeline, {s['timeline_bin_ms']:.1f} ms a column (busy: ' ' none ... '#' all):")
    for stream, row in s["timeline"].items():
        print(f"    {stream:>4} |{row}|")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    parser.add_argument("--bins", type=int, default=120, help="timeline columns")
    parser.add_argument("--kernels", type=int, default=12, help="kernel names listed")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    args = parser.parse_args(argv)
    out = {}
    for path in args.traces:
        out[path.name] = summarize(load_events(path), args.steps, args.bins, args.kernels)
        print_summary(path.name, out[path.name])
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
