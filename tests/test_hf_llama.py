"""A transformers LlamaForCausalLM (a model this project did not write) under FSDP2:
offloaded training with forward overlap (and a GPU-resident state budget where the
config has one) gives the same losses and params, bit for bit, as no offload.

The same body runs on 2 gloo ranks on the CPU and on one GPU in deterministic mode
(`torch.use_deterministic_algorithms`, eager attention, CUBLAS_WORKSPACE_CONFIG: two
no-offload runs with SDPA already differ bitwise on CUDA).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_ranks import run_on_ranks

from bench import hf_llama
from muon_offload import OptimizerConfig, setup_optimizer

pytest.importorskip("transformers")

PRESET = "hf-llama-tiny"
STEPS = 3
CHUNK_BYTES = 16 * 2**10  # many chunks even for the tiny model's state
RESIDENT_FIELD = "offload_gpu_resident_bytes"


def offload_configs(base: OptimizerConfig) -> dict[str, OptimizerConfig]:
    """No offload, and offload + forward overlap (+ a resident budget and loads in the
    backward when supported)."""
    offloaded = dataclasses.replace(
        base, offload="optimizer", offload_overlap_forward=True, offload_chunk_bytes=CHUNK_BYTES
    )
    configs = {"none": base, "offload+overlap": offloaded}
    if RESIDENT_FIELD in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        configs["offload+overlap+resident+bwd"] = dataclasses.replace(
            offloaded, offload_load_in_backward=True, **{RESIDENT_FIELD: 3 * CHUNK_BYTES}
        )
    return configs


def train(
    config: OptimizerConfig,
    device: torch.device,
    wrap: str,
    *,
    tie_word_embeddings: bool = False,
    steps: int = STEPS,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`steps` steps of the tiny HF Llama, FSDP2 over the default group; the (local)
    losses and the full params after the last step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = hf_llama.build_hf_llama(
        PRESET,
        device,
        seed=0,
        attn_implementation="eager",
        tie_word_embeddings=tie_word_embeddings,
    )
    hf_llama.shard_hf_llama(model, mesh, wrap=wrap)
    optimizer = setup_optimizer(model, config)
    vocab, seq = model.config.vocab_size, hf_llama.seq_len(PRESET)
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    # One batch per rank, seen every step: the loss must fall, so the steps did something.
    tokens = torch.randint(vocab, (2, seq), device=device, generator=gen)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = hf_llama.causal_lm_loss(model, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.detach().clone())
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    if getattr(config, "offload_load_in_backward", False):  # the hook found the backward
        assert optimizer.chunks_loaded_in_backward > 0
    elif config.offload_overlap_forward and config.offload_gpu_resident_bytes != "auto":
        # By default the backward loaded what the forward first waits for: the root unit's
        # params (with torchtitan's wrap, norm and head are a unit of their own).
        own = {"lm_head.weight", "model.norm.weight"} if wrap == "torchtitan" else set()
        root = [
            p
            for name, p in model.named_parameters()
            if not name.startswith("model.layers.") and name not in own
        ]
        chunks = optimizer._executor.chunks
        last = max(
            c for c, chunk in enumerate(chunks) if any(p is q for p in root for q in chunk.touched)
        )
        staged = [chunk.slot >= 0 for chunk in chunks]
        expected = max(min(optimizer.staging_slots, sum(staged)), sum(staged[: last + 1]))
        loaded = optimizer.chunks_loaded_in_backward
        assert loaded == optimizer.schedule.backward_loads
        # on CUDA also what fits under the allocator's peak (BACKWARD_ROOM_SHARE)
        assert loaded == expected if device.type == "cpu" else loaded >= expected
    params = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    getattr(optimizer, "close", lambda: None)()
    return losses, params


def assert_all_bitwise_equal(
    device: torch.device, cases: list[tuple[str, str]], tied: bool = False
) -> None:
    """For each (optimizer, wrap): every offload config against no offload. `tied`: the
    head shares the embedding's weight, and the offloaded arm chooses its resident
    state ("auto", which re-plans within the run)."""
    from offload.residency import AUTO_MEASURED_STEPS, AUTO_WARMUP_STEPS

    for opt, wrap in cases:
        configs = offload_configs(OptimizerConfig(type=opt, lr=1e-2))
        steps = STEPS
        if tied:
            auto = dataclasses.replace(
                configs["offload+overlap"], offload_gpu_resident_bytes="auto"
            )
            configs = {"none": configs["none"], "offload+overlap+auto": auto}
            steps = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS + 2
        runs = {
            name: train(config, device, wrap, tie_word_embeddings=tied, steps=steps)
            for name, config in configs.items()
        }
        ref_losses, ref_params = runs.pop("none")
        assert ref_losses[-1] < ref_losses[0], f"{opt}: the model should learn something"
        for name, (losses, params) in runs.items():
            for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                assert torch.equal(a, b), f"{opt}/{wrap}/{name}: loss of step {step} {a} != {b}"
            for key, ref in ref_params.items():
                assert torch.equal(params[key], ref), f"{opt}/{wrap}/{name}: param {key} differs"


def _cpu_body(rank: int, world: int) -> None:
    # One wrap per optimizer keeps CI short; the GPU test runs all four pairs.
    assert_all_bitwise_equal(torch.device("cpu"), [("adamw", "per-layer"), ("muon", "torchtitan")])


def test_hf_llama_offload_overlap_is_bitwise_equal_on_gloo():
    """Per-layer wrap and torchtitan's (norm + lm_head as their own unit), in one spawn:
    the ranks' start-up (importing transformers) is much of the test's time."""
    run_on_ranks(_cpu_body, 2)


def _gpu_body(rank: int, init_file: str) -> None:
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        cases = [(opt, wrap) for opt in ("adamw", "muon") for wrap in hf_llama.WRAPS]
        assert_all_bitwise_equal(device, cases)
        assert_all_bitwise_equal(device, [("adamw", "per-layer"), ("muon", "per-layer")], tied=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_llama_offload_overlap_is_bitwise_equal_on_gpu_deterministic(monkeypatch):
    # Read by cuBLAS when the child process creates its handle; the child also turns on
    # deterministic algorithms, so neither leaks into other tests.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_body, args=(os.path.join(tmp, "init"),), nprocs=1, join=True)
