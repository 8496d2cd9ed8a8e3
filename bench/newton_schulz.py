"""Newton-Schulz on Qwen3-8B shapes: plain torch path vs symmetric Triton path vs torch's own.

Per shape: `zeropower(backend="torch")` (the plain path), `muon.ns_triton` under every
fixed configuration in `ns_triton.CONFIGS` (first-call compile cost reported, cold
Triton cache unless --warm-cache), and torch.optim._muon._zeropower_via_newtonschulz
(one matrix at a time; it takes no batch). TFLOP/s counts the FLOPs each arm's path
computes (`bench.ns_flops`: the Triton kernels half of each symmetric product, Gram fewer
products); dense-eq TFLOP/s counts the dense iteration's (REFERENCE.md: 4 m^2 n + 2 m^3
per iteration, m <= n) for every arm, a rate of the algorithm that can pass the GPU's
peak; `peak` is a bf16 8192^3 matmul measured in the same run. The step section also
prints the floor: the symmetric kernels' FLOPs (3 m^2 n + m^3 per
iteration) at the sustained matmul rate (back to back for ~0.6 s, the power-limited
clock a step runs at).
Then the whole Muon step for 12 Qwen3-8B layers (84 matrices): torch.optim.Muon,
muon.Muon plain, muon.Muon triton (default configs, and the fastest one if different).
Prints tables, writes JSON. Keller Jordan schedule, 5 steps, bf16.

`--aspect-sweep` instead times standard vs Gram Newton-Schulz (`algorithm=`), plain and
Triton backends, over aspect ratios 1, 1.5, 2, 3, 4 (short side 4096, batch 4; short side
2048, batch 8; wide and, at aspect 3, tall): standard in bf16, Gram in its path's dtype
(fp16 on CUDA). It prints, per backend and short side, the smallest aspect from which
Gram is faster: what `muon.newton_schulz.GRAM_MIN_ASPECT` should be.

    python -m bench.newton_schulz --out bench/results/newton_schulz_h200.json
    python -m bench.newton_schulz --aspect-sweep --out bench/results/ns_aspect_h200.json
    python -m bench.newton_schulz --device cpu --divisor 32 --skip-triton   # smoke test
    python -m bench.newton_schulz --device cpu --divisor 32 --skip-triton --aspect-sweep
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if "--warm-cache" not in sys.argv:  # before anything imports triton
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ns_bench_triton_")

import torch

from bench.ns_flops import arm_flops, path_flops
from bench.report import write_json
from bench.shapes import QWEN3_8B_LAYER, params_with_grads
from bench.timing import matmul_tflops, sustained_matmul_tflops, sync, time_calls
from muon import KELLER_JORDAN, Muon
from muon.newton_schulz import (
    GRAM_MIN_ASPECT,
    NewtonSchulzPath,
    ns_flops,
    ns_flops_symmetric,
    path_for,
    set_backend,
    zeropower,
)

# (batch, rows, cols)
NS_SHAPES = [
    (1, 4096, 4096),
    (1, 1024, 4096),
    (8, 1024, 4096),
    (1, 4096, 12288),
    (1, 12288, 4096),
    (16, 768, 2048),
    # around `ns_triton.AUTO_MIN_SIDE`, where "auto" starts taking the Triton path
    (4, 1024, 1024),
    (8, 1024, 1024),
    (2, 2048, 2048),
    (1, 3072, 3072),
]


def _first_call(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


ASPECTS = (1.0, 1.5, 2.0, 3.0, 4.0)
SWEEP_SIDES = ((4096, 4), (2048, 8))  # (short side, batch)


def aspect_sweep(args, device: torch.device, backends: list[str]) -> dict[str, object]:
    """Standard vs Gram per backend over aspect ratios; the aspect from which Gram wins."""
    schedule = KELLER_JORDAN
    rows_out, entries = [], []
    for side, batch in SWEEP_SIDES:
        short = side // args.divisor
        for aspect in ASPECTS:
            long = int(short * aspect)
            for shape in [(batch, short, long)] + ([(batch, long, short)] if aspect == 3 else []):
                x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
                entry: dict[str, object] = {"shape": list(shape), "aspect": aspect}
                for backend in backends:
                    for algorithm in ("standard", "gram"):

                        def fn(x=x, b=backend, a=algorithm):
                            return zeropower(x, schedule, backend=b, algorithm=a)

                        arm = f"{algorithm}:{backend}"
                        try:
                            first = _first_call(fn, device)
                            times = time_calls(fn, device, args.warmup - 1, args.repeats)
                        except Exception as e:
                            print(f"{shape} {arm}: FAILED {type(e).__name__}: {str(e)[:200]}")
                            entry[arm] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                            continue
                        dtype = str(path_for(x, backend, algorithm).dtype).split(".")[-1]
                        ms = 1e3 * statistics.median(times)
                        entry[arm] = {"ms": ms, "first_call_s": first, "dtype": dtype}
                    std, gram = entry.get(f"standard:{backend}"), entry.get(f"gram:{backend}")
                    if std and gram and "ms" in std and "ms" in gram:
                        entry[f"std/gram:{backend}"] = ratio = std["ms"] / gram["ms"]
                        rows_out.append(
                            (shape, backend, std["ms"], gram["ms"], ratio, gram["dtype"])
                        )
                entries.append(entry)
                del x
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{'batch x rows x cols':<22} {'backend':<8} {'standard ms':>12} {'gram ms':>9} "
          f"{'std/gram':>9} {'gram dtype':>10}")  # fmt: skip
    for shape, backend, std_ms, gram_ms, ratio, dtype in rows_out:
        key = "x".join(str(d) for d in shape)
        print(f"{key:<22} {backend:<8} {std_ms:>12.3f} {gram_ms:>9.3f} {ratio:>9.2f} {dtype:>10}")
    # Gram pays from the smallest aspect at which it wins at that aspect and every larger one.
    pays: dict[str, object] = {}
    for side, _ in SWEEP_SIDES:
        short = side // args.divisor
        for backend in backends:
            wins = {}
            for e in entries:
                b, rows, cols = e["shape"]
                if min(rows, cols) == short and rows <= cols and f"std/gram:{backend}" in e:
                    wins[e["aspect"]] = e[f"std/gram:{backend}"] > 1.0
            from_aspect = None
            for aspect in sorted(wins, reverse=True):
                if not wins[aspect]:
                    break
                from_aspect = aspect
            pays[f"{short}:{backend}"] = from_aspect
            print(f"short side {short}, {backend}: Gram faster from aspect {from_aspect} "
                  f"(GRAM_MIN_ASPECT[{backend!r}] now {GRAM_MIN_ASPECT[backend]})")  # fmt: skip
    return {"entries": entries, "gram_pays_from_aspect": pays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--divisor", type=int, default=1, help="divide every dim (smoke tests)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--configs", default="all", help="comma-separated ns_triton config names")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--warm-cache", action="store_true", help="keep Triton's disk cache")
    parser.add_argument(
        "--aspect-sweep", action="store_true", help="standard vs Gram over aspect ratios only"
    )
    parser.add_argument("--out", default="bench/results/newton_schulz.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    d = args.divisor
    schedule = KELLER_JORDAN
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, object] = {"device": name}
    ns_triton = None
    if not args.skip_triton:
        from muon import ns_triton

        if not ns_triton.available():
            print("triton not importable: triton arms skipped")
            ns_triton = None
        else:
            import triton

            results["triton"] = triton.__version__
    print(f"torch {torch.__version__}, triton {results.get('triton')}, {name}")
    capability = None
    if device.type == "cuda":
        results["capability"] = list(torch.cuda.get_device_capability(device))
        capability = results["capability"][0]

    if args.aspect_sweep:
        backends = ["torch"] if ns_triton is None else ["torch", "triton"]
        results["aspect_sweep"] = aspect_sweep(args, device, backends)
        write_json(args.out, results)
        return

    n = 8192 // d
    peak = matmul_tflops(device, n, args.warmup, args.repeats)
    results["matmul_peak_tflops"] = peak
    print(f"bf16 matmul {n}^3: {peak:.1f} TFLOP/s")

    configs = []
    if ns_triton is not None:
        names = list(ns_triton.CONFIGS) if args.configs == "all" else args.configs.split(",")
        configs = [ns_triton.CONFIGS[c] for c in names]
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
    except ImportError:
        torch_ns = None
    a_, b_, c_ = schedule.coefficients[0]

    rows_out = []
    per_shape: dict[str, dict[str, object]] = {}
    for batch, rows, cols in NS_SHAPES:
        rows, cols = rows // d, cols // d
        key = f"{batch}x{rows}x{cols}" if batch > 1 else f"{rows}x{cols}"
        shape = (batch, rows, cols) if batch > 1 else (rows, cols)
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        dense = batch * ns_flops(rows, cols, schedule.steps)
        entry: dict[str, object] = {"dense_flops": dense, "m": min(rows, cols)}
        plain = batch * path_flops(rows, cols, path_for(x, "torch"), schedule)
        arms = {"plain": (lambda x=x: zeropower(x, schedule, backend="torch"), plain)}
        if torch_ns is not None:
            mats = list(x.reshape(-1, rows, cols).unbind(0))
            arms["torch._zeropower"] = (  # torch's dense iteration
                lambda mats=mats: [torch_ns(m, (a_, b_, c_), schedule.steps, 1e-7) for m in mats],
                dense,
            )
        symmetric = NewtonSchulzPath("standard", "triton", torch.float16)
        triton_flops = batch * path_flops(rows, cols, symmetric, schedule)
        for cfg in configs:
            arms[f"triton:{cfg.name}"] = (
                lambda x=x, cfg=cfg: ns_triton.zeropower_triton(x, schedule, 1e-7, config=cfg),
                triton_flops,
            )
        for arm, (fn, flops) in arms.items():
            try:
                first = _first_call(fn, device)
                seconds = statistics.median(time_calls(fn, device, args.warmup - 1, args.repeats))
            except Exception as e:  # a config that does not compile here: report, go on
                print(f"{key} {arm}: FAILED {type(e).__name__}: {str(e)[:200]}")
                entry[arm] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                continue
            tflops = flops / seconds / 1e12
            entry[arm] = {
                "ms": 1e3 * seconds,
                "flops": flops,
                "computed_tflops": tflops,
                "pct_peak": 100 * tflops / peak,
                "dense_equiv_tflops": dense / seconds / 1e12,
                "first_call_s": first,
            }
            rows_out.append(
                (key, arm, 1e3 * seconds, tflops, 100 * tflops / peak, dense / seconds / 1e12)
                + (first,)
            )
        tri = {k: v for k, v in entry.items() if k.startswith("triton:") and "ms" in v}
        if tri:
            best = min(tri, key=lambda k: tri[k]["ms"])
            entry["best_triton"] = best
            entry["best_vs_plain"] = entry["plain"]["ms"] / tri[best]["ms"]
            default = f"triton:{ns_triton.config_for(min(rows, cols), max(rows, cols)).name}"
            if default in tri:
                entry["default_vs_plain"] = entry["plain"]["ms"] / tri[default]["ms"]
            auto = path_for(x, "auto", "standard")
            entry["auto_takes_triton"] = auto.backend == "triton"
        per_shape[key] = entry
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["shapes"] = per_shape

    print(
        f"\n{'shape':<16} {'arm':<24} {'ms':>9} {'TFLOP/s':>9} {'%peak':>6} "
        f"{'dense-eq TFLOP/s':>17} {'first s':>8}"
    )
    for key, arm, ms, tf, pct, dense_tf, first in rows_out:
        print(
            f"{key:<16} {arm:<24} {ms:>9.3f} {tf:>9.1f} {pct:>6.0f} {dense_tf:>17.1f} {first:>8.2f}"
        )
    print(
        "TFLOP/s and %peak: the FLOPs the arm's path computes; dense-eq: the dense "
        "iteration's FLOPs, whatever the path computes"
    )
    for key, entry in per_shape.items():
        if "best_triton" in entry:
            default = entry.get("default_vs_plain", float("nan"))
            auto = "takes Triton" if entry["auto_takes_triton"] else "keeps plain"
            slower = entry["auto_takes_triton"] and default < 1
            slower = " (SLOWER than plain where auto takes it)" if slower else ""
            print(
                f"{key:<16} best {entry['best_triton']} {entry['best_vs_plain']:.2f}x plain; "
                f"default {default:.2f}x plain; auto {auto}{slower}"
            )

    # Suggested fixed configs: per m class, the config with the least total time.
    if configs:
        totals: dict[str, dict[str, float]] = {}
        for entry in per_shape.values():
            m = entry["m"] * d  # the classes of `ns_triton.config_for`
            cls = "large" if m >= 2048 else "medium" if m >= 512 else "small"
            for arm, v in entry.items():
                if arm.startswith("triton:") and isinstance(v, dict) and "ms" in v:
                    totals.setdefault(cls, {}).setdefault(arm, 0.0)
                    totals[cls][arm] += v["ms"]
        results["suggested"] = {cls: min(t, key=t.get) for cls, t in totals.items()}
        print(f"suggested configs per class (least total ms): {results['suggested']}")

    if not args.skip_step:
        shapes = [(r // d, c // d) for r, c in QWEN3_8B_LAYER] * args.layers
        step_flops = sum(ns_flops(r, c, schedule.steps) for r, c in shapes)
        step_arms = {"torch.optim.Muon": ("torch", None), "muon.Muon plain": ("torch", None)}
        if ns_triton is not None:
            step_arms["muon.Muon triton"] = ("triton", None)
            best = results.get("suggested", {}).get("large")
            if best is not None and best[len("triton:") :] != ns_triton.LARGE_CONFIG:
                step_arms[f"muon.Muon triton {best[7:]}"] = ("triton", best[7:])
        step: dict[str, object] = {"matrices": len(shapes), "ns_tflop": step_flops / 1e12}
        for arm, (backend, large) in step_arms.items():
            saved = ns_triton.LARGE_CONFIG if ns_triton is not None else None
            previous = set_backend(backend)
            try:
                if large is not None:
                    ns_triton.LARGE_CONFIG = large
                if device.type == "cuda":  # the peak of this arm alone (its params included)
                    torch.cuda.reset_peak_memory_stats(device)
                params = params_with_grads(shapes, device)
                opt = (
                    torch.optim.Muon(params, lr=0.02)
                    if arm == "torch.optim.Muon"
                    else Muon(params, lr=0.02)
                )
                first = _first_call(opt.step, device)
                times = time_calls(opt.step, device, 1, args.step_repeats)
            except Exception as e:
                print(f"step {arm}: FAILED {type(e).__name__}: {str(e)[:300]}")
                step[arm] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                opt = params = None  # not in the next arm's peak
                continue
            finally:
                set_backend(previous)
                if saved is not None:
                    ns_triton.LARGE_CONFIG = saved
            # muon.Muon's ns_algorithm is "auto"; torch.optim.Muon runs the dense iteration
            computed = (
                step_flops
                if arm == "torch.optim.Muon"
                else arm_flops(shapes, backend, "auto", device.type, capability)
            )
            step[arm] = {
                "ms": 1e3 * statistics.median(times),
                "all_ms": [1e3 * t for t in times],
                "first_step_s": first,
                "ns_tflop": computed / 1e12,
            }
            if device.type == "cuda":
                step[arm]["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            del opt, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
        sym_flops = sum(ns_flops_symmetric(r, c, schedule.steps) for r, c in shapes)
        sustained = sustained_matmul_tflops(device, n)
        step["matmul_sustained_tflops"] = sustained
        step["ns_symmetric_tflop"] = sym_flops / 1e12
        step["ns_floor_sustained_ms"] = floor = 1e3 * sym_flops / (sustained * 1e12)
        results["muon_step"] = step
        print(f"\nMuon step, {len(shapes)} matrices, NS {step_flops / 1e12:.1f} TFLOP (dense)")
        print(
            f"{'arm':<34} {'step ms':>9} {'NS TFLOP/s':>11} {'dense-eq TFLOP/s':>17} "
            f"{'first step s':>13}"
        )
        for arm, v in step.items():
            if isinstance(v, dict) and "ms" in v:
                seconds = v["ms"] / 1e3
                print(
                    f"{arm:<34} {v['ms']:>9.1f} {v['ns_tflop'] / seconds:>11.1f} "
                    f"{step_flops / seconds / 1e12:>17.1f} {v['first_step_s']:>13.2f}"
                )
        print(
            "NS TFLOP/s: the FLOPs the arm's paths compute, over the whole step; dense-eq: "
            "the dense iteration's FLOPs"
        )
        print(
            f"symmetric NS is {sym_flops / 1e12:.1f} TFLOP: {floor:.1f} ms at the sustained "
            f"bf16 matmul rate ({sustained:.1f} TFLOP/s back to back for ~0.6 s), "
            f"{1e3 * sym_flops / (peak * 1e12):.1f} ms at the burst rate"
        )

    write_json(args.out, results)


if __name__ == "__main__":
    main()
