"""bench.train_step helpers that need no GPU."""

from __future__ import annotations

import torch

from bench.train_step import _storage_bytes, device_state_tensors


class _NoStateOptimizer:
    """Like torchao's CPUOffloadOptimizer: no `state` attribute."""


def test_state_tensors_of_an_optimizer_without_state_is_empty():
    # torchao's arm crashed here after its timed window (H200), losing its measurement
    assert device_state_tensors(_NoStateOptimizer()) == []


def test_state_tensors_and_their_distinct_storage_bytes():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    tensors = device_state_tensors(opt)
    assert len(tensors) == 3  # step, exp_avg, exp_avg_sq
    shared = torch.zeros(8)
    assert _storage_bytes([shared[:4], shared[4:], torch.zeros(2)], torch.device("cpu")) == 40
