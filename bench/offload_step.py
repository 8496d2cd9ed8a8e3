"""Offloaded AdamW step against the PCIe copy floor and the serial offload path.

Params with Qwen3-8B's matrix shapes (fp32 master weights, as FSDP2 keeps them),
AdamW with 8 bytes of state per param. Arms, all in one run:

- no offload: AdamW with its state on the GPU;
- serial offload: all state in, step, all state out (the path an optimizer
  without subset-step support takes);
- chunked offload at several chunk sizes;
- the copy floor: the state's bytes H2D and D2H at once, on two streams, from
  and to pinned host memory, measured here.

Prints a table and writes JSON. GPU only.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time

import torch

from bench.report import write_json
from bench.shapes import QWEN3_8B_LAYER
from offload import CPUOffloadOptimizer
from offload.host_memory import allocate_host_slabs

GiB = 2**30
MiB = 2**20


class SerialAdamW(torch.optim.AdamW):
    """AdamW as an optimizer the offload wrapper knows nothing about: the serial path."""


def make_params(layers: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(layers):
        for shape in QWEN3_8B_LAYER:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02)
            p.grad = torch.randn(shape, device="cuda", generator=gen) * 1e-3
            params.append(p)
    return params


def time_steps(step, steps: int, warmup: int) -> tuple[float, float, float]:
    """Median seconds per step (device synchronized at both ends), median seconds until
    `step()` returns (host time: the rest runs while the host could do other work),
    and peak GPU bytes."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, host = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(host), torch.cuda.max_memory_allocated()


def copy_floor(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Seconds to move `nbytes` each way between pinned host and GPU: one way, and both at once."""
    host = allocate_host_slabs({torch.uint8: 2 * nbytes}, torch.device("cuda"))[torch.uint8]
    host_in, host_out = host[:nbytes], host[nbytes:]
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(run) -> float:
        samples = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def both() -> None:
        with torch.cuda.stream(h2d):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(d2h):
            host_out.copy_(dev_out, non_blocking=True)

    result = {
        "h2d_s": timed(lambda: dev_in.copy_(host_in, non_blocking=True)),
        "d2h_s": timed(lambda: host_out.copy_(dev_out, non_blocking=True)),
        "both_s": timed(both),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--slots", type=int, nargs="+", default=[3])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench/results/offload_step.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_step.py measures PCIe copies: it needs a CUDA GPU")

    params = make_params(args.layers)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = 2 * param_bytes  # exp_avg + exp_avg_sq, fp32
    print(
        f"{len(params)} matrices, {param_bytes / GiB:.2f} GiB params, "
        f"{state_bytes / GiB:.2f} GiB AdamW state"
    )

    floor = copy_floor(state_bytes)
    gc.collect()
    torch.cuda.empty_cache()
    rows = [
        {
            "arm": "copy floor (H2D + D2H at once)",
            "step_s": floor["both_s"],
            "host_s": None,
            "peak_gib": None,
        }
    ]

    def run_arm(name: str, optimizer) -> None:
        seconds, host, peak = time_steps(optimizer.step, args.steps, args.warmup)
        rows.append({"arm": name, "step_s": seconds, "host_s": host, "peak_gib": peak / GiB})
        print(f"  {name}: {seconds * 1e3:.1f} ms (host {host * 1e3:.1f} ms)")

    run_arm("no offload", torch.optim.AdamW(params, lr=1e-4, foreach=True))
    gc.collect()
    torch.cuda.empty_cache()
    run_arm("serial offload", CPUOffloadOptimizer(SerialAdamW(params, lr=1e-4, foreach=True)))
    gc.collect()
    torch.cuda.empty_cache()
    for mib in args.chunk_mib:
        for slots in args.slots:
            opt = CPUOffloadOptimizer(
                torch.optim.AdamW(params, lr=1e-4, foreach=True),
                chunk_bytes=mib * MiB,
                staging_slots=slots,
            )
            run_arm(f"chunked {mib} MiB x {slots} slots", opt)
            del opt
            gc.collect()
            torch.cuda.empty_cache()

    serial = next(r["step_s"] for r in rows if r["arm"] == "serial offload")
    for row in rows:
        row["vs_floor"] = row["step_s"] / floor["both_s"]
        row["serial_speedup"] = serial / row["step_s"]
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
    }
    bandwidth = {
        "h2d_gib_s": state_bytes / GiB / floor["h2d_s"],
        "d2h_gib_s": state_bytes / GiB / floor["d2h_s"],
        "both_total_gib_s": 2 * state_bytes / GiB / floor["both_s"],
    }
    print(
        f"\n{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; pinned H2D "
        f"{bandwidth['h2d_gib_s']:.1f} GiB/s, D2H {bandwidth['d2h_gib_s']:.1f} GiB/s, "
        f"both at once {bandwidth['both_total_gib_s']:.1f} GiB/s total"
    )
    print(
        f"{'arm':34} {'step ms':>9} {'host ms':>8} {'x floor':>8} {'x faster than serial':>21} "
        f"{'peak GiB':>9}"
    )
    for row in rows:
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        host = f"{row['host_s'] * 1e3:.1f}" if row["host_s"] is not None else "-"
        print(
            f"{row['arm']:34} {row['step_s'] * 1e3:9.1f} {host:>8} {row['vs_floor']:8.2f} "
            f"{row['serial_speedup']:21.2f} {peak:>9}"
        )
    write_json(
        args.out,
        {
            "env": env,
            "state_bytes": state_bytes,
            "param_bytes": param_bytes,
            "bandwidth": bandwidth,
            "floor": floor,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
