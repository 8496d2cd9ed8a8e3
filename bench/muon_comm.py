"""Remainder-batch exchange: ragged all-to-all (ours) vs padded all-to-all vs all-gather.

For R = 1..7 matrices of one shape (a scaled-down 8192 x 6144 by default) on
world size 4 (gloo on CPU; NCCL with --backend nccl when there are 4 GPUs),
Shard(0) over the ranks, one bucket: bytes on the wire per rank and exchange
buffer bytes on busy and idle ranks. Ours is measured from the optimizer's
plan and its allocated buffers, with the step time of a real `Muon.step`;
padded all-to-all and all-gather + reduce-scatter are computed for the same
matrices and timed with the bare collectives. Prints a table (time per step and memory
per rank for each strategy
), writes JSON.

    python -m bench.muon_comm --rows 256 --cols 192 --out bench/results/muon_comm.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

from bench.report import exit_spawned_rank, write_json
from muon import Muon

ITEMSIZE = 2  # bf16 on the wire


def _timed(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # first run is warmup
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _worker(rank: int, world: int, args: argparse.Namespace, init: str, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

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
        buffers = opt._buffers.nbytes

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
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    exit_spawned_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="8192 / 32 by default")
    parser.add_argument("--cols", type=int, default=192, help="6144 / 32 by default")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/muon_comm.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_worker, args=(args.world, args, init, out), nprocs=args.world, join=True)
        rows = [row for rank in range(args.world) for row in json.load(open(f"{out}.{rank}"))]

    mib = 2**20
    print(
        f"torch {torch.__version__}, {args.backend}, world {args.world}, "
        f"{args.rows}x{args.cols} bf16 ({args.rows * args.cols * ITEMSIZE / mib:.2f} MiB)"
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
        entry = {
            "R": r,
            "ours_step_ms": 1e3 * max(row["ours_step_s"] for row in ranks),
            "ours_wire_bytes_max": max(row["ours_wire_bytes"] for row in ranks),
            "ours_buffer_bytes_busy": max(busy, default=0),
            "ours_buffer_bytes_idle": max(idle, default=0),
            "padded_a2a_ms": 1e3 * max(row["padded_a2a_s"] for row in ranks),
            "padded_wire_bytes": ranks[0]["padded_wire_bytes"],
            "padded_buffer_bytes": ranks[0]["padded_buffer_bytes"],
            "agrs_ms": None
            if ranks[0]["agrs_s"] is None
            else 1e3 * max(row["agrs_s"] for row in ranks),
            "agrs_wire_bytes": ranks[0]["agrs_wire_bytes"],
            "agrs_buffer_bytes": ranks[0]["agrs_buffer_bytes"],
        }
        summary.append(entry)
        agrs_ms = "n/a" if entry["agrs_ms"] is None else f"{entry['agrs_ms']:.2f}"
        print(
            f"{r:>2} | {entry['ours_step_ms']:>8.2f} {entry['ours_wire_bytes_max'] / mib:>9.2f} "
            f"{entry['ours_buffer_bytes_busy'] / mib:>9.2f} "
            f"{entry['ours_buffer_bytes_idle'] / mib:>9.2f} | "
            f"{entry['padded_a2a_ms']:>7.2f} {entry['padded_wire_bytes'] / mib:>9.2f} "
            f"{entry['padded_buffer_bytes'] / mib:>8.2f} | {agrs_ms:>8} "
            f"{entry['agrs_wire_bytes'] / mib:>9.2f} {entry['agrs_buffer_bytes'] / mib:>8.2f}"
        )
    print(
        "ours ms is a whole Muon step (momentum, exchange, NS, apply); pad / agrs ms are the "
        "bare collectives. Buffers: exchange buffers only, NS temporaries excluded."
    )
    write_json(
        args.out,
        {
            "torch": torch.__version__,
            "backend": args.backend,
            "world": args.world,
            "rows": args.rows,
            "cols": args.cols,
            "results": summary,
            "per_rank": rows,
        },
    )


if __name__ == "__main__":
    main()
