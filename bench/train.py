"""Train a small decoder with FSDP2 and Muon / AdamW, optimizer state offloaded to the host.

    python -m bench.train                      # CPU demo: spawns 2 gloo ranks, under a minute
    python -m bench.train --compare            # the same seed without offload too: bit-equal?
    torchrun --nproc-per-node 8 -m bench.train --model llama-0.85b --batch 4   # GPUs, NCCL

Without torchrun's env (RANK, WORLD_SIZE) it spawns `--world` CPU ranks on
gloo; under torchrun it uses NCCL and cuda:LOCAL_RANK when CUDA is there. The
data is a synthetic Markov chain (`bench.data`) so the loss visibly falls in a
few dozen steps. Rank 0 prints a progress bar and, every `--log-every` steps,
the mean loss and step time over those steps, then a summary, and writes JSON.

Steps are timed as windows synced only at their ends (one per logged
interval), so an overlapped offloaded step is not serialized by the timing;
the forward / backward / optimizer split comes from CUDA events read after
each window (host clock on the CPU, where every op is synchronous).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from bench.data import MarkovData, check_vocab_size
from bench.model import ModelConfig, Transformer, loss_fn, parallelize
from bench.report import exit_spawned_rank, write_json
from muon_offload import OptimizerConfig, setup_optimizer

RESULTS = Path("bench") / "results"  # under the working directory (an installed demo too)
WARMUP_STEPS = 2  # their own window, left out of the summary: they build plans and allocate


@dataclass
class StepTimes:
    """Seconds of a training step's phases."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


def marked_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    mark: Callable[[], Any],
) -> tuple[Tensor, tuple[Any, Any, Any, Any]]:
    """One forward, backward and optimizer step; returns the (local) loss and `mark()`
    taken at its start and after each phase.

    Grads are dropped at the start, not the end: an offloaded step that overlaps
    the next forward has captured them already, and set_to_none frees nothing
    it still reads.
    """
    optimizer.zero_grad(set_to_none=True)
    start = mark()
    loss = loss_fn(model(inputs), targets)
    forward_done = mark()
    loss.backward()
    backward_done = mark()
    optimizer.step()
    return loss.detach(), (start, forward_done, backward_done, mark())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    targets: Tensor,
    sync: Callable[[], None],
) -> tuple[Tensor, StepTimes]:
    """`marked_step` with the device synced between phases, so each phase's time is
    its own; that serializes an overlapped step (the demo times windows instead)."""

    def mark() -> float:
        sync()
        return time.perf_counter()

    loss, (start, forward, backward, end) = marked_step(model, optimizer, inputs, targets, mark)
    return loss, StepTimes(forward - start, backward - forward, end - backward)


class PhaseClock:
    """Marks phase boundaries without syncing: CUDA events on the current stream, read
    once the window's closing sync has passed them; the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def step_times(self, marks: tuple[Any, Any, Any, Any]) -> StepTimes:
        start, forward, backward, end = marks
        return StepTimes(
            self.seconds(start, forward),
            self.seconds(forward, backward),
            self.seconds(backward, end),
        )


@dataclass
class Window:
    """Steps `first`..`last`, timed together: synced at the window's two ends only."""

    first: int
    last: int
    seconds: float
    phases: StepTimes  # summed over the window's steps
    mean_loss: float  # over the window's steps and the ranks

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


def window_ends(steps: int, log_every: int) -> list[int]:
    """The last step of each window: the warmup, then every `log_every` steps, and the end."""
    ends = {min(WARMUP_STEPS, steps), steps}
    ends.update(range(log_every, steps, log_every))
    return sorted(e for e in ends if e > 0)


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


LR_WARMUP_STEPS = 5
"""The lr's warmup by default (one step fewer than the run where that is shorter)."""


def lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak lr."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Progress:
    """A bar redrawn with \\r on a terminal each step; a line kept per window, with the
    window's mean loss and step time. Without a terminal (CI logs) only the kept lines."""

    def __init__(self, total: int, width: int = 24) -> None:
        self.total, self.width = total, width
        self.tty = sys.stdout.isatty()

    def _bar(self, step: int) -> str:
        filled = round(self.width * step / self.total)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {step:>4}/{self.total}"

    def step(self, step: int) -> None:
        if self.tty:
            print("\r" + self._bar(step), end="", flush=True)

    def window(self, window: Window) -> None:
        n, t = window.steps, window.phases
        span = f"steps {window.first}-{window.last}" if n > 1 else f"step {window.last}"
        line = (
            f"{self._bar(window.last)}  mean of {span}: loss {window.mean_loss:6.3f}  "
            f"step {window.seconds / n * 1e3:7.1f} ms (fwd {t.forward / n * 1e3:6.1f}  "
            f"bwd {t.backward / n * 1e3:6.1f}  opt {t.optimizer / n * 1e3:6.1f})"
        )
        print(("\r" if self.tty else "") + line, flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"should be >= 1 but is: {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"should be >= 0 but is: {value}")
    return value


DEMO_SCRIPT = "muon-offload-demo"  # as installed (pyproject.toml): usage names what was run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=DEMO_SCRIPT if Path(sys.argv[0]).name == DEMO_SCRIPT else "python -m bench.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--optimizer", choices=("adamw", "muon"), default="muon", help="optimizer")
    add("--offload", choices=("none", "optimizer"), default="optimizer", help="state offload")
    add(
        "--overlap-forward",
        action="store_true",
        help="run the offloaded step's chunks alongside the next forward",
    )
    add(
        "--compare",
        action="store_true",
        help="also train without offload from the same seed and check the losses and params "
        "are bit-equal (exit status 3 if not)",
    )
    add("--steps", type=_positive_int, default=80, help="training steps")
    add("--lr", type=float, default=1e-2, help="peak learning rate")
    add("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    add(
        "--warmup",
        type=_non_negative_int,
        help=f"lr warmup steps (default {LR_WARMUP_STEPS}, fewer in a shorter run)%(default).0s",
    )
    add("--model", choices=("tiny", "llama-0.85b"), default="tiny", help="model preset")
    preset = "(%(default)s: the preset's)"
    add("--dim", type=_positive_int, help=f"hidden size {preset}")
    add("--layers", type=_positive_int, help=f"layers {preset}")
    add("--heads", type=_positive_int, help=f"attention heads {preset}")
    add("--kv-heads", type=_positive_int, help=f"key/value heads {preset}")
    add("--ffn", type=_positive_int, help=f"MLP hidden size {preset}")
    add("--vocab", type=_positive_int, help=f"vocabulary size {preset}")
    add("--seq", type=_positive_int, help=f"sequence length {preset}")
    add("--moe-experts", type=_non_negative_int, help=f"0: dense MLP; E: MoE of E experts {preset}")
    add("--moe-top-k", type=_positive_int, help=f"experts per token {preset}")
    add("--batch", type=_positive_int, default=8, help="sequences per rank per step")
    add("--world", type=_positive_int, default=2, help="CPU ranks to spawn (without torchrun)")
    add(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2 bf16 mixed precision (%(default)s: on GPU only)",
    )
    add("--activation-checkpointing", action="store_true", help="recompute in the backward")
    add("--eval-batches", type=_positive_int, default=4, help="eval batches before and after")
    add("--log-every", type=_positive_int, default=10, help="steps per logged (timed) interval")
    add("--seed", type=int, default=0, help="model init and data seed")
    add(
        "--json",
        type=Path,
        default=None,
        help="results file (%(default)s: bench/results/train-<optimizer>-<offload>"
        "[-compare]-<UTC time>.json)",
    )
    return parser


def default_json_path(args: argparse.Namespace, now: time.struct_time) -> Path:
    """A file per run, named by what it ran and when."""
    arm = args.offload + ("-overlap" if args.overlap_forward else "")
    tags = [args.optimizer, arm] + (["compare"] if args.compare else [])
    name = f"train-{'-'.join(tags)}-{time.strftime('%Y%m%d-%H%M%S', now)}.json"
    return Path.cwd() / RESULTS / name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check everything a run needs before it starts (flags, results path)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.overlap_forward and args.offload != "optimizer":
        parser.error("--overlap-forward needs --offload optimizer")
    if args.compare and args.offload != "optimizer":
        parser.error("--compare runs with and without offload; it needs --offload optimizer")
    if args.warmup is None:
        args.warmup = min(LR_WARMUP_STEPS, args.steps - 1)
    elif args.warmup >= args.steps:  # the lr would never reach --lr
        parser.error(
            f"--warmup {args.warmup} should be below --steps {args.steps} (the lr would never "
            "reach --lr)"
        )
    try:
        optimizer_config(args)
    except ValueError as err:
        parser.error(str(err))
    try:  # here, not in the ranks it spawns
        check_vocab_size(model_config(args).vocab_size)
    except ValueError as err:
        parser.error(f"the model flags (--dim, --heads, --kv-heads, --moe-*, ...): {err}")
    if args.json is None:
        args.json = default_json_path(args, time.gmtime())
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--json {args.json}: cannot create its folder: {err}")
    if args.json.is_dir():
        parser.error(f"--json {args.json}: not a writable file path (a folder)")
    target = args.json.resolve()  # where a link leads: the file the run will write
    existed = target.exists()
    try:  # opened, as the end of the run will: a folder's permissions do not say (/sys)
        with open(target, "a"):
            pass
    except OSError as err:
        parser.error(f"--json {args.json}: not a writable file path: {err}")
    if not existed:
        target.unlink()
    return args


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


def train_arm(
    args: argparse.Namespace,
    config: ModelConfig,
    opt_config: OptimizerConfig,
    mesh,
    rank: int,
    device: torch.device,
) -> tuple[dict[str, Any], list[Tensor], list[Tensor]]:
    """Train one arm from the seed; returns its results (means over ranks) and this
    rank's per-step losses and final param shards, for `--compare`."""
    mixed_precision = device.type == "cuda" if args.bf16 is None else args.bf16
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
    eval_before = evaluate(model, eval_data[0], args.eval_batches, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = PhaseClock(device)
    progress = Progress(args.steps) if lead else None
    losses: list[Tensor] = []
    windows: list[Window] = []
    last = 0
    for end in window_ends(args.steps, args.log_every):
        first, last = last + 1, end
        # Batches on the device before the window: a pageable copy inside it would sync.
        batches = [[t.to(device) for t in data.next_batch()] for _ in range(first, end + 1)]
        marks = []
        sync()
        start = time.perf_counter()
        for step, (inputs, targets) in enumerate(batches, first):
            loss, step_marks = marked_step(model, optimizer, inputs, targets, clock.mark)
            scheduler.step()
            losses.append(loss)
            marks.append(step_marks)
            if progress is not None:
                progress.step(step)
        sync()
        seconds = time.perf_counter() - start
        times = [clock.step_times(m) for m in marks]
        phases = StepTimes(*(sum(getattr(t, f) for t in times) for f in StepTimes.__annotations__))
        mean_loss = global_mean(torch.stack(losses[first - 1 :]).mean())
        windows.append(Window(first, end, seconds, phases, mean_loss))
        if progress is not None:
            progress.window(windows[-1])
    wait_for_optimizer(optimizer)
    params = [p.to_local().detach().clone() for p in model.parameters()]  # before the eval
    eval_after = evaluate(model, eval_data[1], args.eval_batches, device)
    step_losses = torch.stack(losses).float()
    dist.all_reduce(step_losses)
    timed = [w for w in windows if w.first > WARMUP_STEPS] or windows
    timed_steps = sum(w.steps for w in timed)
    mean_ms = {
        phase: 1e3 * sum(getattr(w.phases, phase) for w in timed) / timed_steps
        for phase in ("forward", "backward", "optimizer")
    }
    mean_ms["step"] = 1e3 * sum(w.seconds for w in timed) / timed_steps
    result = {
        "optimizer_config": asdict(opt_config),
        "losses": (step_losses / dist.get_world_size()).tolist(),
        "windows": [
            {**asdict(w), "phases": asdict(w.phases), "step_ms": 1e3 * w.seconds / w.steps}
            for w in windows
        ],
        "mean_step_ms": mean_ms,
        "mean_over_steps": [timed[0].first, timed[-1].last],
        "tokens_per_s": dist.get_world_size()
        * args.batch
        * config.seq_len
        / (mean_ms["step"] / 1e3),
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "entropy_rate": data.entropy_rate(),
        "peak_gpu_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    }
    return result, losses, params


def compare_runs(
    reference: tuple[list[Tensor], list[Tensor]], other: tuple[list[Tensor], list[Tensor]]
) -> list[str]:
    """Where two runs differ, bit for bit: (step losses, param shards) each; [] if nowhere."""
    differences = []
    for what, a, b in zip(("loss of step", "param"), reference, other, strict=True):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if not torch.equal(x, y):
                differences.append(f"{what} {i + 1 if what.startswith('loss') else i}")
    return differences


COMPARE_FAILED = 3  # exit status of a --compare whose runs differ


@contextlib.contextmanager
def comparable(device: torch.device) -> Iterator[None]:
    """On CUDA, what two runs need to be comparable bit for bit (two plain runs with
    the fused attention kernels already differ): deterministic algorithms, and the
    math attention kernel. `main` sets cuBLAS's workspace config before CUDA starts."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def arm_name(config: OptimizerConfig) -> str:
    return f"offload={config.offload}" + (" + overlap" if config.offload_overlap_forward else "")


def run(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> int:
    """Train on this rank (the process group is up); returns the exit status."""
    from torch.distributed.device_mesh import init_device_mesh

    config = model_config(args)
    opt_config = optimizer_config(args)
    mesh = init_device_mesh(device.type, (world,))
    arms = [opt_config]
    if args.compare:
        plain = dataclasses.replace(opt_config, offload="none", offload_overlap_forward=False)
        arms = [plain, opt_config]
    lead = rank == 0
    if lead:
        print(
            f"{args.model} model, {config.num_params() / 1e6:.2f}M params, {world} ranks on "
            f"{device.type}, {opt_config.type}, {args.steps} steps x {args.batch} x "
            f"{config.seq_len} tokens per rank",
            flush=True,
        )
    results, runs = [], []
    for arm in arms:
        if lead:
            print(f"\n{arm_name(arm)}", flush=True)
        with comparable(device) if args.compare else contextlib.nullcontext():
            result, losses, params = train_arm(args, config, arm, mesh, rank, device)
        results.append(result)
        runs.append((losses, params))
        if lead:
            print_summary(result)
    status = 0
    payload: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world,
        "model": args.model,
        "model_config": asdict(config),
        "steps": args.steps,
        "batch_per_rank": args.batch,
        "seed": args.seed,
        "arms": results,
    }
    if args.compare:
        differences = compare_runs(*runs)
        count = torch.tensor([len(differences)])
        dist.all_reduce(count)  # on any rank
        equal = count.item() == 0
        payload["compare"] = {"bit_equal": equal, "differences_rank0": differences}
        if lead:
            steps, shards = len(runs[0][0]), len(runs[0][1])
            verdict = (
                f"bit-equal: all {steps} step losses and {shards} param shards on every rank"
                if equal
                else f"NOT bit-equal ({count.item()} differences; rank 0: "
                f"{', '.join(differences[:5]) or 'none'})"
            )
            print(f"\ncompare, seed {args.seed}: {arm_name(arms[1])} vs offload=none: {verdict}")
        status = 0 if equal else COMPARE_FAILED
    if lead:
        print()
        write_json(args.json, payload)
    return status


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
            f"{mean_ms['step']:.1f} (fwd {mean_ms['forward']:.1f}, bwd "
            f"{mean_ms['backward']:.1f}, opt {mean_ms['optimizer']:.1f})",
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
        status = run(rank, world, args, torch.device("cpu"))
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_spawned_rank(status)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def launch(args: argparse.Namespace) -> None:
    """Spawn `--world` gloo ranks on the CPU and wait for them.

    An interrupted launcher (SIGINT or SIGTERM to it alone, not its process
    group) stops its ranks before it exits: none is left training.
    """
    signal.signal(signal.SIGTERM, _interrupt)
    context = mp.start_processes(
        _spawned,
        args=(args.world, free_port(), args),
        nprocs=args.world,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        for process in context.processes:
            process.terminate()
        for process in context.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        print(f"\ninterrupted: stopped {args.world} ranks", file=sys.stderr)
        raise SystemExit(130) from None
    except mp.ProcessExitedException as err:
        if err.exit_code == COMPARE_FAILED:
            raise SystemExit(COMPARE_FAILED) from None
        raise


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        launch(args)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # under torchrun
    if args.compare:  # deterministic cuBLAS, read when CUDA starts (see `comparable`)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        # device_id binds the NCCL communicator to this GPU (without it NCCL guesses
        # from the global rank, which can hang).
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        status = run(rank, world, args, device)
    finally:
        dist.destroy_process_group()
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
