"""A transformers `LlamaForCausalLM` as the benches and tests train it: a model nobody here wrote.

transformers is optional: `require_transformers()` raises a `SystemExit` saying how
to install it, so a bench run without it stops with one clear line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from bench.model import PRESETS as MODEL_PRESETS
from bench.model import ModelConfig


def _llama_shapes(config: ModelConfig) -> dict[str, Any]:
    """transformers' LlamaConfig fields for a `bench.model` shape (dense, no MoE)."""
    return dict(
        hidden_size=config.dim,
        num_hidden_layers=config.n_layers,
        intermediate_size=config.ffn_dim,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        vocab_size=config.vocab_size,
        seq_len=config.seq_len,
    )


# hf-llama-0.85b: the bench model's llama-0.85b shape (hidden 2048, 16 layers, MLP 5632,
# 16 query / 4 KV heads, vocab 32000) as a transformers model, untied head.
PRESETS: dict[str, dict[str, Any]] = {
    "hf-llama-0.85b": _llama_shapes(MODEL_PRESETS["llama-0.85b"]),
    # Seconds on 2 CPU cores: the smoke mode of bench/train_step.py and the CPU tests.
    "hf-llama-tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        seq_len=32,
    ),
}
WRAPS = ("per-layer", "torchtitan")


def require_transformers():
    try:
        import transformers
    except ImportError as err:
        raise SystemExit(
            "the hf-llama models need transformers: pip install transformers "
            f"(import failed: {err})"
        ) from err
    return transformers


def seq_len(preset: str) -> int:
    return PRESETS[preset]["seq_len"]


def build_hf_llama(
    preset: str,
    device: torch.device,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    tie_word_embeddings: bool = False,
) -> nn.Module:
    """`LlamaForCausalLM` with the preset's shapes, seeded, in fp32 on `device`, in train mode.

    attn_implementation: "sdpa", or "eager" where bitwise reproducibility matters
    (SDPA's kernels on CUDA differ run to run even in deterministic mode).
    tie_word_embeddings: the head shares the embedding's weight.
    """
    transformers = require_transformers()
    shapes = dict(PRESETS[preset])
    length = shapes.pop("seq_len")
    config = transformers.LlamaConfig(
        **shapes,
        max_position_embeddings=length,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def shard_hf_llama(
    model: nn.Module,
    mesh,
    *,
    wrap: str = "per-layer",
    mixed_precision: bool = True,
    activation_checkpointing: bool = True,
    cpu_offload_policy: bool = False,
) -> nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root.

    wrap="torchtitan" also shards the final norm and lm_head as one unit of their own
    (torchtitan's wrap), so the root's all-gather holds only the embedding.
    mixed_precision: bf16 params in compute, fp32 gradient reduction.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if wrap not in WRAPS:
        raise ValueError(f"wrap should be one of {list(WRAPS)} but is: {wrap!r}")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cpu_offload_policy:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if wrap == "torchtitan":
        fully_shard([model.model.norm, model.lm_head], **kwargs)
    fully_shard(model, **kwargs)
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder layer, through transformers' own switch
    (renamed to `activation_checkpointing_enable` in 5.2x; 5.17 has only the old name)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def causal_lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token loss of `tokens` (transformers shifts the labels)."""
    return model(input_ids=tokens, labels=tokens).loss
