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

After the timed steps both arms' params and momentum are compared bitwise
(the same update, however the step is cut), and one more offloaded step is
traced lane by lane (`bench.timeline`): the busy time of the H2D, update and D2H
lanes says which one bounds the step. Prints a table, writes JSON (and with
`--plot PREFIX` a timeline PNG per set, matplotlib). GPU only.

    python -m bench.muon_offload_step --out bench/results/muon_offload_step.json
"""

from __future__ import annotations

import argparse
import platform

import torch

from bench.offload_step import copy_floor, time_steps
from bench.report import write_json
from bench.shapes import LLAMA_2048_LAYER, QWEN3_8B_LAYER, params_with_grads
from muon import Muon
from offload import CPUOffloadOptimizer

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


def run_set(name: str, steps: int, warmup: int, plot: str | None) -> dict[str, object]:
    layer, layers = SETS[name]
    shapes = layer * layers
    result: dict[str, object] = {"matrices": len(shapes)}
    state_bytes = sum(4 * r * c for r, c in shapes)
    floor = copy_floor(state_bytes)
    finals = {}
    for arm in ("unwrapped", "offloaded"):
        params = params_with_grads(shapes, torch.device("cuda"))
        opt = Muon(params, lr=0.02)
        if arm == "offloaded":
            opt = CPUOffloadOptimizer(opt)
        seconds, host_s, peak = time_steps(opt.step, steps, warmup)
        result[f"{arm}_ms"] = 1e3 * seconds
        result[f"{arm}_host_ms"] = 1e3 * host_s
        result[f"{arm}_peak_gib"] = peak / GiB
        state = opt.state_dict()["state"]
        # copies on the host: the next arm's peak does not count them, and the traced
        # step below does not change them (offloaded momentum is a host slab already)
        finals[arm] = [p.detach().to("cpu", copy=True) for p in params] + [
            state[i]["momentum_buffer"].to("cpu", copy=True) for i in range(len(params))
        ]
        if arm == "offloaded":
            title = f"muon.Muon offloaded, {name}, {state_bytes / GiB:.2f} GiB momentum"
            result["lane_busy_ms"] = _trace(
                opt, floor["both_s"], plot and f"{plot}_{name}.png", title
            )
            opt.close()
        del opt, params, state
        torch.cuda.empty_cache()
    result["state_gib"] = state_bytes / GiB
    result["copy_floor_ms"] = 1e3 * floor["both_s"]
    result["copy_h2d_ms"], result["copy_d2h_ms"] = 1e3 * floor["h2d_s"], 1e3 * floor["d2h_s"]
    result["offloaded_vs_unwrapped"] = result["offloaded_ms"] / result["unwrapped_ms"]
    result["offloaded_vs_floor"] = result["offloaded_ms"] / max(
        result["copy_floor_ms"], result["unwrapped_ms"]
    )
    result["bitwise_equal"] = all(
        torch.equal(a, b) for a, b in zip(finals["unwrapped"], finals["offloaded"], strict=True)
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plot", default=None, help="PREFIX: write PREFIX_<set>.png timelines")
    parser.add_argument("--out", default="bench/results/muon_offload_step.json")
    args = parser.parse_args()
    results: dict[str, object] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "host": platform.node(),
    }
    header = (
        f"{'set':<11} {'state GiB':>9} {'unwrapped ms':>12} {'offloaded ms':>12} "
        f"{'floor ms':>9} {'ratio':>6} {'vs max(floor, unwrapped)':>24} "
        f"{'peak GiB u/o':>13} bitwise"
    )
    print(f"torch {torch.__version__}, {results['device']}")
    print(header)
    for name in args.sets:
        r = run_set(name, args.steps, args.warmup, args.plot)
        results[name] = r
        print(
            f"{name:<11} {r['state_gib']:>9.2f} "
            f"{r['unwrapped_ms']:>12.1f} {r['offloaded_ms']:>12.1f} "
            f"{r['copy_floor_ms']:>9.1f} {r['offloaded_vs_unwrapped']:>5.3f}x "
            f"{r['offloaded_vs_floor']:>23.3f}x "
            f"{r['unwrapped_peak_gib']:>6.2f}/{r['offloaded_peak_gib']:<6.2f} {r['bitwise_equal']}"
        )
    for name in args.sets:
        busy = ", ".join(f"{k} {v:.1f}" for k, v in results[name]["lane_busy_ms"].items())
        print(f"{name}: busy ms per lane of one offloaded step: {busy}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
