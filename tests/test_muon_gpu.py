"""Muon on a CUDA device: torch.optim.Muon parity, no host sync, offloaded == plain."""

from __future__ import annotations

import pytest
import torch

from muon import Muon

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
    # cuBLAS may pick other kernels for a batch than for one matrix: close, not bitwise
    ours, theirs = _params(), _params()
    opt, ref = Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
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
    offload = pytest.importorskip("offload")
    results = []
    for wrap in (False, True):
        params = _params()
        groups = [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]
        opt = Muon(groups, lr=0.02, bucket_cap_bytes=300_000)
        if wrap:
            opt = offload.CPUOffloadOptimizer(opt, chunk_bytes=chunk_bytes)
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
