"""Muon's exchange: ragged all-to-all (ours) vs padded all-to-all, estimated vs measured.

Two experiments, each on `--world` ranks (gloo on CPU, or NCCL with one GPU per rank):

- `--experiment model` (default): the Muon params of a model slice, Qwen3-8B
  (`--layers` dense layers) and a Qwen3-30B-A3B-shaped MoE slice (`--moe-layers`
  layers with 3-D expert stacks), as FSDP2 lays them out on the mesh `muon_offload.estimate`
  describes (Shard(0); experts on the expert dim or, `--expert-shard rows`, on rows).
  Per strategy: time per step, exchange time, bytes sent per rank, and memory per rank
  for the busy and the idle rank (most / fewest Newton-Schulz FLOPs), each estimated
  by `muon_offload.estimate` for the same mesh and measured. Ours: a real `Muon.step` (time),
  the same with `collect_timings` (exchange time: packing, all-to-all, unpacking),
  `Muon.metrics` (bytes the all-to-alls were given), and on CUDA the allocator's peak
  during the step over what was allocated before it (the Muon buckets' transient).
  Padded: the bare all-to-alls of `muon_offload.estimate.padded_alternative` (equal splits,
  matrices and rows padded to the ranks), out and back per exchanged bucket; its
  memory is the estimate's (buffers of `max_inflight` buckets), not measured.
  `--scale` divides the model's widths (and experts) for CPU runs.
  Then, estimated only: the same slices under HSDP (`--world` shards x `--replicas`),
  per-rank Newton-Schulz time and bytes with owners spread over the replicas vs per
  replica (`muon_offload.estimate.compare_replica_owners`).
- `--experiment hsdp`: the model slices on a (`--replicate`, world / replicate) mesh,
  a Muon step with owners spread over the replicas and per replica: step time,
  Newton-Schulz time and bytes per rank, measured, then the estimate at `--replicas`.
- `--experiment remainder`: R = 1..7 matrices of one shape in one bucket, ours vs
  padded vs all-gather + reduce-scatter (the remainder-strategy comparison).

    torchrun --nproc-per-node 2 -m bench.muon_comm --backend nccl --out bench/results/comm.json
    python -m bench.muon_comm --world 2 --scale 32 --out bench/results/muon_comm_cpu.json
    python -m bench.muon_comm --experiment remainder --world 4 --rows 256 --cols 192
    torchrun --nproc-per-node 8 -m bench.muon_comm --experiment hsdp --replicate 2 --backend nccl
    python -m bench.muon_comm --world 1 --backend nccl --hsdp-fsdp 8  # one GPU: HSDP estimated

Without torchrun it spawns its own ranks. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard

from bench.report import exit_spawned_rank, write_json
from muon import Muon, muon_param_groups
from muon.model_shapes import PRESETS, from_config, meta_module
from muon.planning import DEFAULT_SPREAD_MODEL
from muon_offload.estimate import (
    EXPERT_SHARDS,
    MeshSpec,
    StepSettings,
    compare_replica_owners,
    estimate,
)

ITEMSIZE = 2  # bf16 on the wire
MIB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after one warmup, ranks started together."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# -- model slices ------------------------------------------------------------------------------


def _config(preset: str, layers: int, scale: int) -> dict[str, Any]:
    """`preset`'s config with `layers` decoder layers and widths (and experts) / `scale`."""
    config = {**PRESETS[preset], "num_hidden_layers": layers}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim"):
        if key in config:
            config[key] = max(1, config[key] // scale)
    if "num_experts" in config:
        config["num_experts"] = max(2, config["num_experts"] // scale)
    return config


def _muon_params(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the Muon params, in the optimizer's order (its first group)."""
    module = meta_module(from_config(config))
    names = {id(p): n for n, p in module.named_parameters()}
    (muon, *_) = muon_param_groups(module)
    return [(names[id(p)], tuple(p.shape)) for p in muon["params"]]


def _distributed(shapes, spec: MeshSpec, meshes, rank: int, device: torch.device, seed: int):
    """Params (with grads) laid out as `spec` says Muon sees them at fsdp index `rank`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    gen = torch.Generator().manual_seed(seed)
    params = []
    for _, shape in shapes:
        layout = spec.layout(shape, (), 0, rank)
        mesh = meshes[layout.mesh_key]
        placements = [Replicate() if d is None else Shard(d) for d in layout.shard_dims]
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))  # contiguous
        # Drawn at the local shape, never the full tensor: the bench needs data, not a model.
        local = (torch.randn(local_shape, generator=gen) * 0.02).to(device)
        grad = torch.randn(local_shape, generator=gen).to(device)
        kwargs = dict(run_check=False, shape=torch.Size(shape), stride=stride)
        p = torch.nn.Parameter(DTensor.from_local(local, mesh, placements, **kwargs))
        p.grad = DTensor.from_local(grad, mesh, placements, **kwargs)
        params.append(p)
    return params


def _model_arm(
    name: str, config: dict[str, Any], spec: MeshSpec, args, rank: int, device: torch.device
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    shapes = _muon_params(config)
    settings = StepSettings(max_inflight=args.max_inflight, device=device.type)
    model = estimate(from_config(config), spec, settings, ranks=[rank])
    inner = spec.fsdp // spec.ep
    meshes = {"dense": init_device_mesh(device.type, (spec.fsdp,))}
    meshes["experts"] = (
        init_device_mesh(device.type, (spec.ep, inner)) if spec.ep > 1 else meshes["dense"]
    )
    params = _distributed(shapes, spec, meshes, rank, device, seed=1)
    opt = Muon(params, lr=0.02, max_inflight=args.max_inflight)
    opt.step()  # momentum created
    _sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt.step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    step_s = _timed(opt.step, device, args.repeats)
    opt.collect_timings = True
    opt.step()
    exchange_s = sum(m.exchange_s for m in opt.metrics)
    sent = sum(m.bytes_sent for m in opt.metrics)
    received = sum(m.bytes_received for m in opt.metrics)

    est = model.rank(rank)
    est_transient = model.muon_step_transient(rank)  # the bench's optimizer has no AdamW
    padded = [p for p in model.padded if p is not None]
    largest = max((p.padded_bytes for p in padded), default=0) // ITEMSIZE
    send = torch.zeros(largest, dtype=torch.bfloat16, device=device)
    recv = torch.zeros_like(send)

    def padded_exchange() -> None:
        group = meshes["dense"].get_group(0)
        for p in padded:
            n = p.padded_bytes // ITEMSIZE
            dist.all_to_all_single(recv[:n], send[:n], group=group)  # pieces to owners
            dist.all_to_all_single(send[:n], recv[:n], group=group)  # results back

    padded_s = _timed(padded_exchange, device, args.repeats) if padded else 0.0
    return {
        "model": name,
        "rank": rank,
        "busy": rank == model.busiest.rank,
        "idle": rank == model.idlest.rank,
        "buckets": len(est.loads),
        "ours_step_s": step_s,
        "ours_exchange_s": exchange_s,
        "ours_bytes_sent": sent,
        "ours_bytes_received": received,
        "ours_bytes_sent_estimate": est.bytes_sent,
        "ours_transient_bytes": peak,
        "ours_transient_bytes_estimate": est_transient.total_bytes,
        "ours_buffer_bytes_estimate": est_transient.buffer_bytes,
        "padded_exchange_s": padded_s,
        "padded_bytes_sent_estimate": sum(p.wire_bytes for p in padded),  # out and back
        "padded_buffer_bytes_estimate": args.max_inflight
        * max((p.buffer_bytes for p in padded), default=0),
    }


def _model_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    device = _device(args, rank)
    spec = MeshSpec(world, ep=args.ep, expert_shard=args.expert_shard)
    return [_model_arm(name, config, spec, args, rank, device) for name, config in _arms(args)]


def _arms(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The model slices the arguments ask for: (name, config)."""
    arms = []
    if args.layers:
        arms.append(("qwen3-8b", _config("qwen3-8b", args.layers, args.scale)))
    if args.moe_layers:
        arms.append(("qwen3-30b-a3b", _config("qwen3-30b-a3b", args.moe_layers, args.scale)))
    return arms


def _print_model(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    def mib(n: int | None) -> str:
        return "n/a" if n is None else f"{n / MIB:,.2f}"

    print(
        f"{'model':<14} {'strategy':<8} {'rank':<9} {'step ms':>8} {'exch ms':>8} "
        f"{'sent MiB est':>12} {'meas':>8} {'memory MiB est':>14} {'meas':>8}"
    )
    summary = []
    for name in dict.fromkeys(row["model"] for row in rows):
        ranks = [row for row in rows if row["model"] == name]
        for role in ("busy", "idle"):
            row = next(r for r in ranks if r[role])
            step_ms = 1e3 * max(r["ours_step_s"] for r in ranks)
            exchange_ms = 1e3 * max(r["ours_exchange_s"] for r in ranks)
            padded_ms = 1e3 * max(r["padded_exchange_s"] for r in ranks)
            who = f"{role} {row['rank']}"
            print(
                f"{name:<14} {'ragged':<8} {who:<9} {step_ms:>8.2f} {exchange_ms:>8.2f} "
                f"{mib(row['ours_bytes_sent_estimate']):>12} {mib(row['ours_bytes_sent']):>8} "
                f"{mib(row['ours_transient_bytes_estimate']):>14} "
                f"{mib(row['ours_transient_bytes']):>8}"
            )
            print(
                f"{'':<14} {'padded':<8} {who:<9} {'':>8} {padded_ms:>8.2f} "
                f"{mib(row['padded_bytes_sent_estimate']):>12} {'':>8} "
                f"{mib(row['padded_buffer_bytes_estimate']):>14} {'':>8}"
            )
            summary.append(
                {
                    "model": name,
                    "role": role,
                    "ours_step_ms": step_ms,
                    "ours_exchange_ms": exchange_ms,
                    "padded_exchange_ms": padded_ms,
                    **{k: v for k, v in row.items() if k not in ("model",)},
                }
            )
    print(
        "step ms: a whole Muon step (slowest rank); exch ms: ours = packing + all-to-all + "
        "unpacking (collect_timings), padded = the bare all-to-alls out and back. memory: "
        "ours = the Muon buckets' transient (buffers of the buckets in flight + Newton-Schulz), "
        "measured on CUDA only; padded = estimated buffers only."
    )
    world = len([row for row in rows if row["model"] == rows[0]["model"]])
    return summary + _print_hsdp(args, world)


def _print_hsdp(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    """Estimated, not measured: the same slices under HSDP (`--hsdp-fsdp` shards, default
    `world`, x R replicas), owners spread over the replicas vs per replica
    (`compare_replica_owners`)."""
    world = args.hsdp_fsdp or world
    print(
        f"\nHSDP, estimated: fsdp {world} x replicate R, per rank on the busiest rank "
        f"(NS at {DEFAULT_SPREAD_MODEL.ns_flops_per_s / 1e12:g} TFLOP/s)"
    )
    print(f"{'model':<14} {'R':>3} {'owners':<12} {'NS ms':>8} {'wire MiB':>10} {'spread':>7}")
    out = []
    for name, config in _arms(args):
        for replicas in (int(r) for r in args.replicas.split(",")):
            spec = MeshSpec(world, replicas, args.ep, args.expert_shard)
            for f in compare_replica_owners(from_config(config), spec):
                print(
                    f"{name:<14} {replicas:>3} {f.replica_owners:<12} {1e3 * f.ns_s_max:>8.3f} "
                    f"{f.bytes_sent_max / MIB:>10,.2f} {f.spread_buckets:>7}"
                )
                out.append({"model": name, "replicate": replicas, "hsdp_estimate": asdict(f)})
    return out


# -- remainder: R matrices of one shape ---------------------------------------------------------


def _remainder_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device(args, rank)
    mesh = init_device_mesh(device.type, (world,))
    rows, cols = args.rows, args.cols
    matrix = rows * cols * ITEMSIZE
    shard = math.ceil(rows / world) * cols * ITEMSIZE
    results = []
    for r in range(1, 8):
        gen = torch.Generator().manual_seed(r)
        params = []
        for _ in range(r):
            full = torch.randn(rows, cols, generator=gen)
            local = full.chunk(world)[rank].to(device)
            params.append(
                torch.nn.Parameter(
                    DTensor.from_local(
                        local, mesh, (Shard(0),), shape=full.shape, stride=full.stride()
                    )
                )
            )
        for p in params:
            p.grad = DTensor.from_local(torch.randn_like(p.to_local()), mesh, (Shard(0),))
        opt = Muon(params, max_inflight=1, bucket_cap_bytes=2**40)
        ours_s = _timed(opt.step, device, args.repeats)
        metrics = opt.metrics[0]
        plan = opt._muon_plan().exchange(0, frozenset(range(r)))
        buffers = (plan.send_numel + plan.recv_numel + plan.full_numel) * plan.itemsize

        padded = math.ceil(r / world) * world
        send = torch.zeros(padded * shard // ITEMSIZE, dtype=torch.bfloat16, device=device)
        recv = torch.zeros_like(send)
        padded_s = _timed(lambda s=send, v=recv: dist.all_to_all_single(v, s), device, args.repeats)
        gathered = torch.zeros(world * r * shard // ITEMSIZE, dtype=torch.bfloat16, device=device)
        mine = torch.zeros(r * shard // ITEMSIZE, dtype=torch.bfloat16, device=device)

        def agrs(g=gathered, m=mine) -> None:
            dist.all_gather_into_tensor(g, m)
            dist.reduce_scatter_tensor(m, g)

        try:
            agrs_s: float | None = _timed(agrs, device, args.repeats)
        except RuntimeError:  # gloo builds without reduce_scatter_tensor
            agrs_s = None
        results.append(
            {
                "R": r,
                "rank": rank,
                "busy": metrics.owned > 0,
                "ours_step_s": ours_s,
                "ours_wire_bytes": metrics.bytes_sent,
                "ours_buffer_bytes": buffers,
                "padded_a2a_s": padded_s,
                "padded_wire_bytes": 2 * (padded // world) * (world - 1) * shard,
                "padded_buffer_bytes": padded * shard + 2 * (padded // world) * matrix,
                "agrs_s": agrs_s,
                "agrs_wire_bytes": 2 * r * (world - 1) * shard,
                "agrs_buffer_bytes": r * shard + 2 * r * matrix,
            }
        )
    return results


def _print_remainder(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    print(
        f"{args.rows}x{args.cols} bf16 ({args.rows * args.cols * ITEMSIZE / MIB:.2f} MiB), "
        "one bucket of R matrices"
    )
    print(
        f"{'R':>2} | {'ours ms':>8} {'wire MiB':>9} {'busy MiB':>9} {'idle MiB':>9} | "
        f"{'pad ms':>7} {'wire MiB':>9} {'buf MiB':>8} | "
        f"{'agrs ms':>8} {'wire MiB':>9} {'buf MiB':>8}"
    )
    summary = []
    for r in range(1, 8):
        ranks = [row for row in rows if row["R"] == r]
        busy = [row["ours_buffer_bytes"] for row in ranks if row["busy"]]
        idle = [row["ours_buffer_bytes"] for row in ranks if not row["busy"]]
        agrs = [row["agrs_s"] for row in ranks]
        entry = {
            "R": r,
            "ours_step_ms": 1e3 * max(row["ours_step_s"] for row in ranks),
            "ours_wire_bytes_max": max(row["ours_wire_bytes"] for row in ranks),
            "ours_buffer_bytes_busy": max(busy, default=0),
            "ours_buffer_bytes_idle": max(idle, default=0),
            "padded_a2a_ms": 1e3 * max(row["padded_a2a_s"] for row in ranks),
            "padded_wire_bytes": ranks[0]["padded_wire_bytes"],
            "padded_buffer_bytes": ranks[0]["padded_buffer_bytes"],
            "agrs_ms": None if None in agrs else 1e3 * max(agrs),
            "agrs_wire_bytes": ranks[0]["agrs_wire_bytes"],
            "agrs_buffer_bytes": ranks[0]["agrs_buffer_bytes"],
        }
        summary.append(entry)
        agrs_ms = "n/a" if entry["agrs_ms"] is None else f"{entry['agrs_ms']:.2f}"
        print(
            f"{r:>2} | {entry['ours_step_ms']:>8.2f} {entry['ours_wire_bytes_max'] / MIB:>9.2f} "
            f"{entry['ours_buffer_bytes_busy'] / MIB:>9.2f} "
            f"{entry['ours_buffer_bytes_idle'] / MIB:>9.2f} | "
            f"{entry['padded_a2a_ms']:>7.2f} {entry['padded_wire_bytes'] / MIB:>9.2f} "
            f"{entry['padded_buffer_bytes'] / MIB:>8.2f} | {agrs_ms:>8} "
            f"{entry['agrs_wire_bytes'] / MIB:>9.2f} {entry['agrs_buffer_bytes'] / MIB:>8.2f}"
        )
    print(
        "ours ms is a whole Muon step (momentum, exchange, NS, apply); pad / agrs ms are the "
        "bare collectives. Buffers: the bucket's send + receive + full, NS temporaries excluded."
    )
    return summary


# -- launch -------------------------------------------------------------------------------------

# -- hsdp: owners spread over the replicas vs per replica, measured ---------------------------


def _hsdp_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The model slices on a (replicate, fsdp) mesh (`--replicate`), a Muon step with each
    `replica_owners`: time, Newton-Schulz time and bytes on this rank (`collect_timings`)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % args.replicate:
        raise ValueError(f"--replicate {args.replicate} should divide the world {world}")
    device = _device(args, rank)
    spec = MeshSpec(world // args.replicate, args.replicate, args.ep, args.expert_shard)
    meshes = {"dense": init_device_mesh(device.type, (spec.replicate, spec.fsdp))}
    meshes["experts"] = (
        init_device_mesh(device.type, (spec.replicate, spec.ep, spec.fsdp // spec.ep))
        if spec.ep > 1
        else meshes["dense"]
    )
    rows = []
    for name, config in _arms(args):
        for owners in ("spread", "per_replica"):
            # the same seed on every rank: the replicas of a shard hold the same grads
            params = _distributed(_muon_params(config), spec, meshes, rank, device, seed=1)
            opt = Muon(params, lr=0.02, max_inflight=args.max_inflight, replica_owners=owners)
            opt.step()
            step_s = _timed(opt.step, device, args.repeats)
            opt.collect_timings = True
            opt.step()
            rows.append(
                {
                    "model": name,
                    "rank": rank,
                    "replica_owners": owners,
                    "step_s": step_s,
                    "ns_s": sum(m.ns_s for m in opt.metrics),
                    "bytes_sent": sum(m.bytes_sent for m in opt.metrics),
                }
            )
    return rows


def _print_hsdp_measured(
    rows: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    world = len({row["rank"] for row in rows})
    print(
        f"HSDP fsdp {world // args.replicate} x replicate {args.replicate}, measured: "
        "the slowest rank's step and Newton-Schulz time, the most bytes a rank sent"
    )
    print(f"{'model':<14} {'owners':<12} {'step ms':>8} {'NS ms':>8} {'sent MiB':>10}")
    summary = []
    for name in dict.fromkeys(row["model"] for row in rows):
        for owners in ("spread", "per_replica"):
            mine = [r for r in rows if r["model"] == name and r["replica_owners"] == owners]
            result = {
                "model": name,
                "replica_owners": owners,
                "step_ms": 1e3 * max(r["step_s"] for r in mine),
                "ns_ms": 1e3 * max(r["ns_s"] for r in mine),
                "bytes_sent_max": max(r["bytes_sent"] for r in mine),
            }
            print(
                f"{name:<14} {owners:<12} {result['step_ms']:>8.2f} {result['ns_ms']:>8.2f} "
                f"{result['bytes_sent_max'] / MIB:>10,.2f}"
            )
            summary.append(result)
    return summary + _print_hsdp(args, world // args.replicate)


EXPERIMENTS = {
    "model": (_model_worker, _print_model),
    "remainder": (_remainder_worker, _print_remainder),
    "hsdp": (_hsdp_worker, _print_hsdp_measured),
}


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    return torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")


def _init(args: argparse.Namespace, rank: int, world: int, init_method: str | None) -> None:
    if args.backend == "gloo":
        torch.set_num_threads(1)
    options: dict[str, Any] = {}
    if args.backend == "nccl":
        torch.cuda.set_device(_device(args, rank))
        options["device_id"] = _device(args, rank)
    dist.init_process_group(
        args.backend, init_method=init_method, rank=rank, world_size=world, **options
    )


def _spawned(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    _init(args, rank, world, f"file://{os.path.join(tmp, 'init')}")
    rows = EXPERIMENTS[args.experiment][0](rank, world, args)
    with open(os.path.join(tmp, f"out.{rank}"), "w") as f:
        json.dump(rows, f)
    exit_spawned_rank()


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    print(f"torch {torch.__version__}, {args.backend}, world {world}, {args.experiment}")
    summary = EXPERIMENTS[args.experiment][1](rows, args)
    write_json(
        args.out,
        {
            "backend": args.backend,
            "world": world,
            "args": vars(args),
            "results": summary,
            "per_rank": rows,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--experiment", choices=sorted(EXPERIMENTS), default="model")
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn (not torchrun)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2, help="model: Qwen3-8B layers")
    parser.add_argument("--moe-layers", type=int, default=1, help="model: Qwen3-30B-A3B layers")
    parser.add_argument("--scale", type=int, default=1, help="model: divide widths by this")
    parser.add_argument("--ep", type=int, default=1, help="model: expert-parallel size")
    parser.add_argument("--expert-shard", choices=EXPERT_SHARDS, default="auto")
    parser.add_argument("--max-inflight", type=int, default=2)
    parser.add_argument("--replicate", type=int, default=2, help="hsdp: replicas of the mesh")
    parser.add_argument(
        "--hsdp-fsdp", type=int,
        help="model, hsdp: shards of the estimated HSDP mesh (default: the ranks run)",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", default="2,4,8",
        help="model: HSDP replica counts of the estimated spread vs per-replica owners",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, default=256, help="remainder: 8192 / 32")
    parser.add_argument("--cols", type=int, default=192, help="remainder: 6144 / 32")
    parser.add_argument("--out", default="bench/results/muon_comm.json")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(args, rank, world, None)
        rows = EXPERIMENTS[args.experiment][0](rank, world, args)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            _report([row for part in gathered for row in part], args, world)
        dist.barrier()
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world, args, tmp), nprocs=args.world, join=True)
        rows = []
        for rank in range(args.world):
            with open(os.path.join(tmp, f"out.{rank}")) as f:
                rows += json.load(f)
    _report(rows, args, args.world)


if __name__ == "__main__":
    main()
