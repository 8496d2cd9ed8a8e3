"""muon_offload.estimate's optimizer memory vs what the step allocates, one device.

Qwen3-8B shapes (`--layers` decoder layers, embeddings, lm_head and norms in
the AdamW group; `--scale` divides the widths and the vocabulary), fp32 params
and grads, Muon with its defaults but `ns_algorithm` (standard unless given: the
plan's Newton-Schulz workspace, `ExchangePlan.ns_numel`, is the standard
algorithm's), with and without `CPUOffloadOptimizer`. The params are DTensors
Shard(0) on a 1-rank mesh (FSDP2 at world 1). A mesh axis of size 1 shards
nothing, so every Muon param is local: `MuonStep` steps each as a unit of its
own and launches them re-bucketed under the cap, batched by shape. Per arm, a
fresh optimizer steps twice:

    kept between steps = allocated after step 1 - before it
                         (state; with offload nothing: the state is on the host
                         and the staging ring is given back after the step)
    step transient     = peak allocated during step 2 - allocated before it
                         (with offload the ring and the chunks' compute)

and both are compared with the estimate for the same shapes and mesh (the
estimate leaves out cuBLAS workspaces and the first step's extra chunk).
CUDA (NCCL): the allocator's statistics. `--device cpu` (gloo) is a smoke run:
the profiler's CPU allocations, Newton-Schulz in fp32 (CPU bf16 matmuls
allocate packing buffers of their own), and with offload the host slabs (host
memory on any device, CPU memory here) subtracted from what is kept.
Prints a table and writes JSON. Well under a minute.

    python -m bench.plan_vs_measured --out bench/results/plan_vs_measured.json
    python -m bench.plan_vs_measured --device cpu --layers 2 --scale 16 --out /tmp/pvm.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.report import write_json
from muon import Muon, muon_param_groups
from muon.model_shapes import PRESETS, from_config, from_module, meta_module
from muon.newton_schulz import set_backend
from muon_offload.estimate import MeshSpec, StepSettings, estimate
from offload import CPUOffloadOptimizer

NS_ALGORITHMS = ("standard", "gram", "auto")
WIDTHS = ("hidden_size", "intermediate_size", "head_dim", "vocab_size")


def _model(layers: int, scale: int, device: torch.device) -> torch.nn.Module:
    config = {**PRESETS["qwen3-8b"], "num_hidden_layers": layers}
    config.update({key: max(1, config[key] // scale) for key in WIDTHS})
    module = meta_module(from_config(config)).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return module


def _distribute(module: torch.nn.Module, mesh) -> None:
    """Every param as a DTensor Shard(0) on the 1-rank mesh (what FSDP2 gives at world 1)."""
    from torch.distributed.tensor import DTensor, Shard

    for name, p in list(module.named_parameters()):
        *path, leaf = name.split(".")
        param = torch.nn.Parameter(DTensor.from_local(p.data, mesh, [Shard(0)], run_check=False))
        setattr(module.get_submodule(".".join(path)), leaf, param)


def _set_grads(module: torch.nn.Module, seed: int) -> None:
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        p.grad = None  # free the old grad before the new one exists
        local = p.to_local()
        gen = torch.Generator(device=local.device).manual_seed(seed)
        grad = torch.randn(local.shape, device=local.device, generator=gen)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
        seed += 1


def _cuda_run(fn: Callable[[], None]) -> tuple[int, int]:
    """(allocated after `fn` - before, peak during `fn` - before), from the CUDA allocator."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before


def _cpu_run(fn: Callable[[], None]) -> tuple[int, int]:
    """The same from the profiler's CPU allocation events. Their running total also counts
    what an earlier profile saw allocated and not freed: it is taken off."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]"
    )
    if not memory:
        return 0, 0
    _, first_total, first_bytes = memory[0]
    base = first_total - first_bytes
    return memory[-1][1] - base, max(total for _, total, _ in memory) - base


def _arm(module, settings: StepSettings, offload: bool, ns_algorithm: str) -> tuple[int, int]:
    """(kept after step 1, transient of step 2) of a fresh optimizer over `module`."""
    opt = Muon(
        muon_param_groups(module),
        lr=0.02,
        ns_algorithm=ns_algorithm,
        ns_dtype=settings.ns_dtype,
        bucket_cap_bytes=settings.bucket_cap_bytes,
        max_inflight=settings.max_inflight,
    )
    if offload:
        opt = CPUOffloadOptimizer(
            opt, chunk_bytes=settings.offload_chunk_bytes, staging_slots=settings.offload_slots
        )
    run = _cuda_run if settings.device == "cuda" else _cpu_run
    _set_grads(module, 1)
    kept, _ = run(opt.step)  # creates state (on the host with offload)
    if offload and settings.device == "cpu":
        kept -= opt.plan.host_bytes  # host memory, not the device's
    _set_grads(module, 2)
    _, transient = run(opt.step)
    if offload:
        opt.wait_for_optimizer_step()
        opt.close()
    del opt
    return kept, transient


def run(
    layers: int,
    scale: int,
    cap_mib: float,
    max_inflight: int,
    chunk_mib: float,
    ns_algorithm: str,
    device_type: str,
) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    module = _model(layers, scale, device)
    shapes = from_module(module)
    _distribute(module, init_device_mesh(device.type, (1,)))
    settings = StepSettings(
        bucket_cap_bytes=int(cap_mib * 2**20),
        max_inflight=max_inflight,
        ns_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device.type,
        offload_chunk_bytes=int(chunk_mib * 2**20),
    )
    (rank,) = estimate(shapes, MeshSpec(1), settings).ranks
    rows = []
    for offload in (False, True):
        kept, transient = _arm(module, settings, offload, ns_algorithm)
        expected = rank.offload if offload else rank.no_offload
        arm = "offload" if offload else "no offload"
        rows += [
            (f"{arm}: kept between steps", expected.kept_bytes, kept),
            (f"{arm}: step transient", expected.step_bytes, transient),
        ]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers": layers,
        "scale": scale,
        "ns_algorithm": ns_algorithm,
        "buckets": len(rank.loads),
        "units": len(rank.units),
        "offload_chunks": rank.offload_chunks,
        "rows": [
            # nothing estimated (kept with offload): the ratio is undefined, the bytes tell
            {"phase": name, "estimate": est, "measured": got, "ratio": got / est if est else None}
            for name, est, got in rows
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--scale", type=int, default=1, help="divide widths and vocabulary by this")
    p.add_argument("--bucket-cap-mib", type=float, default=512)
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--offload-chunk-mib", type=float, default=256)
    p.add_argument(
        "--ns-backend", default="auto", choices=("auto", "torch", "triton"),
        help="Newton-Schulz backend (both allocate the standard algorithm's workspace)",
    )  # fmt: skip
    p.add_argument(
        "--ns-algorithm", default="standard", choices=NS_ALGORITHMS,
        help="Muon's ns_algorithm; the plan models the standard algorithm's workspace",
    )  # fmt: skip
    p.add_argument("--out", help="JSON path")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for the smoke run")
    set_backend(args.ns_backend)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {where}, NS {args.ns_backend} {args.ns_algorithm}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
        try:
            result = run(
                args.layers,
                args.scale,
                args.bucket_cap_mib,
                args.max_inflight,
                args.offload_chunk_mib,
                args.ns_algorithm,
                args.device,
            )
            result["ns_backend"] = args.ns_backend
        finally:
            dist.destroy_process_group()
    mib = 2**20
    print(
        f"Qwen3-8B x {args.layers} layers (widths / {args.scale}), {result['buckets']} "
        f"buckets, {result['units']} units, {result['offload_chunks']} offload chunks, "
        f"1-rank {backend} mesh"
    )
    print(f"{'phase':<34} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>7}")
    for row in result["rows"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(
            f"{row['phase']:<34} {row['estimate'] / mib:>12.2f} {row['measured'] / mib:>12.2f} "
            f"{ratio:>7}"
        )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
