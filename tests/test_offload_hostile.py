"""What a hostile user does to CPUOffloadOptimizer (issue 25): each case is exact, bit
for bit against the plain optimizer, or refused with an error that names the param,
key or argument and the way out."""

from __future__ import annotations

import pytest
import torch

from offload import CPUOffloadOptimizer

LAYOUTS = {
    "transposed": lambda: torch.randn(8, 6).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "permuted_3d": lambda: torch.randn(3, 4, 5).permute(2, 0, 1),
    "strided_slice": lambda: torch.randn(6, 10)[:, ::2],  # not dense: state is contiguous
}


def _param_like(make, seed: int, device: str = "cpu") -> torch.nn.Parameter:
    torch.manual_seed(seed)
    return torch.nn.Parameter(make().to(device))


def _grad_like(param: torch.Tensor, step: int) -> torch.Tensor:
    gen = torch.Generator(device=param.device).manual_seed(100 + step)
    grad = torch.empty_like(param, memory_format=torch.preserve_format)
    return grad.copy_(torch.randn(param.shape, generator=gen, device=param.device))


def _assert_same_adamw(plain, offloaded, a, b) -> None:
    assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(plain.state[a][key], offloaded.state[b][key]), key
        assert plain.state[a][key].stride() == offloaded.state[b][key].stride(), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", [{"fused": True}, {"foreach": True}, {"foreach": False}])
@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_bytes": 64}, {"gpu_resident_bytes": 2**30}],
    ids=["one_chunk", "sliced_neighbour", "resident"],
)
def test_adamw_on_any_param_layout_is_bitwise_equal(layout, implementation, options):
    # A contiguous neighbour that small chunks slice, next to the strided param.
    a, b = _param_like(LAYOUTS[layout], 0), _param_like(LAYOUTS[layout], 0)
    a_bias, b_bias = (
        _param_like(lambda: torch.randn(40), 1),
        _param_like(lambda: torch.randn(40), 1),
    )
    plain = torch.optim.AdamW([a, a_bias], lr=0.1, **implementation)
    offloaded = CPUOffloadOptimizer(
        torch.optim.AdamW([b, b_bias], lr=0.1, **implementation), **options
    )
    for step in range(3):
        a.grad, b.grad = _grad_like(a, step), _grad_like(b, step)
        a_bias.grad, b_bias.grad = _grad_like(a_bias, step), _grad_like(b_bias, step)
        plain.step()
        offloaded.step()
    _assert_same_adamw(plain, offloaded, a, b)
    _assert_same_adamw(plain, offloaded, a_bias, b_bias)
