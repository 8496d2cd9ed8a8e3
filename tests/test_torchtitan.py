"""The torchtitan adapter (`muon_offload.torchtitan`), on 2 gloo ranks, as far as torchtitan
runs on the CPU: its optimizers container built from a job config's `optimizer` field
over an FSDP2 model, AdamW and Muon, offload + forward overlap bitwise equal to no
offload, and torchtitan's FQN-keyed optimizer state round-tripping into a fresh
container so the next step is bitwise equal; and what `bench.torchtitan_debug` gives
torchtitan's debug job in place of a source checkout's assets (tokenizer files,
seeded synthetic batches). Skipped without torchtitan (its trainer needs CUDA, so the
debug-model run itself is `bench.torchtitan_debug` on a GPU, see the README).
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import run_on_ranks

pytest.importorskip("torchtitan.components.optimizer")

from bench.model import ModelConfig, Transformer, loss_fn, parallelize  # noqa: E402
from muon_offload import OptimizerConfig  # noqa: E402

MODEL = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, seq_len=16
)
STEPS = 3


def build(opt_config: OptimizerConfig):
    from torch.distributed.device_mesh import init_device_mesh

    from muon_offload.torchtitan import MuonOffloadOptimizers

    torch.manual_seed(0)
    model = Transformer(MODEL)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize(
        model, mesh, mixed_precision=False, activation_checkpointing=False, cpu_offload_policy=False
    )
    container = MuonOffloadOptimizers.Config(optimizer=opt_config).build(model_parts=[model])
    return model, container


def steps(model, container, count: int, first: int = 0) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=gen)
        container.zero_grad()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        container.step()
        losses.append(loss.detach())
    container.wait_for_optimizer_step()
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def _body(rank: int, world: int) -> None:
    for opt in ("adamw", "muon"):
        plain = OptimizerConfig(type=opt, lr=1e-2)
        offloaded = dataclasses.replace(
            plain, offload="optimizer", offload_overlap_forward=True, offload_chunk_bytes=4096
        )
        ref_model, ref = build(plain)
        ref_losses = steps(ref_model, ref, STEPS)
        model, container = build(offloaded)
        losses = steps(model, container, STEPS - 1)
        assert type(container.optimizers[0]).__name__ == "CPUOffloadOptimizer"
        # torchtitan's checkpoint view of the state: flat, FQN-keyed; into a fresh container.
        flat = container.state_dict()
        assert any(key.startswith("state.") for key in flat), sorted(flat)[:5]
        resumed_model, resumed = build(offloaded)
        with torch.no_grad():
            for p, q in zip(resumed_model.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        with warnings.catch_warnings():
            # torchtitan loads on every rank: no warning of a rank-local read (its
            # state-creating step was left pending, then read)
            warnings.filterwarnings("error", message="a read of a param or optimizer state")
            resumed.load_state_dict(flat)
        losses += steps(resumed_model, resumed, 1, first=STEPS - 1)
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert torch.equal(a, b), f"{opt}: loss of step {step}: {a} != {b}"
        ref_params = full_params(ref_model)
        for name, p in full_params(resumed_model).items():
            assert torch.equal(p, ref_params[name]), f"{opt}: {name} differs"
        for c in (ref, container, resumed):
            c.close()


def test_torchtitan_container_offload_overlap_and_state_round_trip_are_bitwise():
    run_on_ranks(_body, 2)


@pytest.mark.parametrize(
    "field",
    [
        {"param_groups": [object()]},
        {"implementation": "fused_opt_states_bf16"},  # was silently unused, as the next
        {"optimizer_factory_kwargs_by_name": {"AdamW": {"lr": 5.0}}},
    ],
    ids=lambda field: next(iter(field)),
)
def test_torchtitans_own_optimizer_fields_in_the_job_config_are_refused(field):
    from muon_offload.torchtitan import MuonOffloadOptimizers

    config = MuonOffloadOptimizers.Config(**field)
    with pytest.raises(ValueError, match=f"Config.{next(iter(field))} is set"):
        config.build(model_parts=[torch.nn.Linear(2, 2)])


def test_debug_job_reads_our_tokenizer_files_and_seeded_synthetic_batches(tmp_path):
    pytest.importorskip("triton", reason="torchtitan 0.3.0's trainer imports triton kernels")
    from bench.torchtitan_debug import job_config
    from muon_offload.torchtitan import MuonOffloadOptimizers

    args = argparse.Namespace(optimizer="muon", offload="optimizer", overlap=True, steps=2)
    config = job_config(args, str(tmp_path))
    assert isinstance(config.optimizer, MuonOffloadOptimizers.Config)
    assert config.optimizer.optimizer.offload_overlap_forward
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    vocab_size = config.model_spec.model.vocab_size
    assert tokenizer.get_vocab_size() == vocab_size

    def first_batch(dp_rank: int):
        loader = config.dataloader.build(
            dp_world_size=2, dp_rank=dp_rank, tokenizer=tokenizer, seq_len=16, local_batch_size=2
        )
        return next(iter(loader))

    (inputs, labels), (again, _), (other_rank, _) = first_batch(0), first_batch(0), first_batch(1)
    tokens = inputs["input"]
    assert tokens.shape == labels.shape == (2, 16)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # next-token labels, one document a row
    assert (tokens[:, 0] == tokenizer.bos_id).all() and (labels[:, -1] == tokenizer.eos_id).all()
    assert torch.equal(inputs["positions"], torch.arange(16).expand(2, 16))
    assert int(tokens.max()) < vocab_size
    assert torch.equal(tokens, again["input"]) and not torch.equal(tokens, other_rank["input"])
