"""Muon on a CUDA device: torch.optim.Muon parity, no host sync, offloaded == plain, and the
same bits whatever the bucket cap or offload chunking (batch invariance)."""

from __future__ import annotations

import pytest
import torch

from muon import Muon
from offload import CPUOffloadOptimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SHAPES = [(256, 512), (512, 256), (96, 1024), (256, 512), (7, 300)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in SHAPES]


def _grads(params, step: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)


def test_matches_torch_muon():
    # cuBLAS may pick other kernels for a batch than for one matrix: close, not bitwise.
    # The standard iteration: "auto" takes Gram (fp16) for some shapes, another rounding.
    ours, theirs = _params(), _params()
    opt, ref = Muon(ours, lr=0.02, ns_algorithm="standard"), torch.optim.Muon(theirs, lr=0.02)
    for step in range(3):
        _grads(ours, step)
        _grads(theirs, step)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q)


def test_step_does_not_sync_the_host():
    params = _params()
    groups = [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]
    opt = Muon(groups, lr=0.02, bucket_cap_bytes=300_000)
    _grads(params, 0)
    opt.step()  # creates state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("chunk_bytes", [2**40, 300_000, 1])
def test_offloaded_muon_is_bitwise_equal(chunk_bytes):
    results = []
    for wrap in (False, True):
        params = _params()
        groups = [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]
        opt = Muon(groups, lr=0.02, bucket_cap_bytes=300_000)
        if wrap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=chunk_bytes)
        for step in range(3):
            _grads(params, step)
            opt.step()
        torch.cuda.synchronize()
        results.append((params, opt.state_dict()["state"]))
    (plain, plain_state), (offloaded, offloaded_state) = results
    for p, q in zip(plain, offloaded, strict=True):
        assert torch.equal(p, q)
    for index, entries in plain_state.items():
        for key, value in entries.items():
            assert torch.equal(offloaded_state[index][key].to(value.device), value), (index, key)


HIDDEN, KV, FFN, LAYERS = 2048, 512, 5632, 16
MIB = 2**20


def _hidden_2048_groups() -> tuple[list[torch.nn.Parameter], list[dict]]:
    """16 Llama-style layers of hidden 2048 (fused qkv and gate_up), expert stacks, odd shapes."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def param(*shape):
        return torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02)

    qkv, gate_up, plain = [], [], []
    for _ in range(LAYERS):
        qkv.append(param(HIDDEN + 2 * KV, HIDDEN))
        plain.append(param(HIDDEN, HIDDEN))
        gate_up.append(param(2 * FFN, HIDDEN))
        plain.append(param(HIDDEN, FFN))
    plain += [param(8, 768, HIDDEN), param(8, HIDDEN, 768), param(2, HIDDEN), param(7, 300)]
    plain += [param(2049, 1000), param(3, 5, 4096)]
    groups = [
        {"params": plain},
        {"params": qkv, "row_blocks": (HIDDEN, KV, KV)},
        {"params": gate_up, "row_blocks": (FFN, FFN)},
    ]
    return qkv + gate_up + plain, groups


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_update_does_not_depend_on_bucket_cap_or_offload_chunks(ns_dtype):
    runs = [(512 * MIB, None), (128 * MIB, None), (32 * MIB, None)]
    runs += [(512 * MIB, 256 * MIB), (512 * MIB, 64 * MIB)]
    results = []
    for cap, chunk_bytes in runs:
        params, groups = _hidden_2048_groups()
        opt = Muon(groups, lr=0.02, bucket_cap_bytes=cap, ns_dtype=ns_dtype)
        if chunk_bytes is not None:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=chunk_bytes)
        for step in range(3):
            gen = torch.Generator(device="cuda").manual_seed(1000 + step)
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        results.append([p.detach().cpu() for p in params])
        del params, groups, opt
        torch.cuda.empty_cache()
    for (cap, chunk_bytes), other in zip(runs[1:], results[1:], strict=True):
        differ = [
            tuple(p.shape) for p, q in zip(results[0], other, strict=True) if not torch.equal(p, q)
        ]
        assert not differ, f"cap {cap // MIB} MiB, chunk {chunk_bytes}: {len(differ)} differ"


@pytest.mark.parametrize("shape", [(768, 2048), (2048, 768), (1024, 1024)])
def test_an_expert_stack_split_among_ranks_updates_each_expert_as_whole(shape):
    # Under expert parallelism each rank holds some of a stack's experts and batches only
    # those: an expert's update must not depend on how many others launch with it (the
    # claim was tested on CPU only; found by an EP audit)
    experts = 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    stack = torch.randn(experts, *shape, device="cuda", generator=gen) * 0.02
    grads = [torch.randn(experts, *shape, device="cuda", generator=gen) for _ in range(2)]

    def run(pieces: int, cap: int) -> torch.Tensor:
        params = [torch.nn.Parameter(x.clone()) for x in stack.split(experts // pieces)]
        opt = Muon(params, lr=0.02, bucket_cap_bytes=cap)
        for grad in grads:
            for p, g in zip(params, grad.split(experts // pieces), strict=True):
                p.grad = g.clone()
            opt.step()
        return torch.cat([p.detach() for p in params])

    whole = run(1, 2**40)
    for pieces in (2, 8):
        assert torch.equal(run(pieces, 1), whole), pieces


def test_nothing_but_params_and_state_is_kept_between_steps():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    params, groups = _hidden_2048_groups()
    opt = Muon(groups, lr=0.02)
    for step in range(2):
        gen = torch.Generator(device="cuda").manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    kept = torch.cuda.memory_allocated() - base - weights - state
    assert kept <= 64 * MIB, f"{kept / MIB:.1f} MiB kept beyond params and state"
