"""Full training step on one GPU: optimizer-state offload vs no offload vs FSDP2's CPUOffloadPolicy.

    python -m bench.train_step                 # all arms, batch 16 x 2048, ~5-8 min on an H200
    python -m bench.train_step --batch 4 --arms muon/none,muon/offload+overlap

The llama-0.85b decoder (`bench.model`), bf16 mixed precision, activation
checkpointing, FSDP2 on a world-1 process group, random tokens. Arms, for
AdamW and for Muon:

- none: params, grads and optimizer state on the GPU;
- offload: optimizer state in pinned host memory, streamed through the GPU in
  chunks inside `step()` (CPUOffloadOptimizer);
- offload+overlap: the same, the chunks running alongside the next forward;
- fsdp_cpu_offload: torch's `CPUOffloadPolicy`: sharded params, grads and the
  optimizer step (plain torch AdamW, or our Muon) on the host.

Each arm builds a fresh model and optimizer, runs warmup steps, then:

- a window of steps with the device synchronized only before the first and
  after the last: step ms = window / steps (the only honest number for the
  overlap arm, whose step finishes inside the next forward), and how long
  `step()` takes to return on the host;
- except for the overlap arm, steps with the device synchronized between
  phases: forward + backward ms and optimizer ms.

Peak GPU memory is `max_memory_allocated` after warmup. An arm whose warmup
steps are slow (the host-side optimizer of fsdp_cpu_offload) times fewer steps
so it stays within `--arm-budget-s`. Prints a table with ratios against the
same optimizer's "none" arm and writes JSON. GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.data import random_tokens
from bench.model import ModelConfig, loss_fn
from bench.report import write_json
from bench.train import build, free_port, train_step
from muon_offload import OptimizerConfig

ROOT = Path(__file__).resolve().parents[1]

OPTIMIZERS = ("adamw", "muon")
ARMS = ("none", "offload", "offload+overlap", "fsdp_cpu_offload")
GiB = 2**30


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arms",
        default="all",
        help="comma-separated OPT/ARM (e.g. muon/offload) or ARM for both optimizers; "
        f"ARM in {ARMS}; default all",
    )
    parser.add_argument("--model", choices=("tiny", "llama-0.85b"), default="llama-0.85b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, help="default: the model preset's")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per pass")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--arm-budget-s",
        type=float,
        default=60.0,
        help="cap on an arm's timed seconds: slow arms time fewer steps (at least 1 per pass)",
    )
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "train_step.json")
    return parser.parse_args(argv)


def selected_arms(spec: str) -> list[tuple[str, str]]:
    if spec == "all":
        return [(opt, arm) for opt in OPTIMIZERS for arm in ARMS]
    chosen = []
    for item in spec.split(","):
        opt, _, arm = item.strip().rpartition("/")
        for o in (opt,) if opt else OPTIMIZERS:
            if o not in OPTIMIZERS or arm not in ARMS:
                raise SystemExit(
                    f"unknown arm {item!r}: use OPT/ARM, OPT in {OPTIMIZERS}, ARM in {ARMS}"
                )
            chosen.append((o, arm))
    return chosen


def run_arm(
    opt: str, arm: str, config: ModelConfig, args: argparse.Namespace, mesh, device: torch.device
) -> dict[str, Any]:
    opt_config = OptimizerConfig(
        type=opt,
        lr=args.lr,
        offload="optimizer" if arm.startswith("offload") else "none",
        offload_overlap_forward=arm == "offload+overlap",
    )
    model, optimizer = build(
        config,
        opt_config,
        mesh,
        device,
        mixed_precision=True,
        activation_checkpointing=True,
        cpu_offload_policy=arm == "fsdp_cpu_offload",
    )
    inputs, targets = random_tokens(config.vocab_size, config.seq_len, args.batch, device)
    sync = torch.cuda.synchronize

    def step() -> float:
        """One step, no device sync; seconds until `optimizer.step()` returned."""
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    # Warmup builds plans, allocates state and host slabs; a slow arm stops early.
    warm_s: list[float] = []
    for _ in range(args.warmup):
        sync()
        start = time.perf_counter()
        step()
        sync()
        warm_s.append(time.perf_counter() - start)
        if sum(warm_s) > args.arm_budget_s / 2:
            break
    passes = 1 if arm == "offload+overlap" else 2
    steps = max(1, min(args.steps, math.floor(args.arm_budget_s / passes / warm_s[-1])))
    torch.cuda.reset_peak_memory_stats(device)

    sync()
    start = time.perf_counter()
    returns = [step() for _ in range(steps)]
    sync()
    window_s = time.perf_counter() - start
    result: dict[str, Any] = {
        "optimizer": opt,
        "arm": arm,
        "warmup_steps": len(warm_s),
        "timed_steps": steps,
        "step_ms": 1e3 * window_s / steps,
        "step_returns_ms": 1e3 * statistics.median(returns),
        "fwd_bwd_ms": None,
        "optimizer_ms": None,
    }
    # The phase pass only if the window left room in the arm's budget (slow host steps).
    if passes == 2 and window_s < args.arm_budget_s / 2:
        phases = [train_step(model, optimizer, inputs, targets, sync)[1] for _ in range(steps)]
        result["fwd_bwd_ms"] = 1e3 * statistics.median(t.forward + t.backward for t in phases)
        result["optimizer_ms"] = 1e3 * statistics.median(t.optimizer for t in phases)
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    results = sorted(
        results, key=lambda r: (OPTIMIZERS.index(r["optimizer"]), ARMS.index(r["arm"]))
    )
    base = {r["optimizer"]: r for r in results if r["arm"] == "none" and "error" not in r}

    def ratio(r: dict[str, Any], key: str) -> str:
        b = base.get(r["optimizer"])
        return f"{r[key] / b[key]:.2f}x" if b else "-"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    header = (
        f"{'optimizer':<9} {'arm':<17} {'step ms':>8} {'vs none':>8} {'fwd+bwd':>8} "
        f"{'opt ms':>8} {'returns':>8} {'peak GiB':>9} {'vs none':>8} {'steps':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['optimizer']:<9} {r['arm']:<17} FAILED: {r['error']}")
            continue
        print(
            f"{r['optimizer']:<9} {r['arm']:<17} {r['step_ms']:>8.0f} {ratio(r, 'step_ms'):>8} "
            f"{ms(r['fwd_bwd_ms']):>8} {ms(r['optimizer_ms']):>8} {r['step_returns_ms']:>8.0f} "
            f"{r['peak_gib']:>9.2f} {ratio(r, 'peak_gib'):>8} {r['timed_steps']:>6}"
        )
    print(
        "\nstep ms: window / steps, synced only at its ends; fwd+bwd, opt ms: synced between "
        "phases (not for overlap: that would serialize it); returns: host ms until step() returns"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs a CUDA GPU")
    arms = selected_arms(args.arms)
    config = ModelConfig.preset(args.model, seq_len=args.seq)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    # gloo next to NCCL: with CPUOffloadPolicy, Muon's params (and any collective on
    # them) are on the host.
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (1,))
        print(
            f"{args.model}: {config.num_params() / 1e9:.2f}B params, batch {args.batch} x "
            f"{config.seq_len}, bf16 mixed precision, activation checkpointing, FSDP2 world 1, "
            f"{torch.cuda.get_device_name(device)}",
            flush=True,
        )
        results = []
        for opt, arm in arms:
            started = time.perf_counter()
            try:
                r = run_arm(opt, arm, config, args, mesh, device)
                summary = f"step {r['step_ms']:.0f} ms, peak {r['peak_gib']:.2f} GiB"
            except Exception as error:  # one broken arm should not cost the other arms' run
                traceback.print_exc()
                r = {"optimizer": opt, "arm": arm, "error": f"{type(error).__name__}: {error}"}
                summary = "FAILED"
            results.append(r)
            print(f"{opt}/{arm}: {summary} ({time.perf_counter() - started:.0f} s)", flush=True)
            gc.collect()  # the arm's model and optimizer (and pinned host slabs) go here
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    print_table(results)
    out = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "model": args.model,
        "model_config": dataclasses.asdict(config),
        "batch": args.batch,
        "mixed_precision": "bf16 params, fp32 reduce",
        "activation_checkpointing": True,
        "results": results,
    }
    print()
    write_json(args.json, out)


if __name__ == "__main__":
    main()
