"""Muon with its momentum offloaded (`CPUOffloadOptimizer(Muon(...))`) against Muon on the GPU.

Two matrix sets, fp32 params (FSDP2's master weights) with random grads, so
fp32 momentum: `qwen3-8b`, 12 Qwen3-8B layers (84 matrices, 2.3B params), and
`llama-2048`, 16 Llama layers of hidden 2048 (q, k, v, o, gate, up, down;
GQA 2048/512, MLP 5632). Arms, all with default settings, in one run:

- unwrapped: `muon.Muon(params)`, momentum on the GPU;
- offloaded: `CPUOffloadOptimizer(muon.Muon(params))`, momentum in pinned host
  memory, streamed in 256 MiB chunks;
- the copy floor: the momentum's bytes H2D and D2H at once on two streams,
  measured here (an offloaded step can be no faster than this, nor than the
  unwrapped step).

Every arm runs once a round, `--rounds` rounds (floor, unwrapped, offloaded, then again),
each built afresh in its round: a time is the median of the rounds, a ratio the median of
the rounds' ratios (each within one round), printed with the rounds' min-max; a peak is
the most of the rounds. After each round's timed steps both arms' params and momentum are
compared bitwise (the same update, however the step is cut), and after the last round one
more offloaded step is traced lane by lane (`bench.timeline`): the busy time of the H2D,
update and D2H lanes says which one bounds the step. Prints a table, writes JSON (and
with `--plot PREFIX` a timeline PNG per set, matplotlib). GPU only.

    python -m bench.muon_offload_step --out bench/results/muon_offload_step.json
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
from collections.abc import Callable

import torch

from bench.offload_step import copy_floor, spread_text, time_steps
from bench.report import write_json
from bench.shapes import LLAMA_2048_LAYER, QWEN3_8B_LAYER, params_with_grads
from bench.timing import in_rounds
from muon import Muon
from offload import CPUOffloadOptimizer
from offload.host_memory import allocate_host_slabs

SETS = {"qwen3-8b": (QWEN3_8B_LAYER, 12), "llama-2048": (LLAMA_2048_LAYER, 16)}
GiB = 2**30


def _trace(opt: CPUOffloadOptimizer, floor_s: float, plot: str | None, title: str):
    """Busy ms per lane of one offloaded step (and its timeline PNG with `plot`)."""
    from bench.timeline import StepTimeline

    with StepTimeline(opt) as timeline:
        opt.step()
    lanes = timeline.lanes()
    if plot is not None:
        from bench.plots import plot_timeline

        step_s = max(end for boxes in lanes.values() for _, end in boxes)
        plot_timeline(lanes, floor_s, plot, f"{title}: step {step_s * 1e3:.1f} ms")
    return {lane: 1e3 * sum(end - start for start, end in boxes) for lane, boxes in lanes.items()}


def set_summary(floor: list[dict], unwrapped: list[dict], offloaded: list[dict]) -> dict:
    """One set's figures from each round's copy floor ({"h2d_s", "d2h_s", "both_s"}) and
    arms ({"step_s", "host_s", "peak_gib"}): ms the median of the rounds, peaks the most,
    ratios the median of the rounds' ratios, each within one round; every round's kept
    (`<field>_rounds`)."""
    result: dict[str, object] = {}
    for arm, rounds in (("unwrapped", unwrapped), ("offloaded", offloaded)):
        result[f"{arm}_ms_rounds"] = [1e3 * r["step_s"] for r in rounds]
        result[f"{arm}_ms"] = statistics.median(result[f"{arm}_ms_rounds"])
        result[f"{arm}_host_ms"] = 1e3 * statistics.median(r["host_s"] for r in rounds)
        result[f"{arm}_peak_gib"] = max(r["peak_gib"] for r in rounds)
    result["copy_floor_ms_rounds"] = [1e3 * f["both_s"] for f in floor]
    result["copy_floor_ms"] = statistics.median(result["copy_floor_ms_rounds"])
    result["copy_h2d_ms"] = 1e3 * statistics.median(f["h2d_s"] for f in floor)
    result["copy_d2h_ms"] = 1e3 * statistics.median(f["d2h_s"] for f in floor)
    rounds = list(zip(floor, unwrapped, offloaded, strict=True))
    result["offloaded_vs_unwrapped_rounds"] = [o["step_s"] / u["step_s"] for _, u, o in rounds]
    result["offloaded_vs_floor_rounds"] = [
        o["step_s"] / max(f["both_s"], u["step_s"]) for f, u, o in rounds
    ]
    for ratio in ("offloaded_vs_unwrapped", "offloaded_vs_floor"):
        result[ratio] = statistics.median(result[f"{ratio}_rounds"])
    return result


def run_set(name: str, steps: int, warmup: int, rounds: int, plot: str | None) -> dict:
    layer, layers = SETS[name]
    shapes = layer * layers
    state_bytes = sum(4 * r * c for r, c in shapes)
    # pinned once: pinning costs seconds each round would repeat
    host = allocate_host_slabs({torch.uint8: 2 * state_bytes}, torch.device("cuda"))[torch.uint8]
    unwrapped_final: list[torch.Tensor] = []
    bitwise: list[bool] = []
    traced: list[CPUOffloadOptimizer] = []

    def floor() -> dict[str, float]:
        measured = copy_floor(state_bytes, host=host)
        torch.cuda.empty_cache()  # its device buffers are not the next arm's peak
        return measured

    def arm(offloaded: bool) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            params = params_with_grads(shapes, torch.device("cuda"))
            opt = Muon(params, lr=0.02)
            if offloaded:
                opt = CPUOffloadOptimizer(opt)
            seconds, host_s, peak = time_steps(opt.step, steps, warmup)
            state = opt.state_dict()["state"]
            # copies on the host: the next arm's peak does not count them, and the traced
            # step does not change them (offloaded momentum is a host slab already)
            final = [p.detach().to("cpu", copy=True) for p in params] + [
                state[i]["momentum_buffer"].to("cpu", copy=True) for i in range(len(params))
            ]
            if not offloaded:
                unwrapped_final[:] = final
            else:
                pairs = zip(unwrapped_final, final, strict=True)
                bitwise.append(all(torch.equal(a, b) for a, b in pairs))
                if len(bitwise) == rounds:  # the last round's: traced after the rounds
                    traced.append(opt)
                else:
                    opt.close()
            del opt, params, state, final
            gc.collect()  # a cycle would keep this arm's buffers in the next arm's peak
            torch.cuda.empty_cache()
            return {"step_s": seconds, "host_s": host_s, "peak_gib": peak / GiB}

        return run

    measured = in_rounds({"floor": floor, "unwrapped": arm(False), "offloaded": arm(True)}, rounds)
    result: dict[str, object] = {"matrices": len(shapes), "state_gib": state_bytes / GiB}
    result.update(set_summary(measured["floor"], measured["unwrapped"], measured["offloaded"]))
    result["bitwise_equal_rounds"] = bitwise
    result["bitwise_equal"] = all(bitwise)
    opt = traced.pop()
    title = f"muon.Muon offloaded, {name}, {state_bytes / GiB:.2f} GiB momentum"
    floor_s = result["copy_floor_ms"] / 1e3
    result["lane_busy_ms"] = _trace(opt, floor_s, plot and f"{plot}_{name}.png", title)
    opt.close()
    del opt
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every arm, round-robin")
    parser.add_argument("--plot", default=None, help="PREFIX: write PREFIX_<set>.png timelines")
    parser.add_argument("--out", default="bench/results/muon_offload_step.json")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds should be >= 1 but is: {args.rounds}")
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "host": platform.node(),
        "rounds": args.rounds,
    }
    header = (
        f"{'set':<11} {'state GiB':>9} {'unwrapped ms':>12} {'offloaded ms':>12} "
        f"{'floor ms':>9} {'ratio':>6} {'rounds':>11} {'vs max(floor, unwrapped)':>24} "
        f"{'rounds':>11} {'peak GiB u/o':>13} bitwise"
    )
    print(f"torch {torch.__version__}, {results['device']}, {args.rounds} rounds")
    print(header)
    for name in args.sets:
        r = run_set(name, args.steps, args.warmup, args.rounds, args.plot)
        results[name] = r
        print(
            f"{name:<11} {r['state_gib']:>9.2f} "
            f"{r['unwrapped_ms']:>12.1f} {r['offloaded_ms']:>12.1f} "
            f"{r['copy_floor_ms']:>9.1f} {r['offloaded_vs_unwrapped']:>5.3f}x "
            f"{spread_text(r['offloaded_vs_unwrapped_rounds'], 3):>11} "
            f"{r['offloaded_vs_floor']:>23.3f}x "
            f"{spread_text(r['offloaded_vs_floor_rounds'], 3):>11} "
            f"{r['unwrapped_peak_gib']:>6.2f}/{r['offloaded_peak_gib']:<6.2f} {r['bitwise_equal']}"
        )
    for name in args.sets:
        r = results[name]
        print(
            f"{name}: ms over the rounds, unwrapped {spread_text(r['unwrapped_ms_rounds'], 1)}, "
            f"offloaded {spread_text(r['offloaded_ms_rounds'], 1)}, floor "
            f"{spread_text(r['copy_floor_ms_rounds'], 1)}"
        )
        busy = ", ".join(f"{k} {v:.1f}" for k, v in r["lane_busy_ms"].items())
        print(f"{name}: busy ms per lane of one offloaded step: {busy}")
    print(
        "ms: median of the rounds; ratios: median of the rounds' ratios, each within one "
        "round; rounds: min-max; peak: the most of the rounds"
    )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
