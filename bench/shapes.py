"""Model shapes the benchmarks share, and parameters built from them."""

from __future__ import annotations

import torch

# Qwen3-8B decoder layer matrices: hidden 4096, 32 query / 8 KV heads of 128, MLP 12288.
QWEN3_8B_LAYER = [
    (4096, 4096),  # q_proj
    (1024, 4096),  # k_proj
    (1024, 4096),  # v_proj
    (4096, 4096),  # o_proj
    (12288, 4096),  # gate_proj
    (12288, 4096),  # up_proj
    (4096, 12288),  # down_proj
]

# A Llama decoder layer of hidden 2048: 16 query / 4 KV heads of 128, MLP 5632 (the 0.85B model's).
LLAMA_2048_LAYER = [
    (2048, 2048),  # q_proj
    (512, 2048),  # k_proj
    (512, 2048),  # v_proj
    (2048, 2048),  # o_proj
    (5632, 2048),  # gate_proj
    (5632, 2048),  # up_proj
    (2048, 5632),  # down_proj
]


def params_with_grads(shapes, device: torch.device) -> list[torch.nn.Parameter]:
    """Seeded params (std 0.02) with random grads, one per shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen)
        params.append(p)
    return params
