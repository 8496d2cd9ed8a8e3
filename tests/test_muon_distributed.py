"""Distributed Muon on gloo == single-process Muon on the full tensors, bit for bit.

One spawn per world size runs every case: 1-D meshes with Shard(0) / Shard(1)
(uneven and empty shards, tall and wide, fused QKV, 3-D expert stacks, a param
without a grad), FSDP2 `fully_shard` params, at world size 2 meshes 1x2 and 2x1
(a size-1 axis sharding a matrix dim), and at world size 4 HSDP 2x2 and EP x FSDP
2x2. Each case also checks the subset step, unit by unit, against the plain step.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref

import pytest
import torch
from spawn_ranks import run_on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from muon import Muon

STEPS = 3
# (shape, placements on a 1-D mesh, row_blocks); rows 10 and 13 do not divide 3 or 4,
# 2 rows leave ranks empty at world sizes 3 and 4.
ONE_D = [
    ((10, 12), (Shard(0),), None),
    ((2, 9), (Shard(0),), None),
    ((13, 6), (Shard(1),), None),
    ((5, 17), (Shard(0),), None),
    ((16, 12), (Shard(0),), (8, 4, 4)),
    ((6, 16), (Shard(1),), (3, 3)),
    ((3, 7, 10), (Shard(0),), None),  # experts sharded on the expert dim: local
    ((2, 9, 6), (Shard(1),), None),  # experts sharded on rows: exchanged
    ((5, 4), (Replicate(),), None),
]
HSDP = [
    ((10, 12), (Replicate(), Shard(0)), None),
    ((7, 5), (Replicate(), Shard(1)), None),
    ((12, 8), (Replicate(), Shard(0)), (6, 2, 4)),
]
EP_FSDP = [
    ((4, 9, 6), (Shard(0), Shard(1)), None),  # EP on experts, FSDP on rows: exchanged
    ((4, 5, 7), (Shard(0), Shard(0)), None),  # both on the expert dim: local
    # FSDP2's default dim-0 shard over EP's (torchtitan's layout): strided, local
    ((8, 5, 7), (_StridedShard(0, split_factor=2), Shard(0)), None),
    ((5, 7, 3), (Shard(0), Replicate()), None),
    ((10, 12), (Replicate(), Shard(0)), None),
]
# On a (1, 2) or (2, 1) mesh: the size-1 axis shards nothing, whatever its placement.
SIZE_ONE_AXIS = [
    ((10, 12), (Shard(1), Shard(1)), None),
    ((13, 6), (Shard(0), Shard(0)), None),
    ((16, 12), (Shard(0), Shard(1)), (8, 4, 4)),
    ((2, 9, 6), (Shard(2), Shard(1)), None),
    ((3, 7, 10), (Shard(0), Shard(0)), None),
]
ADAMW = [((11,), (Shard(0),)), ((3, 5), (Shard(0),))]
CONFIGS = [
    dict(bucket_cap_bytes=300, max_inflight=2, nesterov=True),
    dict(bucket_cap_bytes=10**6, max_inflight=1, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    dict(bucket_cap_bytes=500, max_inflight=3, ns_dtype=torch.float32),
    # bf16 params: the CPU's bf16 add_ rounded by the operands' layout, a shard otherwise
    dict(bucket_cap_bytes=400, max_inflight=2, param_dtype=torch.bfloat16),
]


def _full(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _shard(full: torch.Tensor, mesh, placements) -> DTensor:
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    return DTensor.from_local(
        local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _local(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    return _shard(t.detach(), mesh, placements).to_local()


def _groups(params, specs, adamw_params):
    plain = [p for p, (_, _, blocks) in zip(params, specs, strict=True) if blocks is None]
    groups = [{"params": plain}]
    groups += [
        {"params": [p], "row_blocks": blocks}
        for p, (_, _, blocks) in zip(params, specs, strict=True)
        if blocks is not None
    ]
    groups.append({"params": adamw_params, "algorithm": "adamw", "lr": 3e-3})
    return groups


def _check_case(mesh, specs, config, case: str) -> None:
    """Distributed params vs plain full tensors, after STEPS steps and for the subset step."""
    adamw_specs = [s for s in ADAMW if len(s[1]) == mesh.ndim] or [
        ((11,), (Replicate(),) * (mesh.ndim - 1) + (Shard(0),))
    ]
    config = dict(config)
    dtype = config.pop("param_dtype", torch.float32)
    fulls = [_full(shape, i).to(dtype) for i, (shape, _, _) in enumerate(specs)]
    adamw_fulls = [_full(shape, 100 + i).to(dtype) for i, (shape, _) in enumerate(adamw_specs)]

    def build(distributed: bool):
        params = [
            torch.nn.Parameter(_shard(f, mesh, pl) if distributed else f.clone())
            for f, (_, pl, _) in zip(fulls, specs, strict=True)
        ]
        extra = [
            torch.nn.Parameter(_shard(f, mesh, pl) if distributed else f.clone())
            for f, (_, pl) in zip(adamw_fulls, adamw_specs, strict=True)
        ]
        opt = Muon(_groups(params, specs, extra), lr=0.02, **config)
        return params, extra, opt

    ref_params, ref_extra, ref_opt = build(False)
    params, extra, opt = build(True)
    sub_params, sub_extra, sub_opt = build(True)
    placements = [pl for _, pl, _ in specs] + [pl for _, pl in adamw_specs]
    for step in range(STEPS):
        for i, (p, q, r) in enumerate(
            zip(ref_params + ref_extra, params + extra, sub_params + sub_extra, strict=True)
        ):
            if step == 1 and i == 0:  # a param without a grad on one step
                p.grad = q.grad = r.grad = None
                continue
            grad = _full(p.shape, 1000 * step + i).to(dtype)
            p.grad = grad
            q.grad = _shard(grad, mesh, placements[i])
            r.grad = _shard(grad, mesh, placements[i])
        ref_opt.step()
        opt.step()
        subset = sub_opt.begin_subset_step()
        for unit in reversed(subset.units):
            subset.step_params(unit)

    for i, (p, q, r) in enumerate(
        zip(ref_params + ref_extra, params + extra, sub_params + sub_extra, strict=True)
    ):
        where = f"{case} {config} param {i} shape {tuple(p.shape)} {placements[i]}"
        assert torch.equal(q.to_local(), _local(p, mesh, placements[i])), where
        assert torch.equal(r.to_local(), q.to_local()), f"subset step: {where}"
        for key, value in ref_opt.state[p].items():
            got = opt.state[q][key]
            if value.ndim == 0:
                assert torch.equal(got, value), f"{key}: {where}"
                continue
            assert isinstance(got, DTensor) and got.placements == q.placements, f"{key}: {where}"
            assert torch.equal(got.to_local(), _local(value, mesh, placements[i])), (
                f"{key}: {where}"
            )
            assert torch.equal(sub_opt.state[r][key].to_local(), got.to_local()), f"{key}: {where}"
    exchanged = {b.index for b in opt._muon_plan().buckets if b.axis is not None}
    order = [m.bucket for m in opt.metrics if m.bucket in exchanged]
    assert order == sorted(order)  # a local bucket finishes as it starts, out of this order


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    cases = [("1d", init_device_mesh("cpu", (world,)), ONE_D)]
    if world == 2:
        cases.append(("1x2", init_device_mesh("cpu", (1, 2)), SIZE_ONE_AXIS))
        cases.append(("2x1", init_device_mesh("cpu", (2, 1)), SIZE_ONE_AXIS))
    if world == 4:
        cases.append(("hsdp", init_device_mesh("cpu", (2, 2)), HSDP))
        cases.append(("ep_fsdp", init_device_mesh("cpu", (2, 2)), EP_FSDP))
        _check_uneven_strided_experts_refused(init_device_mesh("cpu", (2, 2)))
    for name, mesh, specs in cases:
        for config in CONFIGS:
            _check_case(mesh, specs, config, name)
    _check_fully_shard(init_device_mesh("cpu", (world,)))
    _check_whole_state_loaded(init_device_mesh("cpu", (world,)))
    _check_state_placed_otherwise_loaded(init_device_mesh("cpu", (world,)))


def _check_uneven_strided_experts_refused(mesh) -> None:
    """FSDP2's default shard over EP's, of experts that do not divide evenly: each rank
    holds other experts than the plan counts (torch.chunk's), refused naming the way out."""
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    stack = torch.nn.Parameter(_shard(_full((6, 5, 7), 0), mesh, placements))
    stack.grad = _shard(_full((6, 5, 7), 1), mesh, placements)
    opt = Muon([stack], lr=0.02)
    with pytest.raises(ValueError, match="must divide evenly|'yes' vs 'no"):
        opt.step()


def _check_whole_state_loaded(mesh) -> None:
    """A single-process checkpoint (plain full tensors, loaded on every rank) into Muon over
    sharded params: each rank takes its shard of the state. Whole, a 1-row shard's grad
    broadcast into the full momentum buffer, and the step went on silently wrong."""
    specs = [((2, 64), (Shard(0),)), ((8, 16), (Shard(1),)), ((11,), (Shard(0),))]
    fulls = [_full(shape, i) for i, (shape, _) in enumerate(specs)]

    def groups(params):
        return [{"params": params[:2]}, {"params": params[2:], "algorithm": "adamw"}]

    whole = [torch.nn.Parameter(f.clone()) for f in fulls]
    sharded = [
        torch.nn.Parameter(_shard(f, mesh, pl)) for f, (_, pl) in zip(fulls, specs, strict=True)
    ]
    ref, opt = Muon(groups(whole), lr=0.02), Muon(groups(sharded), lr=0.02)
    for step in range(4):
        if step == 2:  # resume from the single process's params and state
            with torch.no_grad():
                for p, q, (_, placements) in zip(whole, sharded, specs, strict=True):
                    q.to_local().copy_(_local(p, mesh, placements))
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's load keeps it
        for i, (p, q) in enumerate(zip(whole, sharded, strict=True)):
            grad = _full(p.shape, 1000 * step + i)
            p.grad, q.grad = grad, _shard(grad, mesh, specs[i][1])
        ref.step()
        if step >= 2:
            opt.step()
    for p, q, (_, placements) in zip(whole, sharded, specs, strict=True):
        assert torch.equal(q.to_local(), _local(p, mesh, placements)), tuple(p.shape)
        for key, value in ref.state[p].items():
            got = opt.state[q][key]
            if value.ndim:
                assert isinstance(got, DTensor) and got.placements == q.placements, key
                assert torch.equal(got.to_local(), _local(value, mesh, placements)), key


def _check_state_placed_otherwise_loaded(mesh) -> None:
    """A sharded checkpoint (`opt.state_dict()`, DTensor state) loaded where the params
    are placed otherwise (the model sharded another way since the save) or are plain: the
    state is placed as its param. Before, Replicate state given a Shard(0) param
    broadcast its shard's grad into the whole buffer (silently wrong), and the others
    failed inside the step on clashing shapes."""
    specs = [(4, 6), (6,)]  # a Muon matrix, an AdamW vector
    fulls = [_full(shape, i) for i, shape in enumerate(specs)]
    saved_as = [(Replicate(),), (Replicate(),)], [(Shard(0),), (Shard(0),)]
    loaded_as = [(Shard(0),), (Shard(0),)], [(Shard(1),), (Replicate(),)], None

    def groups(params):
        return [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}]

    def params_as(values, placements):
        return [
            torch.nn.Parameter(v.clone() if pl is None else _shard(v, mesh, pl))
            for v, pl in zip(values, placements or (None, None), strict=True)
        ]

    def grads(step):
        return [_full(shape, 1000 * step + i) for i, shape in enumerate(specs)]

    whole = params_as(fulls, None)
    ref = Muon(groups(whole), lr=0.02)
    for step in range(2):
        for p, g in zip(whole, grads(step), strict=True):
            p.grad = g
        ref.step()
    for before in saved_as:
        saving = params_as(fulls, before)
        saver = Muon(groups(saving), lr=0.02)
        for p, g, pl in zip(saving, grads(0), before, strict=True):
            p.grad = _shard(g, mesh, pl)
        saver.step()
        checkpoint = saver.state_dict()
        for after in loaded_as:
            resumed = params_as([p.full_tensor() for p in saving], after)
            opt = Muon(groups(resumed), lr=0.02)
            opt.load_state_dict(copy.deepcopy(checkpoint))
            for i, (p, g) in enumerate(zip(resumed, grads(1), strict=True)):
                p.grad = g if after is None else _shard(g, mesh, after[i])
            opt.step()
            for p, q in zip(whole, resumed, strict=True):
                got = q.full_tensor() if after is not None else q.detach()
                assert torch.equal(got, p.detach()), (before, after, tuple(p.shape))
    from torch.distributed.device_mesh import init_device_mesh

    other_mesh = init_device_mesh("cpu", (1, mesh.size()))
    elsewhere = [torch.nn.Parameter(_shard(f, other_mesh, (Replicate(), Shard(0)))) for f in fulls]
    with pytest.raises(ValueError, match="state 'momentum_buffer' of param 0 is a DTensor on"):
        Muon(groups(elsewhere), lr=0.02).load_state_dict(copy.deepcopy(checkpoint))


def _check_fully_shard(mesh) -> None:
    """FSDP2 `fully_shard` params (Shard(0), uneven) with a real backward."""
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3), torch.nn.Linear(3, 7)
        )

    ref, sharded = model(), model()
    for layer in sharded:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    def groups(m):
        return [
            {"params": [p for n, p in m.named_parameters() if n.endswith("weight")]},
            {
                "params": [p for n, p in m.named_parameters() if n.endswith("bias")],
                "algorithm": "adamw",
            },
        ]

    ref_opt, opt = Muon(groups(ref), lr=0.02), Muon(groups(sharded), lr=0.02)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(7))
    for _ in range(STEPS):
        for m, o in ((ref, ref_opt), (sharded, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        # reduce-scatter sums in another order than the local backward: start both from one grad
        for p, q in zip(ref.parameters(), sharded.parameters(), strict=True):
            q.grad = _shard(p.grad, mesh, q.placements)
        ref_opt.step()
        opt.step()
    for p, q in zip(ref.parameters(), sharded.parameters(), strict=True):
        assert torch.equal(q.to_local(), _local(p, mesh, q.placements)), tuple(p.shape)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_distributed_matches_single_process_bitwise(world):
    run_on_ranks(_worker, world)


def _wait_until_dropped(refs) -> list[int]:
    """Numels of the buffers still alive once gloo's worker threads have let go of them.

    A gloo collective's work object holds its tensors until its thread finishes, a
    moment after `wait()` returns; this polls for that (up to 10 s), it times nothing."""
    for _ in range(200):
        gc.collect()
        alive = [numel for numel, ref in refs if ref() is not None]
        if not alive:
            break
        time.sleep(0.05)
    return alive


def _invariance_worker(rank: int, world: int) -> None:
    """Bucket cap and max_inflight change no bit; each bucket allocates exactly its plan's
    buffers (no send/receive when local) and none of them outlives the step."""
    from torch.distributed.device_mesh import init_device_mesh

    from muon import optimizer
    from muon.planning import launch_order

    mesh = init_device_mesh("cpu", (world,))
    specs = ONE_D + [((0, 8), (Shard(0),), None)]  # an empty matrix steps as torch's does
    fulls = [_full(shape, i) for i, (shape, _, _) in enumerate(specs)]
    total = sum(f.numel() * 2 for f in fulls)
    allocate = optimizer._transient
    made: list[tuple[int, weakref.ref]] = []

    def record(numel, dtype, device):
        buffer = allocate(numel, dtype, device)
        made.append((numel, weakref.ref(buffer)))
        return buffer

    optimizer._transient = record
    results = []
    for cap, inflight in [(total, 1), (total // 4, 2), (total // 16, 3), (total // 16, 1)]:
        params = [
            torch.nn.Parameter(_shard(f, mesh, pl))
            for f, (_, pl, _) in zip(fulls, specs, strict=True)
        ]
        extra = [torch.nn.Parameter(_shard(_full((11,), 99), mesh, (Shard(0),)))]
        opt = Muon(
            _groups(params, specs, extra), lr=0.02, bucket_cap_bytes=cap, max_inflight=inflight
        )
        for step in range(STEPS):
            made.clear()
            for i, p in enumerate(params + extra):
                p.grad = _shard(_full(p.shape, 1000 * step + i), mesh, p.placements)
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert _wait_until_dropped(made) == [], (cap, inflight, step)
            plan = opt._muon_plan()
            everything = frozenset(range(len(params)))
            plans = [plan.exchange(b.index, everything) for b in plan.buckets if b.axis is not None]
            plans += plan.local_exchanges(
                [i for b in plan.buckets if b.axis is None for i in b.params], everything
            )
            plans.sort(key=lambda p: p.bucket)
            expected = [
                numel
                for start, i in launch_order(plans, inflight)
                if start and plans[i].matrices
                for numel in (
                    (plans[i].full_numel,)
                    if plans[i].axis is None
                    else (plans[i].full_numel, plans[i].send_numel, plans[i].recv_numel)
                )
            ]
            assert [numel for numel, _ in made] == expected, (cap, inflight, step)
        results.append([p.to_local() for p in params + extra])
    optimizer._transient = allocate
    for other in results[1:]:
        for i, (p, q) in enumerate(zip(results[0], other, strict=True)):
            assert torch.equal(p, q), (i, specs[i] if i < len(specs) else "adamw")


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_result_does_not_depend_on_bucket_cap_or_max_inflight(world):
    run_on_ranks(_invariance_worker, world)
