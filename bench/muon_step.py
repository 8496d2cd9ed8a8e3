"""Muon step on Qwen3-8B matrix shapes: muon.Muon vs torch.optim.Muon, plus NS TFLOP/s.

12 layers x (q, k, v, o, gate, up, down) = 84 fp32 matrices on one GPU, same
schedule (Keller Jordan quintic, 5 steps, bf16). Arms: torch.optim.Muon, and
muon.Muon with each (elementwise, Newton-Schulz) backend pair: torch/torch,
torch/triton, fused/triton (`muon.elementwise`, `muon.newton_schulz`), and, where
muon.Muon takes `ns_algorithm`, the default backends with ns_algorithm standard, gram
and auto (Gram Newton-Schulz, chosen per matrix shape under auto). Each arm
runs warmup steps, then timed steps (CUDA events, median). NS-only times the
batched Newton-Schulz alone per backend and algorithm; the step minus the NS-only arm of
its backend and algorithm is the elementwise and exchange overhead. NS TFLOP/s counts the
FLOPs each arm's paths compute (`bench.ns_flops`: the symmetric kernels half of each
symmetric product, Gram fewer products), held against a bf16 8192^3 matmul measured in
the same run; dense-eq TFLOP/s counts REFERENCE.md's dense cost (4 m^2 n + 2 m^3 per
iteration) for every arm: a rate of the algorithm, which can pass the GPU's peak. The
matmul is timed in a burst and sustained (back to back for ~0.6 s, where the GPU sits at
its power-limited clock as during a step); the floor is the symmetric kernels' FLOPs
(3 m^2 n + m^3 per iteration) at the sustained rate; the step floor adds the momentum and
apply passes' bytes (24 per fp32 param) at a device-to-device copy rate measured in the
same run. Parity: the first layer's params and momentum after the timed steps,
fused/triton vs torch/triton (same inputs, same NS). Prints a table, writes JSON. Runs in
well under 2 minutes.

    python -m bench.muon_step --out bench/results/muon_step.json
    python -m bench.muon_step --profile   # also: device time per kernel of one step
    python -m bench.muon_step --device cpu --layers 1 --divisor 32 --no-triton  # smoke test
"""

from __future__ import annotations

import argparse
import inspect
import statistics

import torch

from bench.ns_flops import arm_flops
from bench.report import write_json
from bench.shapes import QWEN3_8B_LAYER, params_with_grads
from bench.timing import (
    copy_bandwidth_gbs,
    matmul_tflops,
    sustained_matmul_tflops,
    sync,
    time_calls,
)
from muon import KELLER_JORDAN, Muon, elementwise, zeropower
from muon.newton_schulz import ns_flops, ns_flops_symmetric, set_backend


def _with_backends(elementwise_backend: str, ns_backend: str, fn):
    previous = elementwise.set_backend(elementwise_backend), set_backend(ns_backend)
    try:
        return fn()
    finally:
        elementwise.set_backend(previous[0])
        set_backend(previous[1])


def _profile(step, device: torch.device) -> list[dict[str, object]]:
    """Device (CPU: host) time per kernel over one step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    rows = [
        {
            "kernel": e.key,
            "ms": (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3,
            "calls": e.count,
        }
        for e in prof.key_averages()
    ]
    return sorted((r for r in rows if r["ms"] > 0), key=lambda r: -r["ms"])


def ns_key(backend: str, algorithm: str) -> str:
    """The results' name of the NS-only arm of `backend` and `algorithm`."""
    return backend if algorithm == "standard" else f"{backend}_{algorithm}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--divisor", type=int, default=1, help="divide every dim (smoke tests)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-cap-mib", type=int, default=None, help="muon.Muon bucket cap")
    parser.add_argument("--no-triton", action="store_true", help="torch backends only")
    parser.add_argument(
        "--profile", action="store_true", help="per-kernel device time of one step, last arm"
    )
    parser.add_argument("--out", default="bench/results/muon_step.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = [(r // args.divisor, c // args.divisor) for r, c in QWEN3_8B_LAYER] * args.layers
    flops = sum(ns_flops(r, c, KELLER_JORDAN.steps) for r, c in shapes)
    sym_flops = sum(ns_flops_symmetric(r, c, KELLER_JORDAN.steps) for r, c in shapes)
    capability = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None

    def computed_flops(backend: str, algorithm: str) -> int:
        return arm_flops(shapes, backend, algorithm, device.type, capability)

    default_flops = computed_flops("auto", "auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {name}, {len(shapes)} matrices, "
        f"NS {flops / 1e12:.1f} TFLOP per step"
    )

    peak = matmul_tflops(device, 8192 // args.divisor, args.warmup, args.repeats)
    sustained = sustained_matmul_tflops(device, 8192 // args.divisor)
    copy_gbs = copy_bandwidth_gbs(device, 2**30 // args.divisor**2)
    # Bytes per param element of the step's two memory-bound passes on these fp32 params:
    # momentum reads the grad and the fp32 buffer, writes the buffer and the 16-bit
    # Newton-Schulz input; apply reads the 16-bit update and reads and writes the param.
    numel = sum(r * c for r, c in shapes)
    elementwise_bytes = numel * ((4 + 4 + 4 + 2) + (2 + 4 + 4))
    results: dict[str, object] = {
        "device": name,
        "matrices": len(shapes),
        "ns_tflop_per_step": flops / 1e12,
        "matmul_peak_tflops": peak,
        "matmul_sustained_tflops": sustained,
        "ns_symmetric_tflop_per_step": sym_flops / 1e12,
        "ns_floor_sustained_ms": 1e3 * sym_flops / (sustained * 1e12),
        "ns_default_tflop_per_step": default_flops / 1e12,
        "ns_default_floor_sustained_ms": 1e3 * default_flops / (sustained * 1e12),
        "copy_gbs": copy_gbs,
        "elementwise_bytes": elementwise_bytes,
        "elementwise_floor_ms": 1e3 * elementwise_bytes / (copy_gbs * 1e9),
    }
    ns_backends = ["torch"] if args.no_triton else ["torch", "triton"]

    # Newton-Schulz alone, batched by shape as muon.Muon does on one device.
    by_shape: dict[tuple[int, int], int] = {}
    for shape in shapes:
        by_shape[shape] = by_shape.get(shape, 0) + 1
    stacks = [torch.randn(n, *s, device=device, dtype=torch.bfloat16) for s, n in by_shape.items()]
    ns_arms = [(b, "standard") for b in ns_backends] + [
        (b, a) for b in [*ns_backends, "auto"] for a in ("gram", "auto")
    ]
    for backend, algorithm in ns_arms:
        ns_s = statistics.median(
            time_calls(
                lambda s=stacks, b=backend, a=algorithm: [
                    zeropower(x, KELLER_JORDAN, backend=b, algorithm=a) for x in s
                ],
                device,
                args.warmup,
                args.repeats,
            )
        )
        key = ns_key(backend, algorithm)
        results[f"ns_{key}_ms"] = 1e3 * ns_s
        results[f"ns_{key}_tflop"] = computed_flops(backend, algorithm) / 1e12
        results[f"ns_{key}_computed_tflops"] = results[f"ns_{key}_tflop"] / ns_s
        results[f"ns_{key}_dense_equiv_tflops"] = flops / ns_s / 1e12
    del stacks

    cap = {} if args.bucket_cap_mib is None else {"bucket_cap_bytes": args.bucket_cap_mib << 20}
    arms: dict[str, tuple[str, str] | None] = {"torch.optim.Muon": None}
    for pair in [("torch", "torch")] + [("torch", b) for b in ns_backends[1:]]:
        arms["muon.Muon {}/{}".format(*pair)] = pair
    if not args.no_triton:
        arms["muon.Muon fused/triton"] = ("triton", "triton")
    # ns_algorithm arms: default backends ("auto": fused elementwise and, per shape, Triton)
    algorithms: dict[str, str] = {}
    takes_algorithm = "ns_algorithm" in inspect.signature(Muon).parameters
    if takes_algorithm:
        for algorithm in ("standard", "gram", "auto"):
            arm = f"muon.Muon auto/auto {algorithm}"
            arms[arm] = ("auto", "auto")
            algorithms[arm] = algorithm
    else:
        print("muon.Muon takes no ns_algorithm: the standard/gram/auto arms are skipped")
    layer = len(QWEN3_8B_LAYER)
    kept: dict[str, list[torch.Tensor]] = {}
    for arm, pair in arms.items():
        if device.type == "cuda":  # each arm's peak from its own params on, not the last's
            torch.cuda.reset_peak_memory_stats(device)
            results["peak_per_arm"] = True
        params = params_with_grads(shapes, device)
        if pair is None:
            opt = torch.optim.Muon(params, lr=0.02)
            times = time_calls(opt.step, device, args.warmup, args.repeats)
        else:
            algorithm = {"ns_algorithm": algorithms[arm]} if arm in algorithms else {}
            opt = Muon(params, lr=0.02, **cap, **algorithm)
            times = _with_backends(
                *pair, lambda o=opt: time_calls(o.step, device, args.warmup, args.repeats)
            )
            if pair[1] == ns_backends[-1]:  # same NS: parity of the elementwise backends
                bufs = [opt.state[p]["momentum_buffer"] for p in params[:layer]]
                kept[pair[0]] = [t.detach().clone() for t in params[:layer] + bufs]
        results[f"{arm}_ms"] = 1e3 * statistics.median(times)
        results[f"{arm}_all_ms"] = [1e3 * t for t in times]
        if device.type == "cuda":
            results[f"{arm}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.profile and arm == list(arms)[-1]:
            step = opt.step if pair is None else lambda o=opt, b=pair: _with_backends(*b, o.step)
            results["profile"] = _profile(step, device)
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(kept) == 2:
        pairs = list(zip(kept["triton"], kept["torch"], strict=True))
        results["fused_vs_torch_bitwise"] = all(torch.equal(a, b) for a, b in pairs)
        results["fused_vs_torch_max_abs_diff"] = max((a - b).abs().max().item() for a, b in pairs)

    best = list(arms)[-1]
    speedup = results["torch.optim.Muon_ms"] / results[f"{best}_ms"]
    results["speedup"] = speedup
    ns_last = ns_key(ns_backends[-1], "standard")
    print(
        f"{'arm':<32} {'step ms':>9} {'NS TFLOP/s':>11} {'dense-eq TFLOP/s':>17} "
        f"{'step - NS ms':>13}"
    )
    for arm, pair in arms.items():
        ms = results[f"{arm}_ms"]
        if pair is None:  # torch.optim.Muon: the dense iteration, one matrix at a time
            arm_ns_flops, overhead = flops, ""
        else:
            # muon.Muon's ns_algorithm is "auto" unless the arm sets it
            algorithm = algorithms.get(arm, "auto" if takes_algorithm else "standard")
            arm_ns_flops = computed_flops(pair[1], algorithm)
            ns_ms = results.get(f"ns_{ns_key(pair[1], algorithm)}_ms")  # no (auto, standard)
            overhead = "" if ns_ms is None else f"{ms - ns_ms:>13.1f}"
        print(
            f"{arm:<32} {ms:>9.1f} {arm_ns_flops / (ms / 1e3) / 1e12:>11.1f} "
            f"{flops / (ms / 1e3) / 1e12:>17.1f} {overhead}"
        )
    for backend, algorithm in ns_arms:
        key = ns_key(backend, algorithm)
        label = f"NS only ({backend}, {algorithm})"
        ms, computed = results[f"ns_{key}_ms"], results[f"ns_{key}_computed_tflops"]
        print(
            f"{label:<32} {ms:>9.1f} {computed:>11.1f} "
            f"{results[f'ns_{key}_dense_equiv_tflops']:>17.1f}"
        )
    print(
        f"bf16 matmul peak {8192 // args.divisor}^3: {peak:.1f} TFLOP/s; "
        f"NS only ({ns_backends[-1]}, standard) at "
        f"{100 * results[f'ns_{ns_last}_computed_tflops'] / peak:.0f}% of it; "
        f"speedup {best} vs torch.optim.Muon {speedup:.2f}x"
    )
    print(
        "NS TFLOP/s: the FLOPs the arm's paths compute (step rows: over the whole step); "
        "dense-eq: the dense iteration's FLOPs, whatever the path computes"
    )
    floor = results["ns_floor_sustained_ms"]
    print(
        f"bf16 matmul sustained (back to back, ~0.6 s): {sustained:.1f} TFLOP/s; NS with "
        f"symmetric products is {sym_flops / 1e12:.1f} TFLOP: floor {floor:.1f} ms at the "
        f"sustained rate ({1e3 * sym_flops / (peak * 1e12):.1f} ms at the burst rate); "
        f"{best} at {results[f'{best}_ms'] / floor:.2f}x that floor"
    )
    default_floor = results["ns_default_floor_sustained_ms"]
    print(
        f"the default path's products (Gram where `ns_path` takes it, as computed: "
        f"`bench.ns_flops`) are {default_flops / 1e12:.1f} TFLOP: floor "
        f"{default_floor:.1f} ms at the sustained rate; {best} at "
        f"{results[f'{best}_ms'] / default_floor:.2f}x that floor"
    )
    step_floor = default_floor + results["elementwise_floor_ms"]
    print(
        f"momentum and apply move {elementwise_bytes / 1e9:.1f} GB: "
        f"{results['elementwise_floor_ms']:.1f} ms at the copy rate measured here "
        f"({copy_gbs:.0f} GB/s); with the default path's FLOP floor a step floor of "
        f"{step_floor:.1f} ms; {best} at {results[f'{best}_ms'] / step_floor:.2f}x it"
    )
    results["step_floor_ms"] = step_floor
    if "fused_vs_torch_bitwise" in results:
        print(
            f"parity fused vs torch elementwise (layer 0 params + momentum): bitwise "
            f"{results['fused_vs_torch_bitwise']}, max abs diff "
            f"{results['fused_vs_torch_max_abs_diff']:.3g}"
        )
    if "profile" in results:
        print(f"\none step of {best}, device time per kernel (torch.profiler):")
        print(f"{'kernel':<64} {'ms':>8} {'calls':>6}")
        for row in results["profile"][:12]:
            print(f"{row['kernel'][:64]:<64} {row['ms']:>8.1f} {row['calls']:>6}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
