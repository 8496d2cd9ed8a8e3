"""Host cost of launching the symmetric Newton-Schulz kernel, against cheaper ways to launch it.

Offloaded Muon launches hundreds of Triton kernels a step from the forward's host thread
(the Triton path's zeropower calls), so each launch's host microseconds are the
trainer's. This measures, per call, the host time of:

- `sym_matmul`: the public wrapper (argument checks, config choice, TMA descriptors, then
  `kernel[grid](...)`);
- `jit[grid]`: the same `kernel[grid](...)` with its arguments built once;
- `compiled[grid]`: relaunching the `CompiledKernel` that `kernel[grid](...)` returned
  (private Triton API: skips the argument binding and cache lookup);
- `compiled.run`: its low-level launcher with stream and metadata fetched once;
- `torch.mm` and `torch.add` (1 element): cuBLAS and an ATen launch, for scale;
- `zeropower / 10`: a whole `zeropower_triton` call (Polar Express, 5 iterations: 10
  symmetric products, 5 cuBLAS products, the norm), per product.

The device is kept busy (`torch.cuda._sleep`) while the calls are timed, so a launch
never waits for the GPU and the perf_counter time is host time only. Each arm's output
is compared bitwise with the wrapper's. Prints a table and writes JSON.

    python -m bench.triton_launch --json bench/results/triton_launch.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import run_info, write_json
from muon import ns_triton
from muon.ns_schedules import SCHEDULES

SHAPES = [(2048, 2048), (1024, 5632), (512, 2048)]
"""(m, k) of 0.85B Llama's matrices as Newton-Schulz sees them (m <= k)."""


def _host_us(fn, calls: int, repeats: int) -> list[float]:
    """Host microseconds per call of `fn`, `calls` at a time, the device busy throughout."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles: the launches stay queued
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return out


def _launch_args(m: int, k: int, x: torch.Tensor, out: torch.Tensor):
    """The kernel, grid and keyword arguments `sym_matmul(x, out=out)` launches with."""
    cfg = ns_triton.config_for(m, k)
    rows = -(-m // (cfg.block * cfg.height))
    grid = (cfg.height * rows * (rows + 1) // 2, 1)
    x3, o3 = x.unsqueeze(0), out.unsqueeze(0)
    common = dict(
        c_ptr=o3, out_ptr=o3, scale_ptr=o3, M=m, K=k,
        scb=o3.stride(0), scm=o3.stride(1), scn=o3.stride(2),
        sob=o3.stride(0), som=o3.stride(1), son=o3.stride(2),
        alpha=1.0, beta=0.0, diag=0.0,
        HAS_C=False, SCALE_POWER=0, BLOCK=cfg.block, BLOCK_K=cfg.block_k, UPCAST=False,
        GROUP=cfg.group, HEIGHT=cfg.height,
    )  # fmt: skip
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [cfg.height * cfg.block, cfg.block_k])
        y_desc = (
            x_desc if cfg.height == 1 else TensorDescriptor.from_tensor(x, [cfg.block, cfg.block_k])
        )
        descs = dict(x_desc=x_desc, y_desc=y_desc)
        return ns_triton._sym_kernel_tma, grid, {**descs, **common}, cfg
    strides = dict(
        sxb=x3.stride(0), sxm=x3.stride(1), sxk=x3.stride(2),
        syb=x3.stride(0), sym=x3.stride(1), syk=x3.stride(2),
    )  # fmt: skip
    kw = dict(x_ptr=x3, y_ptr=x3, **strides, **common, EVEN_K=k % cfg.block_k == 0)
    return ns_triton._sym_kernel, grid, kw, cfg


def _positional(kernel, kw: dict) -> list:
    """kw in the kernel's parameter order (a KeyError names a parameter this bench misses)."""
    if set(kernel.arg_names) != set(kw):
        raise ValueError(f"kernel takes {kernel.arg_names}, built {list(kw)}")
    return [kw[name] for name in kernel.arg_names]


def _arms(
    m: int, k: int, gen: torch.Generator
) -> tuple[dict, dict, torch.Tensor, torch.Tensor, str]:
    """name -> call for one shape, name -> why it could not run, the output every
    symmetric arm writes, the wrapper's result, and the config's name."""
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16() / k**0.5
    ref = ns_triton.sym_matmul(x)
    out = torch.empty_like(ref)
    kernel, grid, kw, cfg = _launch_args(m, k, x, out)
    args = _positional(kernel, kw)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    compiled = kernel[grid](*args, **opts)
    torch.cuda.synchronize()
    arms = {
        "sym_matmul": lambda: ns_triton.sym_matmul(x, out=out),
        "jit[grid]": lambda: kernel[grid](*args, **opts),
    }
    errors = {}
    try:
        runner = compiled[grid + (1,)]
        runner(*args)
        arms["compiled[grid]"] = lambda: runner(*args)
    except Exception as e:  # noqa: BLE001 - a private API: record how it failed
        errors["compiled[grid]"] = f"{type(e).__name__}: {e}"
    try:
        compiled._init_handles()
        launch = compiled.run
        head = (*grid, 1, torch.cuda.current_stream().cuda_stream)
        tail = (compiled.function, compiled.packed_metadata, None, None, None, *args)
        launch(*head, *tail)
        arms["compiled.run"] = lambda: launch(*head, *tail)
    except Exception as e:  # noqa: BLE001
        errors["compiled.run"] = f"{type(e).__name__}: {e}"
    a, b = x.clone(), x.mT.contiguous()
    mm_out = torch.empty(m, m, device="cuda", dtype=x.dtype)
    one = torch.zeros(1, device="cuda")
    arms["torch.mm"] = lambda: torch.mm(a, b, out=mm_out)
    arms["torch.add"] = lambda: one.add_(1.0)
    schedule = SCHEDULES["polar_express"]
    arms["zeropower / 10"] = lambda: ns_triton.zeropower_triton(x, schedule, 1e-7)
    return arms, errors, out, ref, cfg.name


def run(calls: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k in SHAPES:
        arms, errors, out, ref, config = _arms(m, k, gen)
        for name, call in arms.items():
            out.zero_()
            call()
            torch.cuda.synchronize()
            same = torch.equal(out, ref) if name.startswith(("sym", "jit", "compiled")) else None
            if name == "zeropower / 10":  # ~20 launches a call: the launch queue's room
                us = [u / 10 for u in _host_us(call, max(calls // 20, 1), repeats)]
            else:
                us = _host_us(call, calls, repeats)
            rows.append(
                dict(m=m, k=k, config=config, arm=name, host_us_median=statistics.median(us),
                     host_us_min=min(us), host_us=us, bit_equal=same)
            )  # fmt: skip
        for name, err in errors.items():
            rows.append(dict(m=m, k=k, config=config, arm=name, error=err))
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not ns_triton.available():
        raise SystemExit("bench.triton_launch needs CUDA and triton")
    result = run(args.calls, args.repeats)
    print(f"{'m':>5} {'k':>5} {'config':<18} {'arm':<15} {'host us/call':>12} {'min':>7} bits")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['m']:>5} {r['k']:>5} {r['config']:<18} {r['arm']:<15} failed: {r['error']}")
            continue
        bits = "" if r["bit_equal"] is None else ("equal" if r["bit_equal"] else "DIFFER")
        print(
            f"{r['m']:>5} {r['k']:>5} {r['config']:<18} {r['arm']:<15} "
            f"{r['host_us_median']:>12.2f} {r['host_us_min']:>7.2f} {bits}"
        )
    if args.json:
        write_json(
            args.json,
            {"device": torch.cuda.get_device_name(), "run": run_info(), "calls": args.calls}
            | result,
        )


if __name__ == "__main__":
    main()
