"""Train a small decoder with FSDP2 and Muon / AdamW, optimizer state offloaded to the host.

    python -m bench.train                      # CPU demo: spawns 2 gloo ranks, ~1-2 min
    torchrun --nproc-per-node 8 bench/train.py --model llama-0.85b --batch 4   # GPUs, NCCL

Without torchrun's env (RANK, WORLD_SIZE) it spawns `--world` CPU ranks on
gloo; under torchrun it uses NCCL and cuda:LOCAL_RANK when CUDA is there. The
data is a synthetic Markov chain (`bench.data`) so the loss visibly falls in a
few dozen steps. Rank 0 prints a progress bar, the loss and each step's split
(forward / backward / optimizer), a summary, and writes JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from bench.data import MarkovData
from bench.model import ModelConfig, Transformer, loss_fn, parallelize
from bench.report import exit_spawned_rank, write_json
from muon_offload import OptimizerConfig, setup_optimizer

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_JSON = ROOT / "bench" / "results" / "train.json"
WARMUP_STEPS = 2  # excluded from the mean step split: they build plans and allocate state


@dataclass
class StepTimes:
    """Seconds of one training step's phases (device synchronized between them)."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    sync: Callable[[], None],
) -> tuple[Tensor, StepTimes]:
    """One forward, backward and optimizer step; returns the (local) loss and phase times.

    `sync` waits for the device (a no-op on CPU) so each phase's time is its own.
    Grads are dropped at the start, not the end: an offloaded step that overlaps
    the next forward has captured them already, and set_to_none frees nothing
    it still reads.
    """
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = loss_fn(model(inputs), targets)
    sync()
    forward_done = time.perf_counter()
    loss.backward()
    sync()
    backward_done = time.perf_counter()
    optimizer.step()
    sync()
    step_done = time.perf_counter()
    return loss.detach(), StepTimes(
        forward_done - start, backward_done - forward_done, step_done - backward_done
    )


def wait_for_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Finish any step still in flight (the offload wrapper's) before params are read."""
    wait = getattr(optimizer, "wait_for_optimizer_step", None)
    if wait is not None:
        wait()


def global_mean(value: Tensor) -> float:
    """Mean over ranks (gloo has no ReduceOp.AVG)."""
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: nn.Module, data: MarkovData, batches: int, device: torch.device) -> float:
    losses = []
    for _ in range(batches):
        inputs, targets = data.next_batch()
        losses.append(loss_fn(model(inputs.to(device)), targets.to(device)))
    return global_mean(torch.stack(losses).mean())


def lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak lr."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Progress:
    """A one-line bar redrawn with \\r on a terminal; every `every` steps a line is kept.

    Without a terminal (CI logs) only the kept lines are printed."""

    def __init__(self, total: int, every: int, width: int = 24) -> None:
        self.total, self.every, self.width = total, every, width
        self.tty = sys.stdout.isatty()

    def update(self, step: int, loss: float, times: StepTimes) -> None:
        filled = round(self.width * step / self.total)
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {step:>4}/{self.total}  "
            f"loss {loss:6.3f}  step {times.total * 1e3:7.1f} ms (fwd {times.forward * 1e3:6.1f}"
            f"  bwd {times.backward * 1e3:6.1f}  opt {times.optimizer * 1e3:6.1f})"
        )
        keep = step % self.every == 0 or step in (1, self.total)
        if self.tty:
            print("\r" + line, end="\n" if keep else "", flush=True)
        elif keep:
            print(line, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="muon")
    parser.add_argument("--offload", choices=("none", "optimizer"), default="optimizer")
    parser.add_argument(
        "--overlap-forward",
        action="store_true",
        help="run the offloaded step's chunks alongside the next forward",
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=5, help="lr warmup steps")
    parser.add_argument("--model", choices=("tiny", "llama-0.85b"), default="tiny")
    parser.add_argument("--dim", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--moe-experts", type=int, help="0: dense MLP; E: MoE of E experts")
    parser.add_argument("--moe-top-k", type=int)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--world", type=int, default=2, help="CPU ranks to spawn (no torchrun)")
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2 bf16 mixed precision (default: on GPU only)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig.preset(
        args.model,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
        seq_len=args.seq,
        moe_experts=args.moe_experts,
        moe_top_k=args.moe_top_k,
    )


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        type=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        offload=args.offload,
        offload_overlap_forward=args.overlap_forward,
    )


def build(
    config: ModelConfig,
    opt_config: OptimizerConfig,
    mesh,
    device: torch.device,
    *,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    cpu_offload_policy: bool = False,
    seed: int = 0,
) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model, identically initialized on every rank, FSDP2-sharded, and its optimizer.

    With `cpu_offload_policy` FSDP2 keeps the sharded params (and so the optimizer
    and its state) on the host: torch's alternative to offloading optimizer state only.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config)
    parallelize(
        model,
        mesh,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
        cpu_offload_policy=cpu_offload_policy,
    )
    return model, setup_optimizer(model, opt_config)


def run(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> None:
    """Train on this rank; the process group is already up."""
    from torch.distributed.device_mesh import init_device_mesh

    config = model_config(args)
    opt_config = optimizer_config(args)
    mixed_precision = device.type == "cuda" if args.bf16 is None else args.bf16
    mesh = init_device_mesh(device.type, (world,))
    model, optimizer = build(
        config,
        opt_config,
        mesh,
        device,
        mixed_precision=mixed_precision,
        activation_checkpointing=args.activation_checkpointing,
        seed=args.seed,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps, args.warmup))
    data = MarkovData(config.vocab_size, config.seq_len, args.batch, rank=rank, seed=args.seed)
    # Two copies of one stream: the evals before and after training see the same batches.
    eval_data = [
        MarkovData(
            config.vocab_size, config.seq_len, args.batch, rank=rank, seed=args.seed, stream=1
        )
        for _ in range(2)
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    lead = rank == 0
    if lead:
        print(
            f"{args.model} model, {config.num_params() / 1e6:.2f}M params, {world} ranks on "
            f"{device.type}, {opt_config.type} / offload={opt_config.offload}"
            f"{' + overlap-forward' if opt_config.offload_overlap_forward else ''}, "
            f"{args.steps} steps x {args.batch} x {config.seq_len} tokens per rank",
            flush=True,
        )
    eval_before = evaluate(model, eval_data[0], args.eval_batches, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(args.steps, args.log_every)
    losses: list[float] = []
    times: list[StepTimes] = []
    for step in range(1, args.steps + 1):
        inputs, targets = (t.to(device) for t in data.next_batch())
        loss, step_times = train_step(model, optimizer, inputs, targets, sync)
        scheduler.step()
        losses.append(global_mean(loss))
        times.append(step_times)
        if lead:
            progress.update(step, losses[-1], step_times)
    wait_for_optimizer(optimizer)
    eval_after = evaluate(model, eval_data[1], args.eval_batches, device)
    if not lead:
        return
    timed = times[WARMUP_STEPS:] or times
    mean_ms = {
        phase: 1e3 * statistics.mean(getattr(t, phase) for t in timed)
        for phase in ("forward", "backward", "optimizer", "total")
    }
    result = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world,
        "model": args.model,
        "model_config": asdict(config),
        "optimizer_config": asdict(opt_config),
        "steps": args.steps,
        "batch_per_rank": args.batch,
        "losses": losses,
        "step_times_s": [asdict(t) for t in times],
        "mean_step_ms": mean_ms,
        "mean_over_steps": [len(times) - len(timed) + 1, len(times)],
        "tokens_per_s": world * args.batch * config.seq_len / (mean_ms["total"] / 1e3),
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "entropy_rate": data.entropy_rate(),
        "peak_gpu_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    }
    print_summary(result)
    print()
    write_json(args.json, result)


def print_summary(result: dict) -> None:
    losses, mean_ms = result["losses"], result["mean_step_ms"]
    first, last = result["mean_over_steps"]
    rows = [
        ("train loss, first -> last step", f"{losses[0]:.3f} -> {losses[-1]:.3f}"),
        (
            "eval loss, before -> after",
            f"{result['eval_loss_before']:.3f} -> {result['eval_loss_after']:.3f}",
        ),
        ("loss floor (chain entropy)", f"{result['entropy_rate']:.3f}"),
        (
            f"mean step ms (steps {first}-{last})",
            f"{mean_ms['total']:.1f} = fwd {mean_ms['forward']:.1f} + bwd "
            f"{mean_ms['backward']:.1f} + opt {mean_ms['optimizer']:.1f}",
        ),
        ("tokens / s (all ranks)", f"{result['tokens_per_s']:,.0f}"),
    ]
    if result["peak_gpu_bytes"] is not None:
        rows.append(("peak GPU memory, rank 0", f"{result['peak_gpu_bytes'] / 2**30:.2f} GiB"))
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    # One thread per rank on a small box: ranks oversubscribing the cores slow everyone.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, args, torch.device("cpu"))
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_spawned_rank()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        try:
            run(rank, world, args, device)
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(_spawned, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
