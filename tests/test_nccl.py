"""FSDP2 at world 2 under NCCL (one process per GPU), and the same bodies on gloo/CPU.

Each test runs one body on two spawned ranks, parametrized over the backend:
"gloo" on CPU (always, so CI proves the body) and "nccl" on two GPUs (`gpu`
marker, skipped unless `torch.cuda.device_count() >= 2`), with `device_id` passed
to `init_process_group` and deterministic mode on
(`torch.use_deterministic_algorithms(True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`).

1. `muon.Muon` on DTensor params of a 1-D mesh (awkward shapes: rows not divisible
   by 2, a 2-row matrix, a 1-row matrix that leaves rank 1 an empty shard, Shard(1),
   fused QKV, 3-D expert stacks local and exchanged), on both 2-D meshes a pair of
   GPUs allows for EP x FSDP ((2, 1) and (1, 2), fused 3-D experts), and on an FSDP2
   `fully_shard` model, against single-process Muon on the full tensors on the same
   device. Tolerances: bitwise for the AdamW params everywhere (elementwise math on
   both sides) and for Muon on gloo with bf16 Newton-Schulz (CPU `baddbmm` gives the
   same bits per matrix whatever the batch); fp32 Newton-Schulz on CPU, and any
   Newton-Schulz on CUDA (cuBLAS may pick another kernel for another batch count),
   within `NS_TOLERANCE` after `STEPS` steps at lr 0.02.
2. `CPUOffloadOptimizer` with `overlap_forward` over an FSDP2 model, AdamW and Muon,
   bit-equal to no offload (Muon's Newton-Schulz batches are per bucket and a chunk
   never splits a bucket, so with the torch backend the launches are the same); each
   rank logs the NUMA node its GPU's host state is pinned on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from spawn_ranks import run_on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from muon import Muon, muon_param_groups
from offload import CPUOffloadOptimizer

WORLD = 2
STEPS = 3
LR = 0.02
# Max abs difference of params (entries ~1) from the single process after STEPS steps
# where the Newton-Schulz arithmetic may differ in rounding (see the module docstring).
NS_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0, atol=2e-3)}

BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nccl",
        id="nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                reason=f"needs {WORLD} CUDA devices",
            ),
        ],
    ),
]

# (shape, placements on a 1-D mesh of 2, row_blocks)
ONE_D = [
    ((13, 12), (Shard(0),), None),  # rows not divisible by 2
    ((2, 9), (Shard(0),), None),  # a 2-row matrix: one row each
    ((1, 8), (Shard(0),), None),  # rank 1 holds an empty shard
    ((5, 17), (Shard(1),), None),  # wide, sharded on columns
    ((16, 12), (Shard(0),), (8, 4, 4)),  # fused QKV
    ((3, 7, 10), (Shard(0),), None),  # experts sharded on the expert dim: local, 2 + 1
    ((3, 9, 6), (Shard(1),), (5, 4)),  # fused experts sharded on rows: exchanged
]
EP_FSDP = [
    ((4, 9, 6), (Shard(0), Shard(1)), (5, 4)),  # fused 3-D experts: EP on experts, FSDP rows
    ((3, 5, 7), (Shard(0), Shard(0)), None),  # both on the expert dim: local
    ((11, 12), (Replicate(), Shard(0)), None),
]
ADAMW_SHAPE = (11,)


# -- the harness: spawn_ranks.run_on_ranks, deterministic, with the rank's device -------------


def _run(body: Callable[..., None], backend: str, *args: Any) -> None:
    """`body(rank, device, *args)` on WORLD spawned ranks of one `backend` group."""
    run_on_ranks(_deterministic, WORLD, body, backend, *args, backend=backend)


def _deterministic(rank: int, world: int, body: Callable[..., None], backend: str, *args) -> None:
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS starts: deterministic
    torch.use_deterministic_algorithms(True)
    body(rank, torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu"), *args)


# -- 1. Muon on FSDP2 == single-process Muon ------------------------------------------------------


def _full(shape, seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _shard(full: torch.Tensor, mesh, placements) -> DTensor:
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    return DTensor.from_local(
        local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _groups(params, specs, adamw):
    groups = [{"params": [p for p, s in zip(params, specs, strict=True) if s[2] is None]}]
    groups += [
        {"params": [p], "row_blocks": s[2]}
        for p, s in zip(params, specs, strict=True)
        if s[2] is not None
    ]
    return groups + [{"params": adamw, "algorithm": "adamw", "lr": 3e-3}]


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool, ns_dtype, where: str) -> None:
    if exact:
        assert torch.equal(got, want), where
    else:
        torch.testing.assert_close(got, want, **NS_TOLERANCE[ns_dtype], msg=where)


def _check_params(mesh, specs, device, ns_dtype, case: str) -> None:
    adamw_placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
    fulls = [_full(shape, i, device) for i, (shape, _, _) in enumerate(specs)]
    adamw_full = _full(ADAMW_SHAPE, 99, device)

    def build(distributed: bool):
        params = [
            torch.nn.Parameter(_shard(f, mesh, pl) if distributed else f.clone())
            for f, (_, pl, _) in zip(fulls, specs, strict=True)
        ]
        adamw = torch.nn.Parameter(
            _shard(adamw_full, mesh, adamw_placements) if distributed else adamw_full.clone()
        )
        opt = Muon(_groups(params, specs, [adamw]), lr=LR, bucket_cap_bytes=600, ns_dtype=ns_dtype)
        return params + [adamw], opt

    ref, ref_opt = build(False)
    got, opt = build(True)
    placements = [pl for _, pl, _ in specs] + [adamw_placements]
    for step in range(STEPS):
        for i, (p, q) in enumerate(zip(ref, got, strict=True)):
            grad = _full(p.shape, 1000 * step + i, device)
            p.grad, q.grad = grad, _shard(grad, mesh, placements[i])
        ref_opt.step()
        opt.step()
    exact_muon = device.type == "cpu" and ns_dtype == torch.bfloat16
    for i, (p, q) in enumerate(zip(ref, got, strict=True)):
        where = f"{case} {ns_dtype} param {i} {tuple(p.shape)} {placements[i]}"
        want = _shard(p.detach(), mesh, placements[i]).to_local()
        _same(q.to_local(), want, exact_muon or i == len(specs), ns_dtype, where)


def _check_fully_shard(mesh, device, ns_dtype) -> None:
    """A `fully_shard` model (uneven, empty shards; fused 3-D experts) with a real backward."""
    from torch.distributed.fsdp import fully_shard

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Parameter(torch.randn(3, 10, 12) * 0.1)  # fused gate+up: (6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bi,eoi->beo", x, self.up).sum(1)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 13), torch.nn.Tanh(), torch.nn.Linear(13, 12), Experts(),
            torch.nn.Linear(10, 1),  # one output row: rank 1 holds an empty shard
        ).to(device)  # fmt: skip

    ref, sharded = model(), model()
    for layer in sharded:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    blocks = {r"up$": (6, 4)}
    ref_opt = Muon(muon_param_groups(ref, row_blocks=blocks), lr=LR, ns_dtype=ns_dtype)
    opt = Muon(muon_param_groups(sharded, row_blocks=blocks), lr=LR, ns_dtype=ns_dtype)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(7)).to(device)
    for _ in range(STEPS):
        for m, o in ((ref, ref_opt), (sharded, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        # reduce-scatter sums in another order than the local backward: one grad for both
        for p, q in zip(ref.parameters(), sharded.parameters(), strict=True):
            q.grad = _shard(p.grad, mesh, q.placements)
        ref_opt.step()
        opt.step()
    exact = device.type == "cpu" and ns_dtype == torch.bfloat16
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters(), strict=True):
        want = _shard(p.detach(), mesh, q.placements).to_local()
        _same(q.to_local(), want, exact or p.ndim == 1, ns_dtype, f"fully_shard {name}")


def _muon_body(rank: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    one_d = init_device_mesh(device.type, (WORLD,))
    cases = [
        ("1d", one_d, ONE_D),
        ("ep2 x fsdp1", init_device_mesh(device.type, (WORLD, 1)), EP_FSDP),
        ("ep1 x fsdp2", init_device_mesh(device.type, (1, WORLD)), EP_FSDP),
    ]
    for ns_dtype in (torch.bfloat16, torch.float32):
        for name, mesh, specs in cases:
            _check_params(mesh, specs, device, ns_dtype, name)
        _check_fully_shard(one_d, device, ns_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_muon_fsdp2_world2_matches_single_process(backend):
    _run(_muon_body, backend)


# -- 2. offload + forward overlap == no offload -----------------------------------------------


def _offload_model(device: torch.device, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 255), torch.nn.Tanh(), torch.nn.Linear(255, 2), torch.nn.Tanh(),
        torch.nn.Linear(2, 33), torch.nn.Tanh(), torch.nn.Linear(33, 7),
    ).to(device)  # fmt: skip
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, optimizer, rank: int, device: torch.device, steps: int = 4) -> None:
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(3, 12, generator=gen).to(device)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()


def _offload_body(rank: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from muon.newton_schulz import set_backend
    from offload.numa import device_numa_node

    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(name)s: %(message)s")
    if device.type == "cuda":
        node = device_numa_node(device)
        print(f"rank {rank}: {device} is on NUMA node {node}", flush=True)
    set_backend("torch")  # the same Newton-Schulz launches per bucket with and without chunks
    mesh = init_device_mesh(device.type, (WORLD,))
    makers = {
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        "muon": lambda m: Muon(muon_param_groups(m), lr=LR, bucket_cap_bytes=4096),
    }
    for name, make in makers.items():
        for chunk_bytes in (2**40, 1):
            plain_model = _offload_model(device, mesh)
            model = _offload_model(device, mesh)
            plain = make(plain_model)
            offloaded = CPUOffloadOptimizer(
                make(model), chunk_bytes=chunk_bytes, staging_slots=2, overlap_forward=model
            )
            _train(plain_model, plain, rank, device)
            _train(model, offloaded, rank, device)
            offloaded.wait_for_optimizer_step()
            for (n, a), b in zip(plain_model.named_parameters(), model.parameters(), strict=True):
                where = f"{name} chunk_bytes={chunk_bytes} {n}"
                assert torch.equal(a.to_local(), b.to_local()), where


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_overlap_fsdp2_world2_is_bit_equal(backend):
    _run(_offload_body, backend)
