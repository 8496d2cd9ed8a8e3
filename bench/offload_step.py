"""Offloaded AdamW step against the PCIe copy floor and the serial offload path.

Params with Qwen3-8B's matrix shapes (fp32 master weights, as FSDP2 keeps them),
AdamW with 8 bytes of state per param. Arms, all in one run:

- no offload: AdamW with its state on the GPU;
- serial offload: all state in, step, all state out (the path an optimizer
  without subset-step support takes);
- chunked offload at several chunk sizes;
- the copy floor: the state's bytes H2D and D2H at once, on two streams, from
  and to pinned host memory, measured here.

Prints a table and writes JSON. GPU only, except the smoke mode of `--plot`.

`--plot PATH` also draws one step of the default chunked arm as a timeline PNG
(matplotlib: the `plot` extra): one lane each for H2D, update and D2H, a box per
chunk from events recorded on the pipeline's streams, and the copy floor marked.
On the CPU (`--device cpu`, smoke mode: shapes divided by `--shrink`, 1 MiB
chunks) the copies are synchronous and the boxes are wall-clock marks:

    python -m bench.offload_step --plot bench/results/offload_timeline.png
    python -m bench.offload_step --device cpu --layers 1 --shrink 16 --plot /tmp/timeline.png
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
from offload.cpu_offload import DEFAULT_CHUNK_BYTES
from offload.host_memory import allocate_host_slabs

GiB = 2**30
MiB = 2**20


class SerialAdamW(torch.optim.AdamW):
    """AdamW as an optimizer the offload wrapper knows nothing about: the serial path."""


def make_params(
    layers: int, device: torch.device | str = "cuda", shrink: int = 1
) -> list[torch.nn.Parameter]:
    """Qwen3-8B layer matrices (each side divided by `shrink`) with small random grads."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(layers):
        for rows, cols in QWEN3_8B_LAYER:
            shape = (rows // shrink, cols // shrink)
            p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
            p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
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


def plot_step_timeline(params, chunk_bytes: int, floor_s: float, path: str, title: str) -> None:
    """One offloaded step (after a warmup step) drawn lane by lane, with the copy floor."""
    from bench.plots import plot_timeline
    from bench.timeline import StepTimeline

    optimizer = CPUOffloadOptimizer(
        torch.optim.AdamW(params, lr=1e-4, foreach=True), chunk_bytes=chunk_bytes
    )
    optimizer.step()  # creates the state: the timed step streams all of it
    with StepTimeline(optimizer) as timeline:
        optimizer.step()
    lanes = timeline.lanes()
    step_s = max(end for boxes in lanes.values() for _, end in boxes)
    plot_timeline(lanes, floor_s, path, f"{title}: step {step_s * 1e3:.1f} ms")


def cpu_smoke_plot(args: argparse.Namespace) -> None:
    """--device cpu: the timeline of a small step from wall-clock marks."""
    params = make_params(args.layers, "cpu", args.shrink)
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in params)
    source = torch.zeros(state_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    start = time.perf_counter()
    target.copy_(source)  # in
    source.copy_(target)  # and out: the host's copies have no second engine
    floor_s = time.perf_counter() - start
    title = f"CPU smoke, {state_bytes / MiB:.1f} MiB AdamW state, 1 MiB chunks"
    plot_step_timeline(params, MiB, floor_s, args.plot, title)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke mode of --plot"
    )
    parser.add_argument("--shrink", type=int, default=1, help="divide each matrix side by this")
    parser.add_argument("--plot", help="also write a timeline PNG of one chunked step here")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--slots", type=int, nargs="+", default=[3])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench/results/offload_step.json")
    args = parser.parse_args()
    if args.device == "cpu":
        if not args.plot:
            raise SystemExit("--device cpu is the smoke mode of --plot: give --plot PATH")
        cpu_smoke_plot(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("offload_step.py measures PCIe copies: it needs a CUDA GPU")

    params = make_params(args.layers, "cuda", args.shrink)
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
    if args.plot:
        title = f"{state_bytes / GiB:.2f} GiB AdamW state, {DEFAULT_CHUNK_BYTES // MiB} MiB chunks"
        plot_step_timeline(params, DEFAULT_CHUNK_BYTES, floor["both_s"], args.plot, title)
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
