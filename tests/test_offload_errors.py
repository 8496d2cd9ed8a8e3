"""CPUOffloadOptimizer refuses what it cannot do right, at the earliest point, naming
the param, key or argument and the fix; where the plain optimizer works, so does it."""

from __future__ import annotations

import pytest
import torch

from offload import CPUOffloadOptimizer


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def _backward(model: torch.nn.Module) -> None:
    model(torch.ones(2, 8)).square().sum().backward()


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after_a_step"])
def test_load_state_dict_with_a_missing_state_key_raises(stepped):
    source = _linear()
    plain = torch.optim.AdamW(source.parameters(), lr=1e-2)
    _backward(source)
    plain.step()
    saved = plain.state_dict()
    del saved["state"][1]["exp_avg_sq"]
    fresh_model = _linear()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    _backward(fresh_model)
    with pytest.raises(KeyError, match="exp_avg_sq"):  # plain AdamW, at its next step
        fresh.step()

    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if stepped:
        _backward(model)
        opt.step()
    with pytest.raises(KeyError, match=r"param 1 .*'exp_avg_sq'"):
        opt.load_state_dict(saved)
