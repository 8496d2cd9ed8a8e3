"""Full training step on one GPU: optimizer-state offload vs no offload vs the alternatives.

    python -m bench.train_step                                  # bench model, all arms, batch 16
    python -m bench.train_step --model hf-llama-0.85b           # transformers LlamaForCausalLM
    python -m bench.train_step --model hf-llama-0.85b --batch 4 --micro-batches 4 \\
        --arms adamw/none,adamw/offload,adamw/offload+overlap   # gradient accumulation
    python -m bench.train_step --model hf-llama-0.85b --batch 4 --arms adamw/none \\
        --resident-sweep 0,1GiB,2GiB,3GiB,auto                  # + PNG next to the JSON
    python -m bench.train_step --model hf-llama-0.85b \\
        --arms plain/none,plain/offload+overlap,plain/torchao
    python -m bench.train_step --model hf-llama-0.85b --batch 4 --phases \\
        --arms adamw/none,adamw/offload+overlap     # + device and host ms per phase
    python -m bench.train_step --model hf-llama-0.85b --batch 4 --host-profile \\
        --arms muon/none,muon/offload+overlap       # + the host's ms a step per function

Smoke mode on the CPU (tiny sizes, seconds, every code path but the CUDA-only ones):

    python -m bench.train_step --device cpu --model hf-llama-tiny --batch 2 --steps 2 --warmup 1 \\
        --arms all,plain/none,plain/offload+overlap --resident-sweep 0,64KiB,auto

Models: `llama-0.85b` / `tiny` (`bench.model`), or `hf-llama-0.85b` / `hf-llama-tiny`,
a transformers `LlamaForCausalLM` (hidden 2048, 16 layers, MLP 5632, 16 / 4 heads,
vocab 32000, untied head; transformers is optional and the run stops with one line
without it). FSDP2 on a world-1 process group, `fully_shard` per decoder layer
then the root (`--wrap torchtitan`: the final norm and lm_head as their own unit),
bf16 mixed precision, activation checkpointing, optimizer from
`muon_offload.setup_optimizer(model, OptimizerConfig(...))`, random tokens copied in
from pinned host memory each step.

Arms, `OPT/ARM` with OPT adamw or muon (a bare ARM means both):

- none: params, grads and optimizer state on the GPU;
- offload: optimizer state in pinned host memory, streamed through the GPU in
  chunks inside `step()` (CPUOffloadOptimizer);
- offload+overlap: the same, the chunks running alongside the next forward;
- offload+overlap+bwd: and the next step's first chunks loaded during the backward
  (`offload_load_in_backward=True`); offload+overlap+bwd=BYTES: that much state loaded
  in the backward (`offload_load_in_backward=BYTES`, extra staging slots), +bwd=0: none
  (`False`; an arm without +bwd loads what the tuning chooses);
- offload+overlap[+bwd]@BYTES (or @auto): with `offload_gpu_resident_bytes=BYTES`, state
  kept on the GPU; `--resident-sweep` adds one per value (and the none and
  offload+overlap arms the plot compares against) and plots step time and peak
  memory against resident bytes;
- fsdp_cpu_offload: torch's `CPUOffloadPolicy` (sharded params, grads and the
  step on the host);
- plain/none, plain/offload+overlap, plain/torchao: the model as a plain module
  (no FSDP), bf16 autocast, fused AdamW: on the GPU, in our CPUOffloadOptimizer,
  or in torchao's `CPUOffloadOptimizer` (when torchao is importable);
  plain/offload+overlap+bwd=BYTES: ours with that much state loaded in the backward
  (0: none);
- any arm%NAME=VALUE[%NAME=VALUE...]: that arm with environment variables set in its
  process (`muon/offload+overlap%MUON_NS_BACKEND=torch`), an A/B of a switch read from
  the environment measured beside the other arms, in one table and the same rounds.

Each arm runs in its own process (a fresh model, optimizer and allocator, and its
own peak memory): warmup steps, then a window of `--steps` steps with the device
synchronized only at its ends; step ms is the median over the window's steps
(CUDA events recorded between steps), and how long `step()` takes to return on
the host. Every arm times as many steps. Peak memory is `max_memory_allocated` over the
window. The "none" arms (the baselines) run `--baseline-runs` times, spread evenly among
the other arms (first and last with 2): their row has the median of their runs' times and
the most of their memory, and the table gives each run and the spread, since the baseline
moves between runs as much as the arms differ; `--rounds N` runs every other arm N times,
round-robin, merged alike. Each arm's process first records the machine as it finds it
(`bench.machine`: a fixed Python loop's ms, the host link's copy rates), printed beside
its step ms: machines, and cores of one machine, differ in both. Prints a table with
ratios against the same optimizer's "none" arm in this run and writes JSON. With
`--phases`, each overlapped arm is also set against the least step its forward's loads
allow (`step_floor_ms`: the physical limit at the state it loads in the forward); with
`--link-timeline` too, where in the step each direction of the host link was busy
(`bench.link_timeline`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import multiprocessing
import os
import queue
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import muon.elementwise
import muon.newton_schulz
from bench import hf_llama
from bench.data import random_tokens
from bench.link_timeline import FIELDS as LINK_FIELDS
from bench.link_timeline import LinkTimeline, timing_event
from bench.machine import describe, probe
from bench.model import ModelConfig, Transformer, loss_fn, parallelize
from bench.phases import PHASES, PhaseMarks, decoder_layers_and_head
from bench.report import write_json
from bench.timing import GcPauses, full_collections, sync, timed_window
from bench.train import free_port
from muon_offload import OptimizerConfig, setup_optimizer
from offload import CPUOffloadOptimizer
from offload.backward_tuning import TUNING_STEPS_AT_MOST
from offload.residency import AUTO_MEASURED_STEPS, AUTO_STEPS_AT_MOST, AUTO_WARMUP_STEPS

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("tiny", "llama-0.85b", *hf_llama.PRESETS)
OPTIMIZERS = ("adamw", "muon")
ARMS = ("none", "offload", "offload+overlap", "offload+overlap+bwd", "fsdp_cpu_offload")
OVERLAP_ARMS = ("offload+overlap", "offload+overlap+bwd")  # may keep resident state (@BYTES)
PLAIN_ARMS = ("none", "offload+overlap", "offload+overlap+bwd", "torchao")
GiB = 2**30
UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
RESIDENT_FIELD = "offload_gpu_resident_bytes"
ARM_EXIT_WAIT_S = 600.0
"""Seconds to wait for an arm's process to exit once it has reported (its teardown)."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One measured configuration."""

    optimizer: str
    """adamw or muon ("plain" arms are AdamW)."""
    mode: str
    """One of ARMS, or of PLAIN_ARMS when `plain`."""
    plain: bool = False
    resident: int | str | None = None
    """offload_gpu_resident_bytes (bytes or "auto") of a sweep point."""
    backward_load: int | None = None
    """offload_load_in_backward's bytes of a +bwd=BYTES arm (0: no loads)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set in the arm's process (`%NAME=VALUE`)."""

    @property
    def name(self) -> str:
        loads = "" if self.backward_load is None else f"={bytes_text(self.backward_load)}"
        env = "".join(f"%{k}={v}" for k, v in self.env)
        if self.plain:
            return f"plain/{self.mode}{loads}{env}"
        suffix = "" if self.resident is None else f"@{bytes_text(self.resident)}"
        return f"{self.optimizer}/{self.mode}{loads}{suffix}{env}"


def bytes_text(value: int | str) -> str:
    """A byte count as the arms spell it: 2GiB, 1.5GiB, 512MiB, 100B; "auto" as is."""
    if isinstance(value, str):
        return value
    for unit in ("GiB", "MiB", "KiB"):
        if value >= UNITS[unit]:
            return f"{value / UNITS[unit]:g}{unit}"
    return f"{value}B"


def parse_bytes(text: str) -> int | str:
    """ "auto", or a byte count with an optional KiB / MiB / GiB suffix."""
    if text == "auto":
        return text
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?", text.strip())
    if match is None:
        raise SystemExit(f"resident bytes {text!r}: use auto or a number with B/KiB/MiB/GiB")
    return int(float(match[1]) * UNITS[match[2] or ""])


def _load_bytes(text: str, item: str) -> int | None:
    """The bytes of arm `item`'s `+bwd=BYTES` (`text`), None without."""
    loads = parse_bytes(text) if text else None
    if loads == "auto":
        raise SystemExit(f"arm {item!r}: backward load bytes are a number, not auto")
    return loads


def load_in_backward(arm: Arm) -> int | bool | None:
    """What the arm passes as `load_in_backward`: None (the default, tuned) but for +bwd
    arms: True (a ring's worth), False for +bwd=0, or the bytes."""
    if arm.mode != "offload+overlap+bwd":
        return None
    if arm.backward_load is None:
        return True
    return arm.backward_load or False


def _arm_env(items: Sequence[str], arm: str) -> tuple[tuple[str, str], ...]:
    """An arm's `%NAME=VALUE` parts as (name, value) pairs."""
    env = []
    for text in items:
        name, equals, value = text.partition("=")
        if not equals or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is None:
            raise SystemExit(f"arm {arm!r}: {text!r} is not NAME=VALUE (an environment variable)")
        env.append((name, value))
    return tuple(env)


def selected_arms(spec: str, sweep: Sequence[int | str], sweep_optimizers: str) -> list[Arm]:
    """The arms `--arms`, `--resident-sweep` and `--sweep-optimizers` ask for, in order."""
    chosen: list[Arm] = []
    for text in spec.split(","):
        item, *env_items = text.strip().split("%")
        env = _arm_env(env_items, text.strip())
        if item == "all":
            chosen += [Arm(o, a, env=env) for o in OPTIMIZERS for a in ARMS]
            continue
        prefix, _, arm = item.rpartition("/")
        if prefix == "plain":
            mode, _, loads = arm.partition("=")
            if mode not in PLAIN_ARMS or (mode == "offload+overlap+bwd") != bool(loads):
                raise SystemExit(
                    f"unknown arm {item!r}: plain/ARM with ARM in {PLAIN_ARMS}, "
                    "offload+overlap+bwd=BYTES"
                )
            loaded = _load_bytes(loads, item)
            chosen.append(Arm("adamw", mode, plain=True, backward_load=loaded, env=env))
            continue
        mode, _, resident = arm.partition("@")
        mode, _, loads = mode.partition("=")
        for o in (prefix,) if prefix else OPTIMIZERS:
            if (
                o not in OPTIMIZERS
                or mode not in ARMS
                or (resident and mode not in OVERLAP_ARMS)
                or (loads and mode != "offload+overlap+bwd")
            ):
                raise SystemExit(
                    f"unknown arm {item!r}: use OPT/ARM, OPT in {OPTIMIZERS}, ARM in {ARMS} "
                    f"or ARM@BYTES with ARM in {OVERLAP_ARMS}, offload+overlap+bwd=BYTES, or "
                    f"plain/ARM with ARM in {PLAIN_ARMS}"
                )
            chosen.append(
                Arm(
                    o,
                    mode,
                    resident=parse_bytes(resident) if resident else None,
                    backward_load=_load_bytes(loads, item),
                    env=env,
                )
            )
    for o in sweep_optimizers.split(",") if sweep else ():
        if o not in OPTIMIZERS:
            raise SystemExit(f"--sweep-optimizers: {o!r} is not one of {OPTIMIZERS}")
        chosen += [Arm(o, "none"), Arm(o, "offload+overlap")]
        chosen += [Arm(o, "offload+overlap", resident=r) for r in sweep]
    return list(dict.fromkeys(chosen))  # once each, first mention's order


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--arms",
        default="all",
        help=f"comma-separated OPT/ARM (e.g. muon/offload), ARM for both optimizers, "
        f"OPT/offload+overlap[+bwd]@BYTES, plain/ARM, or all; ARM in {ARMS}, plain ARM in "
        f"{PLAIN_ARMS}; any arm%%NAME=VALUE sets an environment variable in its process",
    )
    parser.add_argument("--model", choices=MODELS, default="llama-0.85b")
    parser.add_argument("--wrap", choices=hf_llama.WRAPS, default="per-layer", help="hf models")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke")
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation")
    parser.add_argument("--seq", type=int, help="default: the model preset's")
    parser.add_argument("--steps", type=int, default=6, help="timed steps, every arm")
    parser.add_argument(
        "--baseline-runs",
        type=int,
        default=2,
        help="runs of each none arm, spread evenly among the other arms (first and last)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each other arm, round-robin (A B A B), merged like the none arm's",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--resident-sweep",
        default="",
        help="comma-separated offload_gpu_resident_bytes values (e.g. 0,1GiB,auto): one "
        "offload+overlap arm each, and a PNG of step time and peak memory next to the JSON",
    )
    parser.add_argument("--sweep-optimizers", default="adamw", help="optimizers to sweep")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--chunk-bytes",
        type=parse_bytes,
        help="offload_chunk_bytes of the offload arms (e.g. 512MiB; default: the config's)",
    )
    parser.add_argument(
        "--gpu-budget",
        type=parse_bytes,
        help="offload_gpu_budget_bytes of the @auto arms and of the offload+overlap arms "
        "whose backward loads are tuned (nothing resident, no +bwd bytes; plain ones too) "
        "(e.g. 3.5GiB; default: the config's, what the device has free)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each step's phases (bench.phases: device and host ms; one micro-batch)",
    )
    parser.add_argument(
        "--link-timeline",
        action="store_true",
        help="with --phases: per overlapped arm, when each direction of the host link was "
        "busy in the forward and the backward, and when the forward's first load started "
        "(bench.link_timeline: device events around each load and write-back)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="after the window, profile 2 steps per arm (torch.profiler): a gzipped Chrome "
        "trace next to the JSON, one per arm (every stream's kernels and copies)",
    )
    parser.add_argument(
        "--trace-search",
        action="store_true",
        help=f'profile "auto"\'s search steps {TRACE_SEARCH_STEPS[0]}-{TRACE_SEARCH_STEPS[1] - 1} '
        "(the last measured step, whose backward loads ahead, and the first choice's two "
        "steps): a gzipped Chrome trace next to the JSON; the search's later steps and the "
        "window run after the profiler's export, which holds the host",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help=f"after the window, run {HOST_PROFILE_STEPS} steps per arm under cProfile: the "
        "project's own functions by host ms a step in the JSON (`host_profile`) and the "
        "table, the whole profile in a text file next to the JSON",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "train_step.json")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.micro_batches < 1:
        raise SystemExit("--batch and --micro-batches should be >= 1")
    if args.baseline_runs < 1:
        raise SystemExit(f"--baseline-runs should be >= 1 but is: {args.baseline_runs}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds should be >= 1 but is: {args.rounds}")
    if args.steps < 1:
        raise SystemExit(f"--steps should be >= 1 but is: {args.steps}")
    if args.phases and args.micro_batches != 1:
        raise SystemExit("--phases times one micro-batch a step: drop --micro-batches")
    if args.link_timeline and not args.phases:
        raise SystemExit("--link-timeline sets the copies against the phases: give --phases")
    if args.link_timeline and args.device != "cuda":
        raise SystemExit("--link-timeline times copies with device events: give --device cuda")
    if args.link_timeline and args.steps < 3:
        raise SystemExit("--link-timeline reads the steps with one before and after: --steps >= 3")
    args.sweep = [parse_bytes(v) for v in args.resident_sweep.split(",") if v.strip()]
    return args


def resident_supported() -> bool:
    return RESIDENT_FIELD in {f.name for f in dataclasses.fields(OptimizerConfig)}


def unsupported_reason(arm: Arm, device: torch.device) -> str | None:
    """Why `arm` cannot run here, or None."""
    if arm.resident is not None and not resident_supported():
        return f"unsupported: OptimizerConfig has no {RESIDENT_FIELD} in this version"
    if arm.plain and arm.mode == "torchao":
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            return "unsupported: torchao is not installed"
        if device.type != "cuda":
            return "unsupported: torchao's CPUOffloadOptimizer needs CUDA"
    return None


def build_model(arm: Arm, args: argparse.Namespace, mesh, device: torch.device):
    """The arm's model (FSDP2-sharded unless plain) and its loss on (inputs, targets)."""
    policy = arm.mode == "fsdp_cpu_offload"
    if args.model in hf_llama.PRESETS:
        model = hf_llama.build_hf_llama(args.model, device)
        if arm.plain:
            hf_llama.enable_activation_checkpointing(model)
        else:
            hf_llama.shard_hf_llama(model, mesh, wrap=args.wrap, cpu_offload_policy=policy)

        def loss(inputs, targets):
            return hf_llama.causal_lm_loss(model, inputs)
    else:
        config = ModelConfig.preset(args.model, seq_len=args.seq)
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(config)
        if arm.plain:
            for layer in model.layers:
                layer.activation_checkpointing = True
        else:
            parallelize(
                model,
                mesh,
                mixed_precision=True,
                activation_checkpointing=True,
                cpu_offload_policy=policy,
            )

        def loss(inputs, targets):
            return loss_fn(model(inputs), targets)

    if not arm.plain:
        return model, loss

    def autocast_loss(inputs, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss(inputs, targets)

    return model, autocast_loss


def build_optimizer(arm: Arm, model, args: argparse.Namespace) -> torch.optim.Optimizer:
    if arm.plain:
        params = [p for p in model.parameters() if p.requires_grad]
        if arm.mode == "torchao":
            from torchao.optim import CPUOffloadOptimizer as TorchaoOffload

            return TorchaoOffload(params, torch.optim.AdamW, lr=args.lr, fused=True)
        adamw = torch.optim.AdamW(params, lr=args.lr, fused=True)
        if arm.mode == "none":
            return adamw
        chunking = {} if args.chunk_bytes is None else {"chunk_bytes": args.chunk_bytes}
        if arm.backward_load is not None:
            chunking["load_in_backward"] = load_in_backward(arm)
        elif arm.mode == "offload+overlap" and args.gpu_budget is not None:
            chunking["gpu_budget_bytes"] = args.gpu_budget
        return CPUOffloadOptimizer(adamw, overlap_forward=model, **chunking)
    extra = {} if arm.resident is None else {RESIDENT_FIELD: arm.resident}
    tuned = arm.mode == "offload+overlap" and arm.resident in (None, 0)
    if (arm.resident == "auto" or tuned) and args.gpu_budget is not None:
        extra["offload_gpu_budget_bytes"] = args.gpu_budget
    config = OptimizerConfig(
        type=arm.optimizer,
        lr=args.lr,
        offload="optimizer" if arm.mode.startswith("offload") else "none",
        offload_overlap_forward=arm.mode in OVERLAP_ARMS,
        offload_load_in_backward=load_in_backward(arm),
        **(
            {"offload_chunk_bytes": args.chunk_bytes}
            if args.chunk_bytes is not None and arm.mode.startswith("offload")
            else {}
        ),
        **extra,
    )
    return setup_optimizer(model, config)


def measure(arm: Arm, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build and time one arm in this process (its process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh

    machine = probe(device)  # before this process pins or allocates anything
    mesh = init_device_mesh(device.type, (1,))
    model, loss = build_model(arm, args, mesh, device)
    optimizer = build_optimizer(arm, model, args)
    vocab = model.config.vocab_size
    seq = args.seq or sequence_length(args.model)
    # In host memory, copied in each step as a DataLoader with pin_memory hands them: the
    # copy queues behind whatever the step has enqueued on the link, as a trainer's does.
    batches = [
        tuple(t.cpu().pin_memory() if device.type == "cuda" else t for t in batch)
        for batch in (
            random_tokens(vocab, seq, args.batch, device, seed=i) for i in range(args.micro_batches)
        )
    ]

    marks: PhaseMarks | None = None  # set for the timed window with --phases

    def step() -> float:
        """One step (micro-batches accumulated), no device sync; seconds until step() returned."""
        if marks is not None:
            marks.begin()
        optimizer.zero_grad(set_to_none=True)
        for host_inputs, host_targets in batches:
            inputs = host_inputs.to(device, non_blocking=True)
            targets = host_targets.to(device, non_blocking=True)
            value = loss(inputs, targets) / len(batches)
            if marks is not None:
                marks.mark()
            value.backward()
            if marks is not None:
                marks.mark()
        start = time.perf_counter()
        optimizer.step()
        returned = time.perf_counter() - start
        if marks is not None:
            marks.mark()
        return returned

    # "auto" measures and searches over its first steps, and the default's backward loads
    # grow over them (`offload.backward_tuning`), run as a trainer runs them (no host sync
    # between steps: a synced step starts its forward with the device idle); the window
    # starts once it has settled.
    search_steps, search_s, first_step_s = 0, 0.0, 0.0
    retries_before = alloc_retries(device)
    search_step_ms: list[float] = []  # each search step on the device, to the next's start
    auto = arm.resident == "auto"

    def settling() -> bool:
        if auto:
            return optimizer.residency is None and search_steps < AUTO_STEPS_AT_MOST
        tuning = getattr(optimizer, "backward_tuning", ())
        return tuning is None and search_steps < TUNING_STEPS_AT_MOST

    if settling():
        started = time.perf_counter()
        starts = []  # CUDA events at each step's start on the trainer's stream (no sync)
        profiler = None
        while settling():
            if args.trace_search and search_steps == TRACE_SEARCH_STEPS[0]:
                profiler = started_profiler(device)
            if device.type == "cuda":
                starts.append(torch.cuda.Event(enable_timing=True))
                starts[-1].record()
            step()
            search_steps += 1
            if search_steps == 1:  # it pins and builds: synced and timed apart, as none's
                sync(device)  # first warmup step is
                first_step_s = time.perf_counter() - started
            if profiler is not None and search_steps == TRACE_SEARCH_STEPS[1]:
                export_trace(profiler, device, trace_path(args.json, arm, "search"))
                profiler = None
        if profiler is not None:  # settled sooner (nothing to search with)
            export_trace(profiler, device, trace_path(args.json, arm, "search"))
        if starts:
            starts.append(torch.cuda.Event(enable_timing=True))
            starts[-1].record()
        timed_window(step, 1, device)  # the first step with the settled choice, synced
        search_steps += 1
        search_s = time.perf_counter() - started
        search_step_ms = [a.elapsed_time(b) for a, b in zip(starts, starts[1:], strict=False)]
    # Warmup builds plans, allocates state and host slabs.
    warm_s: list[float] = []
    for _ in range(args.warmup):
        started = time.perf_counter()
        timed_window(step, 1, device)
        warm_s.append(time.perf_counter() - started)
    steps = args.steps  # every arm: the medians a ratio compares are over as many steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    retries_window = alloc_retries(device)
    if args.phases:
        marks = PhaseMarks(*decoder_layers_and_head(model), device)
    timeline = None
    if args.link_timeline and arm.mode in OVERLAP_ARMS:
        timeline = LinkTimeline(optimizer, timing_event(device))
    returns: list[float] = []
    gc_seen: list[tuple[int, int]] = []  # per step: collections recorded at its start, end

    def window_step() -> None:
        before = len(pauses.events)
        returns.append(step())
        gc_seen.append((before, len(pauses.events)))

    with GcPauses() as pauses:
        per_step, window_s = timed_window(window_step, steps, device)
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    result: dict[str, Any] = {
        "machine": machine,
        "backends": {
            "ns": muon.newton_schulz.get_backend(),
            "elementwise": muon.elementwise.get_backend(),
        },
        "search_steps": search_steps,
        "search_ms": 1e3 * search_s,
        "search_step_ms": search_step_ms,
        "warmup_steps": len(warm_s),
        "warmup_ms": [1e3 * t for t in warm_s],
        "timed_steps": steps,
        "step_ms": 1e3 * statistics.median(per_step),
        "step_ms_all": [1e3 * s for s in per_step],
        "window_ms_per_step": 1e3 * window_s / steps,
        "step_returns_ms": 1e3 * statistics.median(returns),
        "peak_gib": (
            torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None
        ),
        "reserved_gib": (
            torch.cuda.max_memory_reserved(device) / GiB if device.type == "cuda" else None
        ),
        # Allocator retries free the cache and sync: a budget set too close to the device's
        # memory shows here, before and within the window.
        "alloc_retries_before_window": retries_window - retries_before,
        "alloc_retries_in_window": alloc_retries(device) - retries_window,
        # Full collections hold the host: the window's steps they fell in (from 0), and ms.
        "gc_full_in_window": full_collections(pauses, gc_seen),
    }
    # The first 30 steps' mean, the search and warmup included (what "auto" costs a run);
    # the search's steps after the first are timed together, so each counts as their mean.
    # Steps 1-30 too: the first step also warms the process up (CUDA's libraries, the
    # allocator), and that varied by more than a second between runs of one arm.
    search = [first_step_s] if search_steps else []
    if search_steps > 1:
        search += [(search_s - first_step_s) / (search_steps - 1)] * (search_steps - 1)
    first = [*search, *warm_s, *per_step][:31]
    for key, steps_ms in (("first_30", first[:30]), ("steps_1_to_30", first[1:31])):
        if steps_ms:
            result[f"{key}_mean_ms"] = 1e3 * sum(steps_ms) / len(steps_ms)
            result[f"{key}_steps"] = len(steps_ms)  # fewer than 30 in a short run
    if isinstance(optimizer, CPUOffloadOptimizer):
        result["resident_mib"] = optimizer.plan.resident_bytes / 2**20
        result["chunks_loaded_in_backward"] = optimizer.chunks_loaded_in_backward
        # What the step planned (chunks, ring, the backward's loads) beside what it found.
        result["schedule"] = optimizer.schedule.describe()
        if arm.mode in OVERLAP_ARMS:  # without overlap the step itself loads everything
            result["forward_load_bytes"] = forward_load_bytes(optimizer)
            result["forward_load_floor_ms"] = copy_floor_ms(
                result["forward_load_bytes"], machine.get("both_gb_s")
            )
        if optimizer.residency is not None:
            result["residency"] = dataclasses.asdict(optimizer.residency)
        if optimizer.backward_tuning:
            result["backward_tuning"] = [dataclasses.asdict(r) for r in optimizer.backward_tuning]
    if timeline is not None:
        sync(device)
        result["link_timeline"] = timeline.summary(marks.events())
        timeline.close()
    if marks is not None:
        result["phases"] = marks.summary()
        marks.close()
        marks = None
    if args.trace:
        trace_steps(step, device, trace_path(args.json, arm))
    if args.host_profile:
        result["host_profile"] = profile_host(step, device, host_profile_path(args.json, arm))
    if device.type == "cuda":
        result["kept_mib"] = kept_between_steps(model, optimizer, device) / 2**20
    close = getattr(optimizer, "close", None)
    if close is not None:
        close()
    return result


def describe_gc(full: dict[str, list]) -> str:
    """The window's full collections, for a run's line ("" without any)."""
    text = ""
    if full["steps"]:
        at = ", ".join(
            f"{k} ({ms:.0f} ms)" for k, ms in zip(full["steps"], full["ms"], strict=True)
        )
        text += f"; full gc in the window's steps {at}"
    if full["outside_steps_ms"]:
        between = ", ".join(f"{ms:.0f}" for ms in full["outside_steps_ms"])
        text += f"; full gc between steps ({between} ms)"
    return text


def alloc_retries(device: torch.device) -> int:
    """How often torch's caching allocator has freed its cache to retry an allocation."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def forward_load_bytes(optimizer: CPUOffloadOptimizer) -> int:
    """State bytes the forward after a step loads (rank-invariant bytes: this process's
    own on one GPU)."""
    return optimizer.schedule.forward_load_bytes([c.invariant_bytes for c in optimizer.plan.chunks])


def copy_floor_ms(size: int, both_gb_s: float | None) -> float | None:
    """The least time `size` bytes take to load while as many write back (the link's rate
    both ways at once, GB/s): the overlapped forward's floor. None without a measured link."""
    return None if not both_gb_s else 1e3 * size / (both_gb_s * 1e9)


FORWARD_PHASES = PHASES[: PHASES.index("backward")]
"""The phases (`bench.phases`) that make up the forward."""


def step_floor_ms(arm: dict[str, Any], none: dict[str, Any]) -> float | None:
    """The least step an overlapped arm's forward loads allow, from the same run's
    no-offload arm timed by phases (the medians of its runs): none's step, lengthened by what the
    forward's loads take at the link's both-ways rate (`forward_load_floor_ms`) beyond
    none's forward and `step()` together (the overlapped step runs its updates beside the
    forward, which the loads must cover too; they start when the backward ends, where
    the ring is allocated). The link alone: not what the copies cost the kernels beside
    them (`bench/copy_interference.py`), nor the layers after the last load. None
    without those measurements."""
    loads_ms, phases = arm.get("forward_load_floor_ms"), none.get("phases")
    if loads_ms is None or not phases or none.get("step_ms") is None:
        return None
    device = [phases[p]["device_ms"] for p in (*FORWARD_PHASES, "step()")]
    if None in device:
        return None
    return none["step_ms"] + max(0.0, loads_ms - sum(device))


def baseline_of(results: list[dict[str, Any]]) -> Callable[[dict[str, Any]], dict | None]:
    """Each arm's no-offload arm among `results` (its optimizer's; plain arms: plain/none),
    None where it did not run or failed."""
    base = {r["arm"]: r for r in results if r["arm"].endswith("/none") and "error" not in r}

    def of(r: dict[str, Any]) -> dict | None:
        return base.get("plain/none" if r["arm"].startswith("plain/") else f"{r['optimizer']}/none")

    return of


def add_step_floors(results: list[dict[str, Any]]) -> None:
    """Each overlapped arm's `step_floor_ms` (`step_floor_ms`) against its no-offload arm
    (`baseline_of`), where both were measured."""
    none_of = baseline_of(results)
    for r in results:
        if "error" in r or "forward_load_floor_ms" not in r:
            continue
        none = none_of(r)
        floor = None if none is None else step_floor_ms(r, none)
        if floor is not None:
            r["step_floor_ms"] = floor


TRACE_SEARCH_STEPS = (
    AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS - 1,
    AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS + 2,
)
"""The search steps `--trace-search` profiles, from the first to before the second: the
last measured step (its backward loads ahead) and the first choice's two."""


def trace_path(json_path: Path, arm: Arm, what: str = "") -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", arm.name) + (f".{what}" if what else "")
    return json_path.with_name(f"{json_path.stem}.{name}.trace.json.gz")


def started_profiler(device: torch.device) -> Any:
    """A started torch.profiler of host and device activity."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def export_trace(profiler: Any, device: torch.device, path: Path) -> None:
    """Stop `profiler` once the device is done and write a gzipped Chrome trace."""
    sync(device)
    profiler.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))  # a .gz name is written gzipped
    print(f"trace: {path}", flush=True)


def trace_steps(step: Callable[[], object], device: torch.device, path: Path) -> None:
    """Profile 2 steps (host and device activity) and write a gzipped Chrome trace."""
    profiler = started_profiler(device)
    timed_window(step, 2, device)
    export_trace(profiler, device, path)


HOST_PROFILE_STEPS = 5
HOST_PROFILE_TOP = 12
OWN_CODE = tuple(str(ROOT / package) for package in ("offload", "muon", "muon_offload"))


def host_profile_path(json_path: Path, arm: Arm) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", arm.name)
    return json_path.with_name(f"{json_path.stem}.{name}.host.txt")


def profile_host(step: Callable[[], object], device: torch.device, path: Path) -> list[dict]:
    """Run `HOST_PROFILE_STEPS` steps under cProfile (synced at both ends): where the
    trainer's host spends its time. Writes the whole profile to `path`; returns the
    project's own functions with the most cumulative host time, per step."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    timed_window(step, HOST_PROFILE_STEPS, device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    own = []
    for (filename, line, name), (_, calls, _, cumulative, _) in stats.stats.items():
        if filename.startswith(OWN_CODE):
            where = f"{Path(filename).relative_to(ROOT)}:{line} {name}"
            own.append(
                {
                    "function": where,
                    "calls_per_step": calls / HOST_PROFILE_STEPS,
                    "ms_per_step": 1e3 * cumulative / HOST_PROFILE_STEPS,
                }
            )
    own.sort(key=lambda f: f["ms_per_step"], reverse=True)
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    print(f"host profile: {path}", flush=True)
    return own[:HOST_PROFILE_TOP]


def kept_between_steps(model: nn.Module, optimizer: Any, device: torch.device) -> int:
    """Bytes allocated after a step and `zero_grad(set_to_none=True)` beyond the params and
    the optimizer state on the device: what the optimizer keeps between steps."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize(device)
    params = _storage_bytes(model.parameters(), device)
    state = _storage_bytes(device_state_tensors(optimizer), device)
    return torch.cuda.memory_allocated(device) - params - state


def device_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's state tensors, where it exposes `state`; torchao's
    `CPUOffloadOptimizer` does not (its state lives in per-param optimizers on the host)."""
    return [
        v
        for entries in getattr(optimizer, "state", {}).values()
        for v in entries.values()
        if isinstance(v, torch.Tensor)
    ]


def _storage_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages of `tensors` on `device`."""
    storages = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type == device.type:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def sequence_length(model: str) -> int:
    if model in hf_llama.PRESETS:
        return hf_llama.seq_len(model)
    return ModelConfig.preset(model).seq_len


def _arm_process(arm: Arm, args: argparse.Namespace, port: int, results) -> None:
    """Child process: one arm on a fresh world-1 process group; the result goes on `results`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        # gloo next to NCCL: with CPUOffloadPolicy the params (and collectives on them)
        # are on the host.
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        result = measure(arm, args, device)
    except Exception as error:  # one broken arm should not cost the other arms' run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()
    results.put(result)


def run_arm(arm: Arm, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One arm in a process of its own."""
    base = {
        "optimizer": arm.optimizer,
        "arm": arm.name,
        "resident_bytes": arm.resident,
        "backward_load_bytes": arm.backward_load,
        "env": dict(arm.env),
    }
    reason = unsupported_reason(arm, device)
    if reason is not None:
        return {**base, "error": reason}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_arm_process, args=(arm, args, free_port(), results))
    with _environment(dict(arm.env)):  # a spawned child starts with the parent's environment
        process.start()
    try:
        result = _result_or_exit(process, results)
    except KeyboardInterrupt:
        process.terminate()
        raise
    finally:
        process.join(timeout=ARM_EXIT_WAIT_S)
    if process.exitcode not in (0, None) and not result:
        result = {"error": f"arm process exited with {process.exitcode}"}
    return {**base, **result}


def _result_or_exit(process, results) -> dict[str, Any]:
    """The arm's result from its process, or {} once the process has exited without one
    (it died before `_arm_process` ran, e.g. importing under a bad `%NAME=VALUE`)."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                try:  # put just before it exited
                    return results.get(timeout=1.0)
                except queue.Empty:
                    return {}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` set in this process's environment for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_order(arms: Sequence[Arm], baseline_runs: int, rounds: int = 1) -> list[Arm]:
    """`arms` with each baseline (a none arm) run `baseline_runs` times and the other arms
    `rounds` times, round-robin (a machine that drifts moves every arm alike): a round of
    baselines first, then the other arms' runs in `baseline_runs - 1` even slices, each
    followed by a round of baselines."""
    baselines = [a for a in arms if a.mode == "none"]
    others = [a for a in arms if a.mode != "none"]
    if not baselines or baseline_runs == 1:
        return list(arms) + others * (rounds - 1)
    others *= rounds
    order = list(baselines)
    slices = baseline_runs - 1
    for i in range(slices):
        order += others[len(others) * i // slices : len(others) * (i + 1) // slices]
        order += baselines
    return order


FIRST_STEPS = ("first_30", "steps_1_to_30")
"""Means over a run's first steps (`<key>_mean_ms`, over `<key>_steps` steps)."""
MERGED_MEDIAN = (
    "step_ms",
    "window_ms_per_step",
    "step_returns_ms",
    "forward_load_floor_ms",
    *(f"{key}_mean_ms" for key in FIRST_STEPS),
)
"""Times merged as the median of an arm's runs."""
MERGED_MOST = ("peak_gib", "reserved_gib", "kept_mib")
"""Memory merged as the most any run took: what a run of the arm needs."""


def merge_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm, first appearance's order: an arm that ran several times has the
    median of its runs' times (`MERGED_MEDIAN`), the most of their memory (`MERGED_MOST`;
    None where not measured), each run's value (`<field>_runs`), the step ms spread
    (max / min - 1), the median of each phase's device and host ms (`phases`, where every
    run timed them), the errors of runs that failed (`failed_runs`), and its other
    fields (schedule, host profile) from its first run."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault(r["arm"], []).append(r)
    merged = []
    for rows in runs.values():
        ok = [r for r in rows if "error" not in r]
        if len(rows) == 1 or not ok:
            failed = [r["error"] for r in rows if "error" in r]
            merged.append({**rows[0], "failed_runs": failed} if len(failed) > 1 else rows[0])
            continue
        row = dict(ok[0])
        for field, combine in [
            *((f, statistics.median) for f in MERGED_MEDIAN),
            *((f, max) for f in MERGED_MOST),
        ]:
            if field not in row:
                continue
            values = [r[field] for r in ok]
            row[f"{field}_runs"] = values
            row[field] = None if None in values else combine(values)
        row["spread"] = max(row["step_ms_runs"]) / min(row["step_ms_runs"]) - 1
        if all(r.get("phases") for r in ok):
            row["phases"] = {
                phase: {
                    key: None
                    if None in (values := [r["phases"][phase][key] for r in ok])
                    else statistics.median(values)
                    for key in times
                }
                for phase, times in ok[0]["phases"].items()
            }
        if all(r.get("link_timeline") for r in ok):
            row["link_timeline"] = {
                f: statistics.median(r["link_timeline"][f] for r in ok) for f in LINK_FIELDS
            }
        if len(ok) < len(rows):  # the runs above are those that did not fail
            row["failed_runs"] = [r["error"] for r in rows if "error" in r]
        merged.append(row)
    return merged


def print_table(results: list[dict[str, Any]]) -> None:
    none_of = baseline_of(results)

    def ratio(r: dict[str, Any], key: str) -> str:
        b = none_of(r)
        if b is None or r.get(key) is None or b.get(key) is None:
            return "-"
        first_steps = key.removesuffix("_mean_ms")
        steps = f"{first_steps}_steps"
        if first_steps in FIRST_STEPS and r.get(steps) != b.get(steps):
            return "-"  # means over other step counts: one-off costs spread unlike
        return f"{r[key] / b[key]:.3f}x"

    def gib(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    width = max(len(r["arm"]) for r in results)
    header = (
        f"{'arm':<{width}} {'step ms':>8} {'vs none':>8} {'window':>8} {'returns':>8} "
        f"{'peak GiB':>9} {'vs none':>8} {'kept MiB':>9} {'resident':>9} {'bwd':>4} "
        f"{'steps':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        if "error" in r:
            errors = r.get("failed_runs", [r["error"]])
            runs = f" (all {len(errors)} runs failed)" if len(errors) > 1 else ""
            print(f"{r['arm']:<{width}} {'; '.join(dict.fromkeys(errors))}{runs}")
            continue
        print(
            f"{r['arm']:<{width}} {r['step_ms']:>8.1f} {ratio(r, 'step_ms'):>8} "
            f"{r['window_ms_per_step']:>8.1f} {r['step_returns_ms']:>8.1f} "
            f"{gib(r['peak_gib']):>9} {ratio(r, 'peak_gib'):>8} "
            f"{gib(r.get('kept_mib')):>9} {gib(r.get('resident_mib')):>9} "
            f"{r.get('chunks_loaded_in_backward', '-'):>4} {r['timed_steps']:>6}"
        )
        if "schedule" in r:
            loads = ""
            if "forward_load_bytes" in r:
                loads = f"; the forward loads {r['forward_load_bytes'] / GiB:.2f} GiB"
            if r.get("forward_load_floor_ms") is not None:
                loads += f": >= {r['forward_load_floor_ms']:.1f} ms at the link's both-ways rate"
            print(f"{'':<{width}} {r['schedule']}{loads}")
        for t in r.get("backward_tuning", ()):
            print(
                f"{'':<{width}} backward loads tuned: stall {t['stall_ms']:.1f} ms of "
                f"{t['iteration_ms']:.1f}, loads {t['load_bytes_per_ms'] * 1e3 / GiB:.1f} GiB/s, "
                f"backward {t['backward_ms']:.1f} ms: {t['loaded_bytes'] / GiB:.2f} -> "
                f"{t['chosen_bytes'] / GiB:.2f} GiB"
                + (f" (held back by {t['held_back_by']})" if t.get("held_back_by") else "")
            )
        if "residency" in r:
            c = r["residency"]
            print(
                f"{'':<{width}} auto: kept {c['resident_units']} units, "
                f"{c['resident_bytes'] / GiB:.2f} GiB resident + "
                f"{c['backward_load_bytes'] / GiB:.2f} GiB loaded in the backward "
                f"({c['state_bytes'] / GiB:.2f} GiB state, budget "
                f"{c['budget_bytes'] / GiB:.2f} GiB); stall {c['measured_stall_ms']:.1f} "
                f"ms a step all offloaded, predicted {c['predicted_stall_ms']:.1f} ms; "
                f"{r['search_steps']} steps to settle, {r['search_ms'] / 1e3:.2f} s; "
                f"allocator retries {r['alloc_retries_before_window']} before the window, "
                f"{r['alloc_retries_in_window']} in it (reserved {gib(r['reserved_gib'])} GiB)"
            )
            after = [
                {**c[key], "label": key if key == "checked" else "again"}
                for key in ("reference", "checked")
                if c.get(key)
            ]
            for p in [*c["probes"], *after]:
                split = p["split"]
                print(
                    f"{'':<{width}}   {p.get('label', 'tried')} "
                    f"{split['resident_bytes'] / GiB:.2f} + "
                    f"{split['backward_load_bytes'] / GiB:.2f} GiB: {p['iteration_ms']:.1f} ms "
                    f"(median's error {p.get('error_ms', 0.0):.1f})"
                )
            if r.get("search_step_ms"):
                each = " ".join(f"{t:.0f}" for t in r["search_step_ms"])
                print(f"{'':<{width}}   each step of the search (device ms): {each}")
        if r.get("warmup_ms"):
            each = " ".join(f"{t:.0f}" for t in r["warmup_ms"])
            print(f"{'':<{width}} warmup steps (synced, ms): {each}")
    for r in results:
        if "step_ms_runs" in r:
            runs = ", ".join(f"{t:.1f}" for t in r["step_ms_runs"])
            peaks = ", ".join(gib(p) for p in r["peak_gib_runs"])
            failed = len(r.get("failed_runs", ()))
            print(
                f"{r['arm']} ran {len(r['step_ms_runs'])} times"
                + (f" ({failed} more failed)" if failed else "")
                + f": {runs} ms (spread {100 * r['spread']:.1f}%, ratios use the median); "
                f"peak {peaks} GiB (the table: the most)"
            )
    for key, what in zip(FIRST_STEPS, ("the first 30 steps'", "steps 1-30's"), strict=True):
        print(f"\n{what} mean (auto's search and the warmup included):")
        for r in results:
            if f"{key}_mean_ms" in r:
                runs = ", ".join(f"{t:.1f}" for t in r.get(f"{key}_mean_ms_runs", ()))
                steps = r.get(f"{key}_steps", 30)
                print(
                    f"{r['arm']:<{width}} {r[f'{key}_mean_ms']:>8.1f} ms "
                    f"{ratio(r, f'{key}_mean_ms'):>8}"
                    + (f"  (over {steps} steps)" if steps < 30 else "")
                    + (f"  (median of {runs})" if runs else "")
                )
    _print_phases(results, width)
    _print_host_profiles(results)
    print(
        "\nstep ms: median over the window's steps (events between steps, synced only at the "
        "window's ends); window: window / steps; returns: host ms until step() returns; "
        "vs none: against the same optimizer's none arm (plain arms: plain/none); kept: "
        "allocated after step() + zero_grad beyond params and device state; resident: MiB of "
        "state kept on the GPU; bwd: chunks the last step found loaded in the backward; the "
        "forward loads: what the forward after a step loads, and the least time that takes "
        "while as much writes back"
    )


def _print_host_profiles(results: list[dict[str, Any]]) -> None:
    """With --host-profile: each arm's own functions with the most host ms a step (its
    first run's; cProfile's overhead included)."""
    for r in results:
        if r.get("host_profile"):
            print(f"\nhost ms a step under cProfile, {r['arm']}:")
            for f in r["host_profile"]:
                ms, calls = f["ms_per_step"], f["calls_per_step"]
                print(f"  {ms:8.1f} ms {calls:7.1f} calls  {f['function']}")


def _print_phases(results: list[dict[str, Any]], width: int) -> None:
    """With --phases: each arm's median phase times, device / host ms (bench.phases)."""
    timed = [r for r in results if "phases" in r]
    if not timed:
        return
    header = f"{'phases: device / host ms':<{width}} " + " ".join(f"{p:>15}" for p in PHASES)
    print("\n" + header + "\n" + "-" * len(header))
    for r in timed:
        cells = []
        for phase in PHASES:
            t = r["phases"][phase]
            device = "-" if t["device_ms"] is None else f"{t['device_ms']:.1f}"
            cells.append(f"{device + ' / ' + format(t['host_ms'], '.1f'):>15}")
        print(f"{r['arm']:<{width}} " + " ".join(cells))
    for r in results:
        if r.get("step_floor_ms") is not None:
            print(
                f"{r['arm']}: its forward's loads allow a step of no less than "
                f"{r['step_floor_ms']:.1f} ms; it ran {r['step_ms']:.1f} "
                f"({r['step_ms'] / r['step_floor_ms']:.3f}x that floor)"
            )
        link = r.get("link_timeline")
        if link:
            print(
                f"{r['arm']}: the host link in its forward of {link['forward_ms']:.1f} ms "
                f"(device): host to GPU busy {link['h2d_busy_forward_ms']:.1f} (the forward's "
                f"loads from {link['first_load_ms']:+.1f} to {link['last_load_done_ms']:.1f}), "
                f"GPU to host {link['d2h_busy_forward_ms']:.1f}; in its backward of "
                f"{link['backward_ms']:.1f}: {link['h2d_busy_backward_ms']:.1f} and "
                f"{link['d2h_busy_backward_ms']:.1f}"
            )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench/train_step.py needs a CUDA GPU (or --device cpu --model hf-llama-tiny: smoke)"
        )
    if args.model in hf_llama.PRESETS:
        hf_llama.require_transformers()
    arms = selected_arms(args.arms, args.sweep, args.sweep_optimizers)
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(
        f"{args.model}, batch {args.micro_batches} x {args.batch} x "
        f"{args.seq or sequence_length(args.model)}, bf16, activation checkpointing, "
        f"wrap {args.wrap}, one process per arm, {gpu}"
        + ("" if args.gpu_budget is None else f", gpu budget {bytes_text(args.gpu_budget)}"),
        flush=True,
    )
    runs = []
    for arm in run_order(arms, args.baseline_runs, args.rounds):
        started = time.perf_counter()
        r = run_arm(arm, args, device)
        runs.append(r)
        took = f"{time.perf_counter() - started:.0f} s"
        if "error" in r:
            print(f"{arm.name}: {r['error']} ({took})", flush=True)
        else:
            print(
                f"{arm.name}: step {r['step_ms']:.1f} ms ({took}); {describe(r['machine'])}"
                + describe_gc(r["gc_full_in_window"]),
                flush=True,
            )
    results = merge_runs(runs)
    add_step_floors(results)
    print_table(results)
    out = {
        "device": gpu,
        "model": args.model,
        "wrap": args.wrap,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "offload_chunk_bytes": args.chunk_bytes,
        "offload_gpu_budget_bytes": args.gpu_budget,
        "seq": args.seq or sequence_length(args.model),
        "mixed_precision": "bf16 params, fp32 reduce (plain arms: bf16 autocast)",
        "activation_checkpointing": True,
        "baseline_runs": args.baseline_runs,
        "rounds": args.rounds,
        "results": results,
        "runs": runs,
    }
    print()
    write_json(args.json, out)
    if args.sweep:
        from bench.plots import plot_resident_sweep

        for opt in args.sweep_optimizers.split(","):
            path = args.json.with_name(f"{args.json.stem}_resident_{opt}.png")
            plot_resident_sweep(results, opt, path, title=f"{args.model}, {opt}")


if __name__ == "__main__":
    main()
