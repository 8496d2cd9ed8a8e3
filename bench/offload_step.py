"""Offloaded AdamW step against the PCIe copy floor and the serial offload path.

Params with Qwen3-8B's matrix shapes (fp32 master weights, as FSDP2 keeps them),
AdamW with 8 bytes of state per param. Arms, all in one run:

- no offload: AdamW with its state on the GPU;
- serial offload: all state in, step, all state out (the path an optimizer
  without subset-step support takes);
- chunked offload at several chunk sizes;
- the copy floor: the state's bytes H2D and D2H at once, on two streams, from
  and to pinned host memory, measured here (after a warmup copy each way).

Every arm runs once a round, `--rounds` rounds (A B C A B C: a machine that drifts moves
every arm alike), each arm built afresh in its round. An arm's step ms is the median of
its rounds; a ratio is the median of the rounds' ratios, each within one round, printed
with the rounds' min-max. Prints a table and writes JSON. GPU only, except the smoke
mode of `--plot`.

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
import statistics
import time
from collections.abc import Callable

import torch

from bench.report import write_json
from bench.shapes import QWEN3_8B_LAYER
from bench.timing import in_rounds, synced_seconds
from offload import CPUOffloadOptimizer
from offload.cpu_offload import DEFAULT_CHUNK_BYTES
from offload.host_memory import allocate_host_slabs

GiB = 2**30
MiB = 2**20
FLOOR_ARM = "copy floor (H2D + D2H at once)"
SERIAL_ARM = "serial offload"


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


def copy_floor(nbytes: int, repeats: int = 5, host: torch.Tensor | None = None) -> dict[str, float]:
    """Median seconds to move `nbytes` each way between pinned host and GPU: one way, and
    both at once, each after a warmup copy. `host`: pinned uint8 of 2 * `nbytes` to copy
    from and to (allocated here without; pinning costs seconds a round would repeat)."""
    if host is None:
        host = allocate_host_slabs({torch.uint8: 2 * nbytes}, torch.device("cuda"))[torch.uint8]
    host_in, host_out = host[:nbytes], host[nbytes:]
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(run: Callable[[], object]) -> float:
        return statistics.median(synced_seconds(run, torch.device("cuda"), 1, repeats))

    def both() -> None:
        with torch.cuda.stream(h2d):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(d2h):
            host_out.copy_(dev_out, non_blocking=True)

    return {
        "h2d_s": timed(lambda: dev_in.copy_(host_in, non_blocking=True)),
        "d2h_s": timed(lambda: host_out.copy_(dev_out, non_blocking=True)),
        "both_s": timed(both),
    }


def _ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def offload_rows(floor_s: list[float], arms: dict[str, list[dict]]) -> list[dict]:
    """The table's rows, the floor's first, from each round's floor seconds (both ways at
    once) and each arm's rounds ({"step_s", "host_s", "peak_gib"} a round): step and host
    seconds the median of the rounds, peak the most; `vs_floor` and `serial_speedup` the
    median of the rounds' ratios, each to the floor or `SERIAL_ARM` of its own round, every
    round's kept (`<field>_rounds`)."""
    serial_s = [r["step_s"] for r in arms[SERIAL_ARM]]
    floor = {"arm": FLOOR_ARM, "step_s_rounds": floor_s, "host_s": None, "peak_gib": None}
    rows = [floor]
    for name, rounds in arms.items():
        peaks = [r["peak_gib"] for r in rounds]
        rows.append(
            {
                "arm": name,
                "step_s_rounds": [r["step_s"] for r in rounds],
                "host_s": statistics.median(r["host_s"] for r in rounds),
                "peak_gib": max(peaks),
                "peak_gib_rounds": peaks,
            }
        )
    for row in rows:
        steps = row["step_s_rounds"]
        row["step_s"] = statistics.median(steps)
        row["vs_floor_rounds"] = _ratios(steps, floor_s)
        row["vs_floor"] = statistics.median(row["vs_floor_rounds"])
        row["serial_speedup_rounds"] = _ratios(serial_s, steps)
        row["serial_speedup"] = statistics.median(row["serial_speedup_rounds"])
    return rows


def spread_text(values: list[float], digits: int, scale: float = 1.0) -> str:
    """ "min-max" of `values` (times `scale`)."""
    return f"{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}"


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
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every arm, round-robin")
    parser.add_argument("--out", default="bench/results/offload_step.json")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds should be >= 1 but is: {args.rounds}")
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
        f"{state_bytes / GiB:.2f} GiB AdamW state, {args.rounds} rounds"
    )
    host = allocate_host_slabs({torch.uint8: 2 * state_bytes}, torch.device("cuda"))[torch.uint8]

    def floor() -> dict[str, float]:
        measured = copy_floor(state_bytes, host=host)
        torch.cuda.empty_cache()  # its device buffers are not the next arm's peak
        print(f"  {FLOOR_ARM}: {measured['both_s'] * 1e3:.1f} ms")
        return measured

    def arm(name: str, build: Callable[[], torch.optim.Optimizer]) -> Callable[[], dict]:
        def run() -> dict[str, float]:
            optimizer = build()
            seconds, host_s, peak = time_steps(optimizer.step, args.steps, args.warmup)
            getattr(optimizer, "close", lambda: None)()
            del optimizer
            gc.collect()
            torch.cuda.empty_cache()
            print(f"  {name}: {seconds * 1e3:.1f} ms (host {host_s * 1e3:.1f} ms)")
            return {"step_s": seconds, "host_s": host_s, "peak_gib": peak / GiB}

        return run

    def chunked(mib: int, slots: int) -> Callable[[], torch.optim.Optimizer]:
        return lambda: CPUOffloadOptimizer(
            torch.optim.AdamW(params, lr=1e-4, foreach=True),
            chunk_bytes=mib * MiB,
            staging_slots=slots,
        )

    arms = {
        FLOOR_ARM: floor,
        "no offload": arm("no offload", lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True)),
        SERIAL_ARM: arm(
            SERIAL_ARM,
            lambda: CPUOffloadOptimizer(SerialAdamW(params, lr=1e-4, foreach=True)),
        ),
    }
    for mib in args.chunk_mib:
        for slots in args.slots:
            name = f"chunked {mib} MiB x {slots} slots"
            arms[name] = arm(name, chunked(mib, slots))
    measured = in_rounds(arms, args.rounds)
    floors = measured.pop(FLOOR_ARM)
    rows = offload_rows([f["both_s"] for f in floors], measured)
    floor_s = {way: statistics.median(f[way] for f in floors) for way in ("h2d_s", "d2h_s")}
    floor_s["both_s"] = rows[0]["step_s"]
    env = {"gpu": torch.cuda.get_device_name(), "host_cpus": os.cpu_count()}
    bandwidth = {
        "h2d_gib_s": state_bytes / GiB / floor_s["h2d_s"],
        "d2h_gib_s": state_bytes / GiB / floor_s["d2h_s"],
        "both_total_gib_s": 2 * state_bytes / GiB / floor_s["both_s"],
    }
    print(
        f"\n{env['gpu']}; pinned H2D {bandwidth['h2d_gib_s']:.1f} GiB/s, D2H "
        f"{bandwidth['d2h_gib_s']:.1f} GiB/s, both at once {bandwidth['both_total_gib_s']:.1f} "
        f"GiB/s total (medians of {args.rounds} rounds)"
    )
    print(
        f"{'arm':34} {'step ms':>9} {'rounds':>13} {'host ms':>8} {'x floor':>8} {'rounds':>11} "
        f"{'x faster than serial':>21} {'rounds':>11} {'peak GiB':>9}"
    )
    for row in rows:
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        host_ms = f"{row['host_s'] * 1e3:.1f}" if row["host_s"] is not None else "-"
        print(
            f"{row['arm']:34} {row['step_s'] * 1e3:9.1f} "
            f"{spread_text(row['step_s_rounds'], 1, 1e3):>13} {host_ms:>8} "
            f"{row['vs_floor']:8.2f} {spread_text(row['vs_floor_rounds'], 2):>11} "
            f"{row['serial_speedup']:21.2f} {spread_text(row['serial_speedup_rounds'], 2):>11} "
            f"{peak:>9}"
        )
    print(
        "step ms: median of the rounds; ratios: median of the rounds' ratios, each within "
        "one round; rounds: min-max; peak: the most of the rounds"
    )
    if args.plot:
        title = f"{state_bytes / GiB:.2f} GiB AdamW state, {DEFAULT_CHUNK_BYTES // MiB} MiB chunks"
        plot_step_timeline(params, DEFAULT_CHUNK_BYTES, floor_s["both_s"], args.plot, title)
    write_json(
        args.out,
        {
            "env": env,
            "rounds": args.rounds,
            "state_bytes": state_bytes,
            "param_bytes": param_bytes,
            "bandwidth": bandwidth,
            "floor": {**floor_s, "rounds": floors},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
