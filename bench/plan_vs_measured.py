"""muon_offload.estimate's optimizer memory vs `torch.cuda` allocator statistics, one GPU.

Qwen3-8B shapes (`--layers` decoder layers, embeddings, lm_head and norms in
the AdamW group), fp32 params and grads, Muon with its defaults, with and
without `CPUOffloadOptimizer`. The params are DTensors Shard(0) on a 1-rank
NCCL mesh (FSDP2 at world 1), so every bucket takes the exchange path. Per arm,
a fresh optimizer steps twice:

    kept between steps = memory_allocated after step 1 - before it
                         (state; with offload the staging ring, state on the host)
    step transient     = max_memory_allocated during step 2 - memory_allocated before it

and both are compared with the estimate for the same shapes and mesh (the
estimate leaves out cuBLAS workspaces and the first step's extra chunk).
Prints a table and writes JSON. CUDA only; well under a minute.

    python -m bench.plan_vs_measured --out bench/results/plan_vs_measured.json
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from bench.report import write_json
from muon import Muon, muon_param_groups
from muon.model_shapes import PRESETS, from_config, from_module, meta_module
from muon.newton_schulz import set_backend
from muon_offload.estimate import MeshSpec, StepSettings, estimate
from offload import CPUOffloadOptimizer


def _model(layers: int, device: torch.device) -> torch.nn.Module:
    shapes = from_config({**PRESETS["qwen3-8b"], "num_hidden_layers": layers})
    module = meta_module(shapes).to_empty(device=device)
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

    gen = torch.Generator(device="cuda").manual_seed(seed)
    for p in module.parameters():
        p.grad = None  # free the old grad before the new one exists
        local = torch.randn(p.to_local().shape, device="cuda", generator=gen)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _measure(fn) -> int:
    """Peak bytes `fn` allocates on top of what is allocated when it starts."""
    before = _allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _arm(module, settings: StepSettings, offload: bool) -> tuple[int, int]:
    """(kept after step 1, transient of step 2) of a fresh optimizer over `module`."""
    opt = Muon(
        muon_param_groups(module),
        lr=0.02,
        bucket_cap_bytes=settings.bucket_cap_bytes,
        max_inflight=settings.max_inflight,
    )
    if offload:
        opt = CPUOffloadOptimizer(
            opt, chunk_bytes=settings.offload_chunk_bytes, staging_slots=settings.offload_slots
        )
    _set_grads(module, 1)
    before = _allocated()
    opt.step()  # creates state (on the host with offload) and the staging ring
    kept = _allocated() - before
    _set_grads(module, 2)
    transient = _measure(opt.step)
    if offload:
        opt.wait_for_optimizer_step()
    del opt
    return kept, transient


def run(layers: int, cap_mib: float, max_inflight: int, chunk_mib: float) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    module = _model(layers, device)
    shapes = from_module(module)
    from torch.distributed.device_mesh import init_device_mesh

    _distribute(module, init_device_mesh("cuda", (1,)))
    settings = StepSettings(
        bucket_cap_bytes=int(cap_mib * 2**20),
        max_inflight=max_inflight,
        offload_chunk_bytes=int(chunk_mib * 2**20),
    )
    (rank,) = estimate(shapes, MeshSpec(1), settings).ranks
    rows = []
    for offload in (False, True):
        kept, transient = _arm(module, settings, offload)
        expected = rank.offload if offload else rank.no_offload
        arm = "offload" if offload else "no offload"
        rows += [
            (f"{arm}: kept between steps", expected.kept_bytes, kept),
            (f"{arm}: step transient", expected.transient.total_bytes, transient),
        ]
    return {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "layers": layers,
        "buckets": len(rank.loads),
        "offload_chunks": rank.offload_chunks,
        "rows": [
            {"phase": name, "estimate": est, "measured": got, "ratio": got / est}
            for name, est, got in rows
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-cap-mib", type=float, default=512)
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--offload-chunk-mib", type=float, default=256)
    p.add_argument(
        "--ns-backend", default="auto", choices=("auto", "torch", "triton"),
        help="Newton-Schulz path (both allocate the same workspace, which the plan models)",
    )  # fmt: skip
    p.add_argument("--out", help="JSON path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("plan_vs_measured needs a CUDA device")
    set_backend(args.ns_backend)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NS {args.ns_backend}")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
        try:
            result = run(
                args.layers, args.bucket_cap_mib, args.max_inflight, args.offload_chunk_mib
            )
            result["ns_backend"] = args.ns_backend
        finally:
            dist.destroy_process_group()
    gib = 2**30
    print(f"Qwen3-8B x {args.layers} layers, {result['buckets']} buckets, 1-rank NCCL mesh")
    print(f"{'phase':<34} {'estimate GiB':>12} {'measured GiB':>12} {'ratio':>7}")
    for row in result["rows"]:
        print(
            f"{row['phase']:<34} {row['estimate'] / gib:>12.3f} {row['measured'] / gib:>12.3f} "
            f"{row['ratio']:>7.3f}"
        )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
