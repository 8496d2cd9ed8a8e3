"""The offline planner: shapes, per-rank totals, the optimizer's own plan on gloo, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import run_on_ranks

from muon import Muon, muon_param_groups
from muon.model_shapes import from_config, from_module, from_preset, meta_module
from muon.plan import MeshSpec, StepSettings, bucket_rows, build_plan, main, padded_alternative
from muon.planning import MuonPlan, ParamLayout

# DeepSeek-like: MLA, a dense first layer, routed experts + a shared one, router bias.
TINY_MOE = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "q_lora_rank": 12,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "intermediate_size": 24,
    "moe_intermediate_size": 6,
    "n_routed_experts": 3,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "vocab_size": 40,
}
TINY_DENSE = {
    "model_type": "qwen3",
    "hidden_size": 20,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 6,
    "intermediate_size": 26,
    "vocab_size": 30,
    "tie_word_embeddings": True,
}
CAP = 1500  # bytes: several buckets per tiny model
MESHES = [
    MeshSpec(1),
    MeshSpec(2),
    MeshSpec(3, expert_shard="rows"),
    MeshSpec(4),  # 3 experts over 4 ranks: auto shards rows
    MeshSpec(4, expert_shard="experts"),  # a rank without experts
    MeshSpec(4, ep=2),
    MeshSpec(4, ep=2, expert_shard="experts"),
    MeshSpec(2, replicate=2),
]


def test_presets_match_published_sizes_and_group_like_the_optimizer():
    sizes = {"qwen3-8b": 8.19, "qwen3-30b-a3b": 30.53, "deepseek-v3": 671.03}
    for name, billions in sizes.items():
        assert sum(p.numel for p in from_preset(name)) / 1e9 == pytest.approx(billions, abs=0.01)
    shapes = from_preset("qwen3-30b-a3b")
    module = meta_module(shapes)
    assert from_module(module) == shapes
    muon, adamw = muon_param_groups(module)  # no fused params: one Muon and one AdamW group
    names = {id(p): n for n, p in module.named_parameters()}
    adamw_names = {names[id(p)] for p in adamw["params"]}
    assert "model.layers.0.mlp.gate.weight" in adamw_names  # the router
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= adamw_names
    assert all(p.ndim == 1 for n, p in module.named_parameters() if "norm" in n)
    stacks = [p for p in muon["params"] if p.ndim == 3]
    assert len(stacks) == 3 * 48 and tuple(stacks[0].shape) == (128, 768, 2048)
    deepseek = {p.name: p.shape for p in from_preset("deepseek-v3")}
    assert deepseek["model.layers.0.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert deepseek["model.layers.0.mlp.down_proj.weight"] == (7168, 18432)
    assert deepseek["model.layers.3.mlp.experts.up_proj"] == (256, 2048, 7168)
    assert "model.layers.2.mlp.experts.up_proj" not in deepseek
    with pytest.raises(ValueError, match="missing keys"):
        from_config({"hidden_size": 8})


@pytest.mark.parametrize("config", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_rank_equals_its_exchange_plans(config, mesh):
    """Closed-form per-rank totals == the real ExchangePlans; seen_from == build."""
    settings = StepSettings(bucket_cap_bytes=CAP, max_inflight=2)
    plan = build_plan(from_config(config), mesh, settings)
    for rank, (mine, loads) in enumerate(zip(plan.plans, plan.loads, strict=True)):
        rebuilt = MuonPlan.build(mine.layouts, CAP)
        assert rebuilt.buckets == mine.buckets and rebuilt.matrices == mine.matrices
        largest = [0, 0, 0]
        for b, load in enumerate(loads):
            ex = plan.exchange(rank, b)
            assert (load.matrices, load.owned) == (len(ex.matrices), ex.owned), (rank, b)
            assert (load.send_numel, load.recv_numel, load.full_numel) == (
                ex.send_numel,
                ex.recv_numel,
                ex.full_numel,
            )
            assert (load.bytes_sent, load.workspace_bytes, load.ns_numel) == (
                ex.bytes_sent,
                ex.workspace_bytes,
                ex.ns_numel,
            )
            largest = [max(a, b) for a, b in zip(largest, mine.buffer_numels([b]), strict=True)]
        assert plan.ranks[rank].buffer_bytes == 2 * 2 * sum(largest)
    flops = [r.ns_flops for r in plan.ranks]
    assert plan.imbalance == pytest.approx(max(flops) * len(flops) / sum(flops))
    for row in bucket_rows(plan):
        assert row["busy"]["workspace_bytes"] >= row["idle"]["workspace_bytes"]


def test_padded_alternative_pads_matrices_and_rows_to_the_ranks():
    # 3 experts of 6 x 16 and 3 of 16 x 6, rows sharded over 4 ranks: one bucket
    layouts = [
        ParamLayout(shape, (), (4,), (1,), (0,), mesh_key="m") for shape in ((3, 6, 16), (3, 16, 6))
    ]
    padded = padded_alternative(MuonPlan.build(layouts), 0)
    # per shape 3 matrices pad to 4, rows to 8 (6 x 16) and 16 (16 x 6): 896 elements
    assert padded.padded_bytes == 896 * 2 // 4
    assert padded.padding_bytes == (896 - 2 * 288) * 2 // 4
    assert padded.wire_bytes == 2 * 3 * (2 * 16 + 4 * 6) * 2  # one shard per rank, out and back
    assert padded_alternative(MuonPlan.build([ParamLayout((3, 6, 16))]), 0) is None


def test_cli_json_sweep_config_and_speed(tmp_path, capsys):
    start = time.perf_counter()
    assert main(["--preset", "qwen3-30b-a3b", "--fsdp", "64", "--ep", "8", "--json"]) == 0
    elapsed = time.perf_counter() - start
    out = json.loads(capsys.readouterr().out)
    assert elapsed < 5.0
    assert out["summary"]["world"] == 64 and out["summary"]["buckets"] == len(out["buckets"])
    metric_fields = {"matrices", "owned", "bytes_sent", "bytes_received", "workspace_bytes"}
    for row in out["buckets"]:
        assert metric_fields <= set(row["busy"]) and metric_fields <= set(row["idle"])
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_DENSE))
    assert main(["--config", str(config), "--sweep-fsdp", "1,2,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["fsdp"] for r in rows] == [1, 2, 4] and sum(r["best"] for r in rows) == 1
    assert main(["--config", str(config), "--fsdp", "3", "--offload"]) == 0
    assert "with offload: state on host" in capsys.readouterr().out
    assert main(["--preset", "qwen3-8b", "--fsdp", "6", "--ep", "4"]) == 2


# -- the optimizer builds the same plan (gloo, world sizes 1..4) -----------------------------------


def _dtensors(module, plan, device_meshes, rank):
    """Replace every param by a DTensor laid out as `plan`'s mesh says (Muon params and AdamW)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = plan.mesh
    muon_names = set(plan.names)
    gen = torch.Generator().manual_seed(0)
    for name, p in list(module.named_parameters()):
        full = torch.randn(p.shape, generator=gen)
        if name in muon_names:
            layout = mesh.layout(tuple(p.shape), (), 0, rank % mesh.fsdp)
            device_mesh = device_meshes[layout.mesh_key]
            dims = layout.shard_dims
        else:
            device_mesh = device_meshes["dense"]
            dims = (None,) * (device_mesh.ndim - 1) + (0,)
        placements = [Replicate() if d is None else Shard(d) for d in dims]
        shape, offset = compute_local_shape_and_global_offset(full.shape, device_mesh, placements)
        local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))].clone()
        param = torch.nn.Parameter(
            DTensor.from_local(
                local,
                device_mesh,
                placements,
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
        )
        grad = torch.randn(local.shape, generator=gen)
        param.grad = DTensor.from_local(
            grad, device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
        *path, leaf = name.split(".")
        owner = module.get_submodule(".".join(path))
        setattr(owner, leaf, param)


def _check_world(world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    meshes = [m for m in MESHES if m.world == world]
    cache: dict[tuple[int, ...], object] = {}
    for spec in meshes:
        module = meta_module(from_config(TINY_MOE)).to_empty(device="cpu")
        # fp32 Newton-Schulz: CPU bf16 matmuls allocate packing buffers of their own
        settings = StepSettings(
            bucket_cap_bytes=CAP, max_inflight=2, ns_itemsize=4, fused_elementwise=False
        )
        plan = build_plan(from_module(module), spec, settings)
        dense_shape = (spec.fsdp,) if spec.replicate == 1 else (spec.replicate, spec.fsdp)
        inner = (spec.ep, spec.fsdp // spec.ep)
        expert_shape = inner if spec.replicate == 1 else (spec.replicate, *inner)
        device_meshes = {
            key: cache.setdefault(shape, init_device_mesh("cpu", shape))
            for key, shape in (("dense", dense_shape), ("experts", expert_shape))
        }
        _dtensors(module, plan, device_meshes, rank)
        opt = Muon(
            muon_param_groups(module),
            lr=0.02,
            bucket_cap_bytes=CAP,
            max_inflight=2,
            ns_dtype=torch.float32,
        )
        opt.step()
        mine, theirs = plan.plans[rank % spec.fsdp], opt._muon_plan()
        where = f"{spec} rank {rank}"
        fields = [(b.index, b.params, b.axis, b.nbytes) for b in theirs.buckets]
        assert fields == [(b.index, b.params, b.axis, b.nbytes) for b in mine.buckets], where
        assert mine.matrices == theirs.matrices, where  # owners included
        for b, bucket in enumerate(theirs.buckets):
            ours = mine.exchange(b, frozenset(bucket.params))  # from a cold cache: recomputed
            real = theirs.exchange(b, frozenset(bucket.params))
            assert (ours.send_splits, ours.recv_splits) == (real.send_splits, real.recv_splits)
        loads = plan.loads[rank % spec.fsdp]
        for metric in opt.metrics:
            load = loads[metric.bucket]
            assert (
                metric.matrices,
                metric.owned,
                metric.bytes_sent,
                metric.bytes_received,
                metric.workspace_bytes,
            ) == (
                load.matrices,
                load.owned,
                load.bytes_sent,
                load.bytes_received,
                load.workspace_bytes,
            ), (where, metric)
        assert opt._buffers.nbytes == plan.ranks[rank % spec.fsdp].buffer_bytes, where
        _check_measured_transient(opt, plan.ranks[rank % spec.fsdp], where)


def _check_measured_transient(opt, estimate, where: str) -> None:
    """CPU allocations of the Muon buckets of a second step (profiler) <= the estimate."""
    from torch.profiler import ProfilerActivity, profile

    subset = opt.begin_subset_step()
    buckets = subset.units[: len(opt._muon_plan().buckets)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        subset.step_params([p for unit in buckets for p in unit])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    measured = max(totals, default=0)
    assert estimate.muon_transient_bytes <= measured, (where, measured, estimate)
    assert measured <= 1.02 * estimate.muon_transient_bytes + 256, (where, measured, estimate)


def _worker(rank: int, world: int) -> None:
    _check_world(world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_optimizer_builds_the_planned_plan(world):
    run_on_ranks(_worker, world)


# -- the estimate against the allocator on a GPU -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ns_backend", ["torch", "triton"])
def test_estimated_step_peak_within_10_percent_on_gpu(tmp_path, ns_backend):
    out = tmp_path / "plan_vs_measured.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", "plan_vs_measured.py")
    args = ["--layers", "2", "--ns-backend", ns_backend, "--out", str(out)]
    subprocess.run([sys.executable, script, *args], check=True, timeout=300)
    result = json.loads(out.read_text())
    for row in result["rows"]:
        assert 0.9 <= row["ratio"] <= 1.1, row
