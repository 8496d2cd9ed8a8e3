"""Model shapes the benchmarks share."""

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
