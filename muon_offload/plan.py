"""The Muon plan before the run: buckets, owners, bytes and memory per rank (CLI and report).

    python -m muon_offload.plan --preset qwen3-30b-a3b --fsdp 64 --ep 8
    python -m muon_offload.plan --config config.json --fsdp 32 --replicate 4 --json
    python -m muon_offload.plan --preset qwen3-8b --sweep-fsdp 8,16,32,64 --offload --budget-gib 20

The figures are `muon_offload.estimate`'s, computed by the planning code the optimizer
runs; this module only prints them. Per bucket the table shows the rank with
the most and the one with the fewest Newton-Schulz FLOPs in that bucket, under
`BucketMetrics`' field names, so a run's `Muon.metrics` can be held against it.
Per rank it shows the rank with the most and the fewest Newton-Schulz FLOPs in
the step ("busy", "idle") and the rank whose step peaks highest, each with and
without offload: what is kept between steps (the state on the GPU; with offload
none of it unless some is GPU-resident) and what the step adds at its peak (with
offload the staging ring, allocated for the step only, and the chunks' compute).
Those ranks are found over every rank without planning each (`RankScreen`); only
they, and each bucket's busy and idle rank, are planned in full, so a plan for
thousands of ranks takes seconds. A model and mesh that do not plan within
`--time-limit-s` are refused with a message.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from muon.model_shapes import (
    FSDP_WRAPS,
    PRESETS,
    ParamShape,
    from_config,
    from_preset,
    fsdp_modules,
    load_config,
)
from muon.ns_schedules import SCHEDULES
from muon.optimizer import DEFAULT_MAX_INFLIGHT
from muon.options import NS_ALGORITHMS, NS_DTYPES
from muon.planning import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_SPREAD_MODEL, REPLICA_OWNERS, MuonPlan
from muon_offload.config import offload_bucket_cap
from muon_offload.estimate import (
    DEFAULT_TIME_LIMIT_S,
    EXPERT_SHARDS,
    BucketLoad,
    MeshSpec,
    ModelEstimate,
    RankEstimate,
    RankScreen,
    ReplicaOwnersFigures,
    StepMemory,
    StepSettings,
    compare_replica_owners,
    estimate,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, **NS_DTYPES}
"""By short name, and as `muon_options`' `ns_dtype` and a TOML config spell them."""
LAYER = re.compile(r"layers\.(\d+)\.")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def _layers(names: Sequence[str]) -> str:
    found = sorted({int(m.group(1)) for name in names if (m := LAYER.search(name))})
    if not found:
        return "-"
    return str(found[0]) if found[0] == found[-1] else f"{found[0]}-{found[-1]}"


def _shapes(plan: MuonPlan, bucket: int) -> str:
    counts: dict[tuple[int, int], int] = {}
    for m in plan.matrices[bucket]:
        counts[(m.rows, m.cols)] = counts.get((m.rows, m.cols), 0) + 1
    parts = [f"{r}x{c}*{n}" for (r, c), n in counts.items()]
    return ",".join(parts[:3]) + (",..." if len(parts) > 3 else "")


def bucket_rows(model: ModelEstimate) -> list[dict[str, Any]]:
    """Per bucket: what it holds, and the ranks with the most and fewest Newton-Schulz
    FLOPs in it (`BucketMetrics` names; ties: the lowest rank is busy, the highest idle),
    found over every rank by `ModelEstimate.screen` and planned for this table."""
    rows = []
    screen = model.screen
    for b, bucket in enumerate(model.plan(0).buckets):
        sides = {}
        for side, rank in (
            ("busy", RankScreen.most(screen.ns_flops[b])),
            ("idle", RankScreen.fewest(screen.ns_flops[b])),
        ):
            ex = model.exchange(rank, b)
            load = BucketLoad.of(ex, rank)
            sides[side] = {
                "rank": load.rank,
                "matrices": load.matrices,
                "owned": load.owned,
                "bytes_sent": load.bytes_sent,
                "bytes_received": load.bytes_received,
                "workspace_bytes": load.workspace_bytes,
                "buffer_bytes": load.buffer_bytes,
                "ns_bytes": load.ns_bytes,
                "ns_flops": load.ns_flops,
                "send_splits": list(ex.send_splits),
                "recv_splits": list(ex.recv_splits),
            }
        padded = model.padded[b]
        owners = int((screen.ns_flops[b] > 0).sum())
        rows.append(
            {
                "bucket": b,
                "kind": "local" if bucket.axis is None else "exchange",
                "layers": _layers([model.names[i] for i in bucket.params]),
                "params": len(bucket.params),
                "shapes": _shapes(model.plan(sides["busy"]["rank"]), b),
                "nbytes": bucket.nbytes,
                "owners": None if bucket.axis is None else owners,
                "bytes_sent_max": int(screen.bytes_sent[b].max()),
                "busy": sides["busy"],
                "idle": sides["idle"],
                "padded": None if padded is None else asdict(padded),
            }
        )
    return rows


def _memory_dict(memory: StepMemory) -> dict[str, int]:
    return {
        "state_bytes": memory.state_bytes,
        "staging_bytes": memory.staging_bytes,
        "kept_bytes": memory.kept_bytes,
        **asdict(memory.transient),
        "transient_bytes": memory.step_bytes,  # the ring (with offload) and the compute
        "peak_bytes": memory.peak_bytes,
    }


def rank_dict(rank: RankEstimate) -> dict[str, Any]:
    return {
        "rank": rank.rank,
        "ns_flops": rank.ns_flops,
        "bytes_sent": rank.bytes_sent,
        "state_bytes": rank.state_bytes,
        "muon_state_bytes": rank.muon_state_bytes,
        "adamw_state_bytes": rank.adamw_state_bytes,
        "offload_chunks": rank.offload_chunks,
        "offload_schedule": rank.offload_schedule.describe(),
        "offload_forward_load_bytes": rank.offload_forward_load_bytes,
        "offload_host_bytes": rank.offload_plan.host_bytes,
        "no_offload": _memory_dict(rank.no_offload),
        "offload": _memory_dict(rank.offload),
    }


def chunk_rows(model: ModelEstimate) -> list[dict[str, Any]]:
    """The offloaded step's chunks on the rank whose step peaks highest with offload, in
    step order: where each lives (GPU-resident, a ring slot or an extra slot), whether the
    backward loads it, its rank-invariant state bytes and its params."""
    rank = model.largest_peak(offload=True)
    schedule = rank.offload_schedule
    loaded = set(schedule.loaded_in_backward)
    rows = []
    for c, (chunk, slot) in enumerate(zip(rank.offload_plan.chunks, schedule.slots, strict=True)):
        where = "resident" if slot < 0 else "ring" if slot < schedule.ring_slots else "extra"
        rows.append(
            {
                "rank": rank.rank,
                "chunk": c,
                "where": where,
                "slot": slot,
                "backward": c in loaded,
                "invariant_bytes": chunk.invariant_bytes,
                "params": [model.param_names[i] for i in chunk.params],
            }
        )
    return rows


def print_chunks(rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"offloaded chunks of rank {rows[0]['rank']}, in step order (MiB: rank-invariant state)")
    print(f"{'chunk':>5} {'where':<9} {'bwd':<4} {'MiB':>8}  params")
    for row in rows:
        where = row["where"] + ("" if row["slot"] < 0 else f" {row['slot']}")
        names = row["params"]
        shown = ", ".join(names[:2]) + (f" (+{len(names) - 2})" if len(names) > 2 else "")
        print(
            f"{row['chunk']:>5} {where:<9} {'yes' if row['backward'] else '':<4} "
            f"{_mib(row['invariant_bytes']):>8}  {shown}"
        )
    print()


def print_replica_owners(model: ModelEstimate, figures: Sequence[ReplicaOwnersFigures]) -> None:
    chosen = sum(b.spread for b in model.plan(0).buckets)
    print(
        f"HSDP owners (replica_owners={model.settings.replica_owners!r}: {chosen} of "
        f"{len(model.plan(0).buckets)} buckets spread; 'auto' spreads a bucket when its "
        f"busiest owner gains more Newton-Schulz time than sharing costs at "
        f"{model.settings.replica_bytes_per_s / 1e9:g} GB/s between replicas):"
    )
    for f in figures:
        print(
            f"  {f.replica_owners:<12} busiest rank {f.ns_flops_max / 1e12:8.2f} TFLOP "
            f"(~{1e3 * f.ns_s_max:7.1f} ms of Newton-Schulz), wire max "
            f"{_mib(f.bytes_sent_max)} MiB per rank, {f.spread_buckets} buckets spread"
        )


def summary(model: ModelEstimate) -> dict[str, Any]:
    padded = [p for p in model.padded if p is not None]
    return {
        "mesh": asdict(model.mesh),
        "settings": model.settings.as_dict(),
        "world": model.mesh.world,
        "muon_params": len(model.names),
        "buckets": len(model.plan(0).buckets),
        "picked": [{"why": why, "rank": rank} for why, rank in model.picked],
        "busy": rank_dict(model.busiest),
        "idle": rank_dict(model.idlest),
        "largest_peak": rank_dict(model.largest_peak(offload=False)),
        "largest_peak_offload": rank_dict(model.largest_peak(offload=True)),
        "ranks": [rank_dict(r) for r in model.ranks],
        "bytes_sent_max": int(model.screen.bytes_sent.sum(0).max()),
        "imbalance": model.imbalance,
        "padded_wire_bytes": sum(p.wire_bytes for p in padded),
        # the most `max_inflight` buckets alive at once hold (64 in flight of one bucket
        # counted its buffers 64 times)
        "padded_buffer_bytes": sum(
            sorted((p.buffer_bytes for p in padded), reverse=True)[: model.settings.max_inflight]
        ),
        "padding_bytes": sum(p.padding_bytes for p in padded),
        "padding_fraction": model.padding_fraction,
        "spread_buckets": sum(b.spread for b in model.plan(0).buckets),
    }


MEMORY_LINES = (
    ("kept between steps", lambda m: m.kept_bytes),
    ("  staging (ring, backward slots)", lambda m: m.staging_bytes),
    ("  exchange buffers", lambda m: m.transient.buffer_bytes),
    ("  Newton-Schulz", lambda m: m.transient.ns_bytes),
    ("  momentum / AdamW", lambda m: m.transient.other_bytes),
    ("step transient", lambda m: m.step_bytes),
    ("step peak", lambda m: m.peak_bytes),
)


def print_plan(model: ModelEstimate, rows: Sequence[dict[str, Any]], offloaded: bool) -> None:
    """The report; the memory with offload only where `offloaded` (`--offload`): its
    buckets are then capped as `setup_optimizer` caps them for the chunks."""
    mesh, settings = model.mesh, model.settings
    print(
        f"mesh: fsdp {mesh.fsdp} x replicate {mesh.replicate} (world {mesh.world}), ep {mesh.ep}, "
        f"experts sharded on {mesh.expert_shard}; bucket cap "
        f"{_mib(settings.bucket_cap_bytes)} MiB, max_inflight {settings.max_inflight}, "
        f"{settings.device}"
    )
    head = (
        f"{'bkt':>3} {'kind':<8} {'layers':>7} {'mats':>5} {'owners':>6} {'shapes':<34} "
        f"{'wire max':>9} {'busy':>5} {'buf':>7} {'NS':>7} {'idle':>5} {'buf':>7} {'NS':>7} "
        f"{'pad wire':>9}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        busy, idle, padded = row["busy"], row["idle"], row["padded"]
        print(
            f"{row['bucket']:>3} {row['kind']:<8} {row['layers']:>7} {busy['matrices']:>5} "
            f"{'-' if row['owners'] is None else row['owners']:>6} {row['shapes'][:34]:<34} "
            f"{_mib(row['bytes_sent_max']):>9} {busy['rank']:>5} "
            f"{_mib(busy['buffer_bytes']):>7} {_mib(busy['ns_bytes']):>7} {idle['rank']:>5} "
            f"{_mib(idle['buffer_bytes']):>7} {_mib(idle['ns_bytes']):>7} "
            f"{'-' if padded is None else _mib(padded['wire_bytes']):>9}"
        )
    print(
        "(MiB per rank; busy/idle: the rank with the most/fewest Newton-Schulz FLOPs in the "
        "bucket; buf: its send + receive + full buffers while the bucket is in flight)"
    )
    print()
    shown = [
        (f"busy (rank {model.busiest.rank})", model.busiest),
        (f"idle (rank {model.idlest.rank})", model.idlest),
    ]
    width = max(len(label) for label, _ in MEMORY_LINES)
    for offload in (False, True) if offloaded else (False,):
        top = model.largest_peak(offload)
        loads = top.offload_forward_load_bytes
        title = (
            f"with offload ({_mib(settings.offload_chunk_bytes)} MiB chunks; "
            f"{top.offload_schedule.describe()}"
            + (f"; the forward loads {loads / 2**30:.2f} GiB" if loads else "")
            + ")"
            if offload
            else "without offload"
        )
        columns = [*shown, (f"top peak (rank {top.rank})", top)]
        print(f"GiB per rank, {title}")
        budget = settings.offload_gpu_budget_bytes
        schedule = top.offload_schedule
        held = top.offload_plan.held_bytes(schedule.slots, schedule.ring_slots)
        if offload and budget is not None and held > budget:
            print(
                f"  (the staging ring alone holds {held / 2**30:.2f} GiB, over "
                "--offload-gpu-budget-mib: the wrapper warns, and the backward loads nothing)"
            )
        print(f"  {'':<{width}}" + "".join(f"{c:>20}" for c, _ in columns))
        for label, value in MEMORY_LINES:
            cells = "".join(
                f"{_gib(value(r.offload if offload else r.no_offload)):>20}" for _, r in columns
            )
            print(f"  {label:<{width}}{cells}")
        if offload:  # where the offloaded state lives: pinned host slabs, padded per chunk
            cells = "".join(f"{_gib(r.offload_plan.host_bytes):>20}" for _, r in columns)
            print(f"  {'pinned host memory':<{width}}{cells}")
        print()
    if not offloaded:
        print("(with offload: --offload, which caps Muon's buckets as setup_optimizer does)")
        print()
    picked = "; ".join(f"{why}: rank {rank}" for why, rank in model.picked)
    caveat = ", which another rank's may exceed with offload (picked without it)"
    print(
        f"ranks planned in full: {picked} (each found over all {model.screen.flops.numel()} "
        f"ranks from shard sizes and owners; top peak: the highest of these"
        f"{caveat if offloaded else ''})"
    )
    busy = model.busiest
    kept = f" ({_gib(busy.offload.state_bytes)} GiB of it kept on the GPU with offload)"
    print(
        f"optimizer state {_gib(busy.state_bytes)} GiB on busy rank {busy.rank}"
        f"{kept if offloaded else ''}; Newton-Schulz "
        f"{busy.ns_flops / 1e12:.2f} TFLOP on it vs {model.idlest.ns_flops / 1e12:.2f} on idle "
        f"rank {model.idlest.rank} (imbalance max/mean {model.imbalance:.3f})"
    )
    s = summary(model)
    print(f"wire per step: {_mib(s['bytes_sent_max'])} MiB max per rank")
    print(
        f"padded all-to-all instead: {_mib(s['padded_wire_bytes'])} MiB wire per rank, "
        f"{_mib(s['padded_buffer_bytes'])} MiB buffers, {_mib(s['padding_bytes'])} MiB zeros "
        f"per rank ({100 * s['padding_fraction']:.1f}% of what it moves)"
    )


def sweep_rows(
    models: Sequence[ModelEstimate], budget_bytes: int | None, offload: bool
) -> list[dict[str, Any]]:
    """One row per FSDP size (peaks over the planned ranks, `ModelEstimate.picked`; state and
    wire over every rank); `best` marks the least padding waste (then imbalance, then
    memory) among the sizes whose highest step peak fits `budget_bytes`."""
    rows = []
    for model in models:
        peaks = [(r.offload if offload else r.no_offload).peak_bytes for r in model.ranks]
        rows.append(
            {
                "fsdp": model.mesh.fsdp,
                "world": model.mesh.world,
                "offload": offload,
                "state_bytes": int(model.screen.state_bytes.max()),
                "peak_max": max(peaks),
                "peak_min": min(peaks),
                "bytes_sent": int(model.screen.bytes_sent.sum(0).max()),
                "imbalance": model.imbalance,
                "padding_fraction": model.padding_fraction,
                "fits": budget_bytes is None or max(peaks) <= budget_bytes,
                "best": False,
            }
        )
    fitting = [row for row in rows if row["fits"]]
    if fitting:
        best = min(
            fitting,
            key=lambda r: (
                round(r["padding_fraction"], 3),
                round(r["imbalance"], 3),
                r["peak_max"],
            ),
        )
        best["best"] = True
    return rows


def print_sweep(rows: Sequence[dict[str, Any]]) -> None:
    where = "offloaded" if rows and rows[0]["offload"] else "no offload"
    head = (
        f"{'fsdp':>5} {'world':>6} {'state GiB':>10} {'peak max':>9} {'peak min':>9} "
        f"{'wire MiB':>9} {'imbalance':>9} {'pad waste':>9}"
    )
    print(f"optimizer GPU peak per rank ({where}): kept between steps + step transient")
    if rows and rows[0]["offload"]:  # as `print_report` says of its top peak
        print(
            "(peak max: the highest of the ranks planned in full, picked without offload; "
            "with offload another rank's may be a little higher)"
        )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['fsdp']:>5} {r['world']:>6} {_gib(r['state_bytes']):>10} "
            f"{_gib(r['peak_max']):>9} {_gib(r['peak_min']):>9} "
            f"{_mib(r['bytes_sent']):>9} {r['imbalance']:>9.3f} "
            f"{100 * r['padding_fraction']:>8.1f}%"
            + ("  <- best" if r["best"] else "")
            + ("" if r["fits"] else "  (over budget)")
        )


def parser(prog: str = "python -m muon_offload.plan") -> argparse.ArgumentParser:
    """The planner's arguments (bench.plan_plot takes the same)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Muon's buckets, owners, bytes and optimizer memory per rank for a model "
        "and a mesh, with and without offload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS))
    source.add_argument("--config", help="a Hugging Face config.json")
    # "%(default).0s" prints nothing: the formatter appends its "(default: None)" otherwise
    p.add_argument(
        "--fsdp",
        type=_at_least(1),
        help=f"FSDP (shard) size (default {DEFAULT_FSDP})%(default).0s",
    )
    p.add_argument("--replicate", type=_at_least(1), default=1, help="HSDP replicas")
    p.add_argument(
        "--ep", type=_at_least(1), default=1, help="expert-parallel size (divides --fsdp)"
    )
    p.add_argument(
        "--expert-shard", choices=EXPERT_SHARDS, default="auto",
        help="how FSDP shards expert stacks within an EP group: on the expert dim (whole "
        "matrices, no exchange) or on rows (exchanged); auto: rows only when the experts are "
        "fewer than --fsdp (torchtitan's rule; plain fully_shard, as transformers' Trainer "
        "runs it, shards the expert dim: pass experts)",
    )  # fmt: skip
    p.add_argument(
        "--bucket-cap-mib", type=_mib_size(positive=True), default=None,
        help=f"Muon's bucket_cap_bytes; default: {DEFAULT_BUCKET_CAP_BYTES / 2**20:g}, with "
        "--offload what setup_optimizer caps it at for the chunks and --fsdp",
    )  # fmt: skip
    p.add_argument(
        "--max-inflight", type=_at_least(1), default=DEFAULT_MAX_INFLIGHT,
        help="Muon's max_inflight: exchanged buckets alive at once",
    )  # fmt: skip
    p.add_argument(
        "--ns-dtype", choices=sorted(DTYPES), default="bf16",
        help="Muon's ns_dtype: on the wire and in Newton-Schulz",
    )  # fmt: skip
    p.add_argument(
        "--param-dtype", choices=sorted(DTYPES), default="fp32",
        help="dtype of the params and grads, and so of AdamW's moments",
    )  # fmt: skip
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--ns-algorithm", choices=NS_ALGORITHMS, default="auto",
        help="Muon's ns_algorithm: gram plans Gram Newton-Schulz's workspace",
    )  # fmt: skip
    p.add_argument(
        "--ns-schedule", choices=sorted(SCHEDULES), default="keller_jordan",
        help="the Newton-Schulz schedule (Gram's workspace follows its restarts)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="cuda: fused momentum kernel and foreach AdamW; cpu: the torch paths",
    )  # fmt: skip
    p.add_argument(
        "--offload", action="store_true",
        help="plan for CPUOffloadOptimizer: Muon's buckets capped as setup_optimizer caps "
        "them, the sweep and --budget-gib sized for it (the report shows both)",
    )  # fmt: skip
    p.add_argument(
        "--offload-chunk-mib", type=_mib_size(positive=True),
        default=StepSettings().offload_chunk_bytes / 2**20,
        help="CPUOffloadOptimizer's chunk_bytes, in MiB",
    )  # fmt: skip
    p.add_argument(
        "--offload-slots", type=_at_least(1), default=StepSettings().offload_slots,
        help="CPUOffloadOptimizer's staging_slots",
    )  # fmt: skip
    p.add_argument(
        "--offload-resident-mib", type=_mib_size(positive=False), default=0.0,
        help="CPUOffloadOptimizer's gpu_resident_bytes: state kept on the GPU",
    )  # fmt: skip
    p.add_argument(
        "--offload-overlap-forward", action="store_true",
        help="CPUOffloadOptimizer's overlap_forward: chunks in the forward's order of first "
        "use (see --wrap), resident state the units the forward needs first",
    )  # fmt: skip
    p.add_argument(
        "--offload-backward-load-mib", type=_mib_size(positive=False), default=None,
        help="CPUOffloadOptimizer's load_in_backward as bytes (implies overlap_forward): state "
        "loaded in the backward, an extra staging slot per chunk; 0: none; "
        "default: the wrapper's (with overlap, the chunks the forward waits for first; on "
        "CUDA it loads more where they fit under the activations' peak, not planned here)",
    )  # fmt: skip
    p.add_argument(
        "--offload-gpu-budget-mib", type=_mib_size(positive=False), default=None,
        help="CPUOffloadOptimizer's gpu_budget_bytes with the default backward loads "
        "(needs --offload-overlap-forward, nothing resident): the first-wait chunks cut to "
        "fit it; on CUDA the loads grow no further than it",
    )  # fmt: skip
    p.add_argument(
        "--wrap", choices=FSDP_WRAPS, default="per-layer",
        help="the modules the run gives fully_shard (each layer and the root; torchtitan's, "
        "the final norm and head a unit too; the root only; none: a plain module on one "
        "device): with forward overlap the chunks follow the forward's first use",
    )  # fmt: skip
    p.add_argument("--sweep-fsdp", type=_sizes, help="comma-separated FSDP sizes, e.g. 8,16,32,64")
    p.add_argument(
        "--budget-gib", type=_positive("GiB"), help="per-rank budget for the optimizer's peak"
    )
    p.add_argument(
        "--replica-owners", choices=REPLICA_OWNERS, default="auto",
        help="HSDP: who orthogonalizes a matrix (Muon's replica_owners); the report shows both",
    )  # fmt: skip
    p.add_argument(
        "--replica-gbs", type=_positive("GB/s"),
        default=DEFAULT_SPREAD_MODEL.replica_bytes_per_s / 1e9,
        help="bandwidth between replicas per rank, GB/s, that replica_owners='auto' assumes",
    )  # fmt: skip
    p.add_argument(
        "--time-limit-s", type=_positive("seconds"), default=DEFAULT_TIME_LIMIT_S,
        help="refuse a model and mesh that do not plan within this many seconds",
    )  # fmt: skip
    p.add_argument(
        "--chunks", action="store_true",
        help="with --offload: list the offloaded step's chunks (where each lives, whether the "
        "backward loads it, its params) on the rank whose step peaks highest",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _sizes(text: str) -> list[int]:
    """`--sweep-fsdp`: comma-separated sizes >= 1 (argparse names the flag on an error)."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(
            f"should be comma-separated sizes >= 1, each once, e.g. 8,16,32, but is: {text!r}"
        )
    return sizes


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `low` (argparse names the flag on an error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"should be a whole number >= {low} but is: {text!r}")
        return value

    parse.__name__ = f"whole number >= {low}"
    return parse


def _finite(text: str, positive: bool, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf if positive else 0 <= value < math.inf):
        bound = "> 0" if positive else ">= 0"
        raise argparse.ArgumentTypeError(f"should be a number of {unit} {bound} but is: {text!r}")
    return value


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number of `unit` > 0."""

    def parse(text: str) -> float:
        return _finite(text, True, unit)

    parse.__name__ = unit
    return parse


def _mib_size(positive: bool) -> Callable[[str], float]:
    """An argparse type for a size in MiB: finite, > 0 or >= 0, at least a byte when > 0."""

    def parse(text: str) -> float:
        mib = _finite(text, positive, "MiB")
        if positive and int(mib * 2**20) < 1:
            raise argparse.ArgumentTypeError(f"should be at least one byte but is: {text!r} MiB")
        return mib

    parse.__name__ = "MiB"
    return parse


def settings_from(args: argparse.Namespace, fsdp: int | None = None) -> StepSettings:
    """The step settings the parsed arguments ask for (at `fsdp` if given)."""
    chunk_bytes = int(args.offload_chunk_mib * 2**20)
    if args.bucket_cap_mib is not None:
        bucket_cap = int(args.bucket_cap_mib * 2**20)
    elif args.offload:
        bucket_cap = offload_bucket_cap(chunk_bytes, args.fsdp if fsdp is None else fsdp)
    else:
        bucket_cap = DEFAULT_BUCKET_CAP_BYTES
    default_loads = (
        args.offload
        and args.offload_overlap_forward
        and not args.offload_resident_mib
        and args.offload_backward_load_mib is None
    )
    if args.offload_gpu_budget_mib is not None and not default_loads:
        raise ValueError(
            "--offload-gpu-budget-mib bounds the default backward loads: it needs --offload "
            "and --offload-overlap-forward, with no --offload-resident-mib and no "
            "--offload-backward-load-mib (the wrapper refuses it otherwise)"
        )
    return StepSettings(
        bucket_cap_bytes=bucket_cap,
        max_inflight=args.max_inflight,
        ns_dtype=DTYPES[args.ns_dtype],
        param_dtype=DTYPES[args.param_dtype],
        nesterov=args.nesterov,
        device=args.device,
        offload_chunk_bytes=chunk_bytes,
        offload_slots=args.offload_slots,
        offload_resident_bytes=int(args.offload_resident_mib * 2**20),
        offload_overlap_forward=args.offload_overlap_forward,
        offload_backward_load_bytes=None
        if args.offload_backward_load_mib is None
        else int(args.offload_backward_load_mib * 2**20),
        offload_gpu_budget_bytes=None
        if args.offload_gpu_budget_mib is None
        else int(args.offload_gpu_budget_mib * 2**20),
        ns_algorithm=args.ns_algorithm,
        ns_schedule=args.ns_schedule,
        replica_owners=args.replica_owners,
        replica_bytes_per_s=args.replica_gbs * 1e9,
    )


def model_shapes(args: argparse.Namespace) -> tuple[ParamShape, ...]:
    return from_preset(args.preset) if args.preset else from_config(load_config(args.config))


def estimate_from(args: argparse.Namespace, fsdp: int | None = None) -> ModelEstimate:
    """The estimate the parsed arguments ask for (at `fsdp` if given)."""
    shapes = model_shapes(args)
    mesh = MeshSpec(args.fsdp if fsdp is None else fsdp, args.replicate, args.ep, args.expert_shard)
    expert_flags = (mesh.ep > 1, args.expert_shard != "auto")
    if any(expert_flags) and not any(len(s.shape) == 3 for s in shapes):
        raise ValueError(
            "--ep and --expert-shard lay out expert stacks, and this model has none (no 3-D "
            "params): drop them"
        )
    if args.wrap == "none" and mesh.fsdp * mesh.replicate > 1:
        raise ValueError(
            "--wrap none plans a plain module on one device: give --fsdp 1 and --replicate 1"
        )
    if args.wrap != "per-layer" and not args.offload_overlap_forward:
        raise ValueError(
            f"--wrap {args.wrap} orders the overlapped step's chunks (by the forward's first "
            "use of each unit): give --offload --offload-overlap-forward too, or drop it"
        )
    wrapped = fsdp_modules(shapes, args.wrap)
    settings = settings_from(args, fsdp)
    return estimate(shapes, mesh, settings, time_limit_s=args.time_limit_s, fsdp_modules=wrapped)


DEFAULT_FSDP = 8
MAX_RANKS = 1 << 17
"""The largest mesh planned: the plan holds per-rank bounds and owners, and 10**7 ranks (a
typo) ran out of a 24 GB host's memory before `--time-limit-s` stopped it."""


def main(argv: Sequence[str] | None = None) -> int:
    installed = Path(sys.argv[0]).name == "muon-offload-plan"  # as the user called it
    parse = parser("muon-offload-plan") if installed else parser()
    args = parse.parse_args(argv)
    if args.fsdp is not None and args.sweep_fsdp:  # else the sweep's sizes, silently
        parse.error("--fsdp plans one size and --sweep-fsdp several: give one of them")
    if args.fsdp is None:
        args.fsdp = DEFAULT_FSDP
    if args.budget_gib is not None and not args.sweep_fsdp:
        parse.error("--budget-gib picks among --sweep-fsdp's sizes: give --sweep-fsdp too")
    if args.chunks and not args.offload:
        parse.error("--chunks lists the offloaded step's chunks: give --offload too")
    if args.chunks and args.sweep_fsdp:
        parse.error("--chunks lists one mesh's chunks: give --fsdp, not --sweep-fsdp")
    for size in args.sweep_fsdp or [args.fsdp]:
        if size % args.ep:  # as MeshSpec refuses it, said with the flags
            flag = "--sweep-fsdp's" if args.sweep_fsdp else "--fsdp"
            parse.error(
                f"{flag} {size} should be a multiple of --ep {args.ep} (the expert-parallel "
                "ranks split each shard group)"
            )
        if size * args.replicate > MAX_RANKS:  # a typo'd size outgrew 24 GB before the limit
            parse.error(
                f"fsdp {size} x replicate {args.replicate} is past the {MAX_RANKS} ranks this "
                "planner plans: its memory grows with the mesh (about 6 GB at 10**6)"
            )
    defaults = parse.parse_args(["--preset", next(iter(PRESETS))])
    offload_flags = [
        "--" + name.replace("_", "-")
        for name in vars(args)
        if name.startswith("offload_") and getattr(args, name) != getattr(defaults, name)
    ]
    if offload_flags and not args.offload:
        parse.error(f"{', '.join(offload_flags)} set the offloaded step: give --offload too")
    replica_flags = [
        flag
        for flag, name in (("--replica-owners", "replica_owners"), ("--replica-gbs", "replica_gbs"))
        if getattr(args, name) != getattr(defaults, name)
    ]
    if replica_flags and args.replicate == 1:
        parse.error(f"{', '.join(replica_flags)} choose HSDP's owners: give --replicate too")
    try:
        if args.sweep_fsdp:
            models = [estimate_from(args, size) for size in args.sweep_fsdp]
            budget = None if args.budget_gib is None else int(args.budget_gib * 2**30)
            rows = sweep_rows(models, budget, args.offload)
            print(json.dumps({"sweep": rows}, indent=1)) if args.json else print_sweep(rows)
            return 0
        model = estimate_from(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = bucket_rows(model)
    figures = ()
    if model.mesh.replicate > 1:
        figures = compare_replica_owners(model_shapes(args), model.mesh, model.settings)
    chunks = chunk_rows(model) if args.chunks else []
    if args.json:
        out = {"summary": summary(model), "buckets": rows}
        if figures:
            out["replica_owners"] = [asdict(f) for f in figures]
        if args.chunks:
            out["offload_chunks"] = chunks
        print(json.dumps(out, indent=1))
    else:
        print_plan(model, rows, args.offload)
        print_chunks(chunks)
        if figures:
            print_replica_owners(model, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
