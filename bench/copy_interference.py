"""What host copies cost the kernels running beside them on the same GPU.

    python -m bench.copy_interference [--json PATH]

An overlapped offloaded step moves state over the host link while the trainer computes:
the backward loads the next step's first chunks (host to GPU) while the last step's
extra slots write back (GPU to host), and the backward ran longer by about as much as
it loaded (`bench/measured/train_step_hf_b4_bwd_factor_e9b0169_h100.json`), with the
copies cut into pieces of any size from 4 to 128 MiB alike. This measures the part of
that no schedule can avoid: a bf16 matmul of a Llama MLP's shape at batch 4 x 2048
(compute-bound) and a bf16 add (memory-bound), timed by events on the default stream,
alone and with 32 MiB pinned copies streaming on side streams one way or both ways (as
`CPUOffloadOptimizer` copies), each condition repeated in rounds. Prints a table (each
kernel's median ms, and its slowdown against the same round's time alone) and writes
JSON. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]
PIECE_BYTES = 32 << 20  # offload/executor.py's COPY_PIECE_BYTES
CONDITIONS = ("alone", "host to GPU", "GPU to host", "both ways")


def workloads(device: torch.device) -> dict[str, tuple[str, Callable[[], object]]]:
    """Name -> (what it is, a function enqueuing one iteration on the current stream)."""
    a = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)
    b = torch.randn(2048, 8192, device=device, dtype=torch.bfloat16)
    x = torch.randn(256 << 20, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    return {
        "matmul": ("bf16 8192 x 2048 @ 2048 x 8192", lambda: a @ b),
        "add": ("bf16 add, 512 MiB per operand", lambda: torch.add(x, y, out=out)),
    }


class Copies:
    """Pinned host buffers and GPU buffers copied in pieces on a side stream per way."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        n = nbytes // 4
        self.host = {w: torch.empty(n, pin_memory=True) for w in ("h2d", "d2h")}
        self.gpu = {w: torch.empty(n, device=device) for w in ("h2d", "d2h")}
        self.streams = {w: torch.cuda.Stream(device) for w in ("h2d", "d2h")}

    def enqueue(self, ways: tuple[str, ...], repeats: int) -> dict[str, torch.cuda.Event]:
        """Copy each way's buffer `repeats` times in pieces; the events mark their ends."""
        step = PIECE_BYTES // 4
        ends = {}
        for way in ways:
            host, gpu, stream = self.host[way], self.gpu[way], self.streams[way]
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    for i in range(0, host.numel(), step):
                        if way == "h2d":
                            gpu[i : i + step].copy_(host[i : i + step], non_blocking=True)
                        else:
                            host[i : i + step].copy_(gpu[i : i + step], non_blocking=True)
                ends[way] = torch.cuda.Event(enable_timing=True)
                ends[way].record(stream)
        return ends


def time_kernel(run, iterations: int) -> list[float]:
    """ms of each of `iterations` back-to-back runs on the current stream (events)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iterations + 1)]
    events[0].record()
    for event in events[1:]:
        run()
        event.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]


def measure(run, copies: Copies, condition: str, iterations: int, repeats: int) -> dict[str, float]:
    """The kernel's median ms under `condition`, and whether the copies outlasted it."""
    ways = {"alone": (), "host to GPU": ("h2d",), "GPU to host": ("d2h",)}.get(
        condition, ("h2d", "d2h")
    )
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    for way in ways:
        copies.streams[way].wait_event(start)
    ends = copies.enqueue(ways, repeats)
    times = time_kernel(run, iterations)
    kernels_done = torch.cuda.Event(enable_timing=True)
    kernels_done.record()
    torch.cuda.synchronize()
    # The copies must run through the whole timed loop, or the median mixes in time alone.
    covered = all(start.elapsed_time(e) >= start.elapsed_time(kernels_done) for e in ends.values())
    return {"ms": statistics.median(times), "copies_outlasted": covered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40, help="timed kernels a condition")
    parser.add_argument("--copy-gib", type=float, default=1.0, help="each way's buffer")
    parser.add_argument("--copy-repeats", type=int, default=4, help="passes over it a condition")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "copy_interference.json"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/copy_interference.py needs CUDA")
    device = torch.device("cuda")
    copies = Copies(device, int(args.copy_gib * 2**30))
    kernels = workloads(device)
    for _, run in kernels.values():  # warm: cuBLAS's choice, the allocator
        time_kernel(run, 5)
    copies.enqueue(("h2d", "d2h"), 1)
    torch.cuda.synchronize()
    rows = []
    for round_index in range(args.rounds):
        for name, (what, run) in kernels.items():
            alone = None
            for condition in CONDITIONS:
                m = measure(run, copies, condition, args.iterations, args.copy_repeats)
                alone = m["ms"] if condition == "alone" else alone
                rows.append(
                    {
                        "round": round_index,
                        "kernel": name,
                        "what": what,
                        "condition": condition,
                        **m,
                        "vs_alone": m["ms"] / alone,
                    }
                )
    summary = []
    for name, (what, _) in kernels.items():
        for condition in CONDITIONS:
            mine = [r for r in rows if r["kernel"] == name and r["condition"] == condition]
            ratios = [r["vs_alone"] for r in mine]
            summary.append(
                {
                    "kernel": name,
                    "what": what,
                    "condition": condition,
                    "ms": statistics.median(r["ms"] for r in mine),
                    "vs_alone": statistics.median(ratios),
                    "vs_alone_range": [min(ratios), max(ratios)],
                    "copies_outlasted": all(r["copies_outlasted"] for r in mine),
                }
            )
    print(f"{torch.cuda.get_device_name()}, {args.rounds} rounds, 32 MiB copy pieces")
    print(
        f"{'kernel':<8} {'condition':<12} {'ms':>8} {'vs alone':>9} {'range':>15}  "
        "copies ran throughout"
    )
    for s in summary:
        low, high = s["vs_alone_range"]
        print(
            f"{s['kernel']:<8} {s['condition']:<12} {s['ms']:>8.3f} {s['vs_alone']:>8.3f}x "
            f"{low:>7.3f}-{high:.3f}  {s['copies_outlasted']}"
        )
    write_json(
        args.json,
        {
            "device": torch.cuda.get_device_name(),
            "rounds": args.rounds,
            "summary": summary,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
