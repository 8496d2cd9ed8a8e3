"""A small Llama-style decoder for the training demo and the train-step bench.

Pre-norm RMSNorm blocks, RoPE, causal GQA attention through
`F.scaled_dot_product_attention`, and a SwiGLU MLP or a top-k MoE. The q/k/v
and gate/up projections are fused into one Linear each, and the modules
declare the logical matrices in `row_blocks` so Muon orthogonalizes q, k, v,
gate and up separately (as it would unfused) while FSDP2 shards one tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(kw_only=True)
class ModelConfig:
    """Decoder shape. `preset(name)` gives the named sizes; fields override them."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 172
    vocab_size: int = 256
    seq_len: int = 64
    moe_experts: int = 0
    """0: a dense SwiGLU MLP per block; E > 0: an MoE of E experts of width `ffn_dim`."""
    moe_top_k: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head dim")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k should be in [1, {self.moe_experts}]: {self.moe_top_k}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: int | float) -> ModelConfig:
        """The named preset with `overrides` (fields set to None are left at the preset)."""
        if name not in PRESETS:
            raise ValueError(f"model preset should be one of {sorted(PRESETS)} but is: {name!r}")
        values = dataclasses.asdict(PRESETS[name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def num_params(self) -> int:
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv) + self.dim * self.dim
        if self.moe_experts:
            mlp = self.dim * self.moe_experts + self.moe_experts * 3 * self.ffn_dim * self.dim
        else:
            mlp = 3 * self.ffn_dim * self.dim
        block = attn + mlp + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    # Llama-style ~0.85B: the size at which optimizer state (AdamW: 8 bytes/param)
    # is a large share of one GPU's memory in the train-step bench.
    "llama-0.85b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=5632,
        vocab_size=32000,
        seq_len=2048,
    ),
}


def rope_tables(config: ModelConfig, device: torch.device | None = None) -> Tensor:
    """(seq_len, head_dim // 2, 2) fp32 cos and sin of RoPE's rotation angles."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate (batch, heads, seq, head_dim) `x` by pairs of halves; fp32 math, `x`'s dtype out."""
    seq = x.shape[-2]
    cos, sin = rope[:seq, :, 0], rope[:seq, :, 1]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        q_rows = config.n_heads * config.head_dim
        kv_rows = config.n_kv_heads * config.head_dim
        self.qkv = nn.Linear(config.dim, q_rows + 2 * kv_rows, bias=False)
        self.wo = nn.Linear(q_rows, config.dim, bias=False)
        self.row_blocks = {"qkv.weight": [q_rows, kv_rows, kv_rows]}

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(self.row_blocks["qkv.weight"], dim=-1)
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one Linear (rows: gate | up)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.row_blocks = {"gate_up.weight": [config.ffn_dim, config.ffn_dim]}

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, stacked as 3-D params (expert, out, in).

    Every expert runs on every token and the outputs are mixed by the routing
    weights (zero for unselected experts): E times the FLOPs of a sparse
    dispatch, but exact, deterministic and free of host syncs, which is what
    the demo and the bitwise tests need.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, ffn = config.moe_experts, config.ffn_dim
        self.top_k = config.moe_top_k
        self.router = nn.Linear(config.dim, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, config.dim))
        self.w_down = nn.Parameter(torch.empty(experts, config.dim, ffn))
        self.row_blocks = {"w_gate_up": [ffn, ffn]}

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mix = torch.zeros_like(probs).scatter(-1, chosen, weights).to(x.dtype)  # (tokens, E)
        gate, up = torch.einsum("td,efd->etf", tokens, self.w_gate_up).chunk(2, dim=-1)
        out = torch.einsum("etf,edf->etd", F.silu(gate) * up, self.w_down)
        return torch.einsum("etd,te->td", out, mix).reshape(shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = MoE(config) if config.moe_experts else MLP(config)
        # Set by `parallelize`: recompute this block's activations in backward.
        # Checkpointing inside forward (not checkpoint_wrapper) keeps param names,
        # which the optimizer's row_blocks patterns and checkpoints key on.
        self.activation_checkpointing = False

    def _forward(self, x: Tensor, rope: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Not persistent: derived from the config, and FSDP2 leaves buffers unsharded.
        self.register_buffer("rope", rope_tables(config), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices and embeddings, unit norms: initial loss ~ ln(vocab)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, MoE):
                nn.init.normal_(module.w_gate_up, std=std)
                nn.init.normal_(module.w_down, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        """(batch, seq) token ids -> (batch, seq, vocab) logits."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.lm_head(self.norm(x))


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parallelize(
    model: Transformer,
    mesh,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool,
    cpu_offload_policy: bool,
) -> Transformer:
    """FSDP2 `fully_shard` each block, then the root (embeddings, final norm, lm_head).

    mixed_precision: bf16 params in compute, fp32 gradient reduction.
    cpu_offload_policy: torch's own `CPUOffloadPolicy` (sharded params, grads and
    so the optimizer step on the host), the alternative the bench compares against.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cpu_offload_policy:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        layer.activation_checkpointing = activation_checkpointing
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
