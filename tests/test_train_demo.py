"""The training demo's model, data and step: shapes, fused row blocks, and on 2 gloo
ranks, offloaded training (with and without forward overlap) == plain training bitwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spawn_ranks import run_on_ranks

from bench.data import MarkovData
from bench.model import ModelConfig, Transformer
from bench.train import build, train_step
from muon_offload import OptimizerConfig

# Small enough for seconds on 2 cores; head dim 8, GQA, and a seq the chain can fill.
DENSE = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, seq_len=16
)
MOE = dataclasses.replace(DENSE, moe_experts=4, moe_top_k=2)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_forward_shapes_and_row_blocks(config):
    model = Transformer(config)
    tokens = torch.randint(config.vocab_size, (3, config.seq_len))
    assert model(tokens).shape == (3, config.seq_len, config.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    fused = {
        f"{name}.{param}": rows
        for name, module in model.named_modules()
        for param, rows in getattr(module, "row_blocks", {}).items()
    }
    # qkv and gate_up (or the expert stack) in every layer
    assert len(fused) == 2 * config.n_layers
    params = dict(model.named_parameters())
    for name, rows in fused.items():
        assert sum(rows) == params[name].shape[-2], name
    qkv = fused["layers.0.attention.qkv.weight"]
    assert qkv == [config.dim, config.dim // 2, config.dim // 2]  # 4 heads, 2 KV heads


def test_causal():
    """A token's logits do not depend on later tokens."""
    model = Transformer(DENSE)
    tokens = torch.randint(DENSE.vocab_size, (1, DENSE.seq_len))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % DENSE.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :-1], b[0, :-1])
    assert not torch.equal(a[0, -1], b[0, -1])


def test_markov_data_is_learnable_and_sharded():
    a0, a0_again, a1 = (MarkovData(64, 16, 4, rank=r) for r in (0, 0, 1))
    inputs, targets = a0.next_batch()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs, a0_again.next_batch()[0])  # deterministic per rank
    assert not torch.equal(inputs, a1.next_batch()[0])  # another shard on another rank
    # every transition is one of the token's few successors: the chain is learnable
    assert (a0.successors[inputs] == targets.unsqueeze(-1)).any(-1).all()
    assert (a0.successors.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct successors


STEPS = 3
ARMS = {
    "none": {"offload": "none"},
    "offload": {"offload": "optimizer"},
    "offload+overlap": {"offload": "optimizer", "offload_overlap_forward": True},
}


def _train(config: ModelConfig, opt: str, arm: dict, mesh, rank: int):
    """Train STEPS steps; returns (losses, local param shards, initial local shards)."""
    # Tiny chunks so even this model's state is streamed through several chunks.
    opt_config = OptimizerConfig(type=opt, lr=1e-2, offload_chunk_bytes=4096, **arm)
    model, optimizer = build(config, opt_config, mesh, torch.device("cpu"))
    initial = [p.to_local().clone() for p in model.parameters()]
    data = MarkovData(config.vocab_size, config.seq_len, 4, rank=rank)
    losses = []
    for _ in range(STEPS):
        loss, _ = train_step(model, optimizer, *data.next_batch(), sync=lambda: None)
        losses.append(loss)
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    return losses, [p.to_local().clone() for p in model.parameters()], initial


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for config_name, config in {"dense": DENSE, "moe": MOE}.items():
        for opt in ("adamw", "muon"):
            ref_losses, ref_params, initial = _train(config, opt, ARMS["none"], mesh, rank)
            tag = f"{config_name}/{opt}"
            if all(torch.equal(a, b) for a, b in zip(ref_params, initial, strict=True)):
                failures.append(f"{tag}: training left every param unchanged")
            if not ref_losses[-1] < ref_losses[0]:
                failures.append(f"{tag}: loss did not fall: {ref_losses}")
            for arm_name in ("offload", "offload+overlap"):
                losses, params, _ = _train(config, opt, ARMS[arm_name], mesh, rank)
                for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
                    if not torch.equal(a, b):
                        failures.append(f"{tag}/{arm_name}: loss of step {step} differs")
                for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
                    if not torch.equal(a, b):
                        failures.append(f"{tag}/{arm_name}: param {i} differs")
    assert not failures, failures


def test_offloaded_training_matches_plain_bitwise():
    run_on_ranks(_worker, 2)
