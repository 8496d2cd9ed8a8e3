"""The symmetric kernel alone: cuBLAS vs `muon.ns_triton.sym_matmul` under every config.

Per (m, k), batch count and dtype (fp16, bf16), x of shape (batch, m, k):

- `cublas`: `torch.bmm(x, x.mT)`, the full m x m product;
- `sym:<config>`: `sym_matmul(x, config=...)` (y = x), for every config in
  `ns_triton.CONFIGS` (the launch order's band height is the name's `g`);
- for k == m, with commuting symmetric x and y (a polynomial in x, as the Gram
  iteration's `Z W + a W`), c = y:
  `cublas2`: `torch.baddbmm(y, x, y.mT, beta=beta)` and
  `sym2:<config>`: `sym_matmul(x, y, beta=beta, y=y, config=...)`.

"TFLOP/s" counts the FLOPs an arm computes: cuBLAS the full product, 2 batch m^2 k; the
symmetric kernel half of it, batch m^2 k (its diagonal tiles, computed whole, not
counted: a rate at most understated). "dense-eq TFLOP/s" counts the full product for
every arm, so the symmetric kernel's saving of half the tiles shows as a rate above
cuBLAS's, and can pass the GPU's peak. Prints a table, the ratios to
cuBLAS and of each config's two-operand time to its one-operand time (same run), and the
largest relative error against cuBLAS (a broken config shows there), and whether each
config's result has the same bits as the first config's (`bits`: every config should, so
a configuration is a choice of speed only). Batches of 1 and 2 are what the Muon step
launches per shape from a 512 MiB bucket (about 1.4 Qwen3-8B layers); 24 is all 12
layers' gate and up projections at once. Writes JSON.

    python -m bench.sym_kernel --out bench/results/sym_kernel_h200.json
    TRITON_INTERPRET=1 python -m bench.sym_kernel --device cpu --divisor 64 --warmup 0 \\
        --repeats 1 --configs b128k64w4s3g1,b128k64w8s3g8tma   # smoke test (all: ~5 min)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.report import write_json
from bench.timing import time_calls
from muon import ns_triton

SHAPES = [(4096, 4096), (4096, 12288), (1024, 4096)]
"""(m, k); each runs at every `--batches` count."""
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BETA = 0.75


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _commuting_pair(batch: int, m: int, gen: torch.Generator, device, dtype):
    """Symmetric x (eigenvalues within about +-1.5) and y = 0.5 x - 0.8 x^2, in `dtype`."""
    g = torch.randn(batch, m, m, generator=gen, device=device)
    x = (g + g.mT) / (2 * m**0.5)
    y = 0.5 * x - 0.8 * (x @ x)
    return x.to(dtype), ((y + y.mT) / 2).to(dtype)


def _arms(x: torch.Tensor, configs, two_operand: bool, gen: torch.Generator):
    """name -> (call, reference name); `cublas*` arms are the references."""
    arms = {"cublas": (lambda: torch.bmm(x, x.mT), None)}
    for cfg in configs:
        arms[f"sym:{cfg.name}"] = (lambda cfg=cfg: ns_triton.sym_matmul(x, config=cfg), "cublas")
    if two_operand:
        batch, m, _ = x.shape
        xs, ys = _commuting_pair(batch, m, gen, x.device, x.dtype)
        arms["cublas2"] = (lambda: torch.baddbmm(ys, xs, ys.mT, beta=BETA), None)
        for cfg in configs:
            arms[f"sym2:{cfg.name}"] = (
                lambda cfg=cfg: ns_triton.sym_matmul(xs, ys, beta=BETA, y=ys, config=cfg),
                "cublas2",
            )
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--divisor", type=int, default=1, help="divide m and k (smoke tests)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--configs", default="all", help="comma-separated ns_triton config names")
    parser.add_argument("--batches", default="24,2,1", help="comma-separated batch counts")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--out", default="bench/results/sym_kernel.json")
    args = parser.parse_args()
    if not ns_triton.available():
        raise SystemExit("triton is not importable: nothing to time")
    import triton

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}")
    names = list(ns_triton.CONFIGS) if args.configs == "all" else args.configs.split(",")
    configs = [ns_triton.CONFIGS[c] for c in names]
    results: dict[str, object] = {
        "triton": triton.__version__,
        "device": name,
        "beta": BETA,
    }
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    entries: dict[str, dict[str, object]] = {}
    batches = [int(b) for b in args.batches.split(",")]
    for batch, (m, k) in ((b, s) for s in SHAPES for b in batches):
        m, k = m // args.divisor, k // args.divisor
        flops = 2 * batch * m * m * k  # the full product, cuBLAS's
        for dtype_name in args.dtypes.split(","):
            key = f"{batch}x{m}x{k}:{dtype_name}"
            x = (torch.randn(batch, m, k, generator=gen, device=device) * k**-0.25).to(
                DTYPES[dtype_name]
            )
            entry: dict[str, object] = {"dense_flops": flops}
            refs: dict[str, torch.Tensor] = {}
            firsts: dict[str, torch.Tensor] = {}  # the first config's result per prefix
            for arm, (fn, ref) in _arms(x, configs, k == m, gen).items():
                try:
                    out = fn()  # the first call compiles
                    seconds = statistics.median(time_calls(fn, device, args.warmup, args.repeats))
                except Exception as e:  # a config that does not compile here: report, go on
                    print(f"{key} {arm}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    entry[arm] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                    continue
                if ref is None:
                    refs[arm] = out
                    err = 0.0
                else:
                    err = _rel_err(out, refs[ref])
                computed = flops if ref is None else flops // 2  # sym: the lower half
                entry[arm] = {
                    "ms": 1e3 * seconds,
                    "computed_tflops": computed / seconds / 1e12,
                    "dense_equiv_tflops": flops / seconds / 1e12,
                    "err": err,
                }
                if ref is not None:
                    first = firsts.setdefault(arm.split(":")[0], out)
                    entry[arm]["same_bits"] = torch.equal(out, first)
                if ref is not None and "ms" in entry.get(ref, {}):
                    entry[arm]["vs_cublas"] = entry[ref]["ms"] / entry[arm]["ms"]
                one = arm.replace("sym2:", "sym:")
                if arm.startswith("sym2:") and "ms" in entry.get(one, {}):
                    entry[arm]["vs_one_operand"] = entry[arm]["ms"] / entry[one]["ms"]
                del out
            entries[key] = entry
            for arm, v in entry.items():
                if isinstance(v, dict) and "ms" in v:
                    rows.append((key, arm, v))
            del x, refs, firsts
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["entries"] = entries

    print(
        f"\n{'shape:dtype':<22} {'arm':<26} {'ms':>9} {'TFLOP/s':>8} {'dense-eq TFLOP/s':>17} "
        f"{'x cuBLAS':>9} {'2op/1op':>8} {'rel err':>9} {'bits':>5}"
    )
    for key, arm, v in rows:
        vs = f"{v['vs_cublas']:.2f}" if "vs_cublas" in v else "-"
        two = f"{v['vs_one_operand']:.2f}" if "vs_one_operand" in v else "-"
        bits = {True: "same", False: "DIFF"}.get(v.get("same_bits"), "-")
        print(
            f"{key:<22} {arm:<26} {v['ms']:>9.3f} {v['computed_tflops']:>8.1f} "
            f"{v['dense_equiv_tflops']:>17.1f} "
            f"{vs:>9} {two:>8} {v['err']:>9.1e} {bits:>5}"
        )
    differing = [f"{key} {arm}" for key, arm, v in rows if v.get("same_bits") is False]
    results["configs_with_other_bits"] = differing
    print(f"\nconfigs whose bits differ from the first config's: {differing or 'none'}")
    best = {}
    for key, entry in entries.items():
        for prefix in ("sym:", "sym2:"):
            timed = {a: v["ms"] for a, v in entry.items() if a.startswith(prefix) and "ms" in v}
            if timed:
                best[f"{key} {prefix[:-1]}"] = min(timed, key=timed.get)
    results["fastest"] = best
    print("\nfastest config per shape:")
    for what, arm in best.items():
        print(f"  {what:<30} {arm}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
