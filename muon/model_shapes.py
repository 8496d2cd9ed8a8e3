"""Parameter names and shapes of decoder models, without building them.

Three sources give the same thing, a tuple of `ParamShape` in the order
`named_parameters()` would yield them: a Hugging Face style `config.json`
(dense and MoE decoders: Qwen3 / Qwen3-MoE / Llama-like attention, DeepSeek
MLA; another `model_type` is refused, `MODELED_TYPES`), a live `nn.Module`, or a
built-in preset. Names follow Hugging Face, so
`muon.muon_param_groups`' AdamW rules (embed, lm_head, norm, bias, a router
`gate` beside `experts`) classify them; routed experts are 3-D stacks (E, out, in) laid out
as transformers 5 builds them, `...mlp.experts.gate_up_proj` (gate and up fused, declared
in row blocks, as `setup_optimizer` reads a module's `row_blocks`) and `down_proj`.

`meta_module` turns shapes back into an `nn.Module` on the meta device, so the
planner groups params with `muon_param_groups` itself rather than a copy of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ParamShape:
    """One trainable param: its dotted name, global shape and, for a fused one, the rows
    of each logical matrix (declared on its module as `row_blocks`, as `setup_optimizer`
    reads them)."""

    name: str
    shape: tuple[int, ...]
    row_blocks: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Hugging Face config.json values of the presets (only the keys `from_config` reads).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "topk_method": "noaux_tc",
        "vocab_size": 129280,
        "tie_word_embeddings": False,
    },
}


def load_config(path: str | Path) -> dict[str, Any]:
    """A `config.json` as a dict; a multimodal config's `text_config` if it has one. A file
    that cannot be read or is not a JSON object raises ValueError naming it."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the model config {path}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(
            f"the model config {path} should be a JSON object but is a JSON list or value"
        )
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, dict):
        raise ValueError(
            f"the model config {path}'s text_config should be a JSON object but is: {text!r}"
        )
    return text


def from_preset(name: str) -> tuple[ParamShape, ...]:
    if name not in PRESETS:
        raise ValueError(f"preset should be one of {sorted(PRESETS)} but is: {name!r}")
    return from_config(PRESETS[name])


def from_module(module: nn.Module) -> tuple[ParamShape, ...]:
    """The trainable params of a live module (meta, CPU or GPU; not yet sharded), with the
    row blocks its modules declare."""
    declared = {
        f"{prefix}.{leaf}" if prefix else leaf: tuple(blocks)
        for prefix, child in module.named_modules()
        for leaf, blocks in (getattr(child, "row_blocks", None) or {}).items()
    }
    return tuple(
        ParamShape(name, tuple(p.shape), declared.get(name, ()))
        for name, p in module.named_parameters()
        if p.requires_grad
    )


def _num_experts(config: Mapping[str, Any]) -> int:
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if config.get(key):
            return int(config[key])
    return 0


# Counts and sizes `from_config` reads where a config has them.
_OPTIONAL_COUNTS = (
    "moe_intermediate_size", "num_experts", "n_routed_experts", "num_local_experts",
    "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq",
)  # fmt: skip


def _is_moe_layer(config: Mapping[str, Any], layer: int) -> bool:
    """Qwen-MoE (`decoder_sparse_step`, `mlp_only_layers`) and DeepSeek (`first_k_dense_replace`)
    rules for which decoder layers hold routed experts, as transformers builds them (its
    DeepSeek ignores `moe_layer_freq`, which DeepSeek's own code reads)."""
    return (
        _num_experts(config) > 0
        and layer not in (config.get("mlp_only_layers") or ())
        and (layer + 1) % (config.get("decoder_sparse_step") or 1) == 0
        and layer >= (config.get("first_k_dense_replace") or 0)
    )


def _attention(config: Mapping[str, Any], prefix: str) -> list[ParamShape]:
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    bias = bool(config.get("attention_bias", False))
    out: list[ParamShape] = []

    def linear(name: str, rows: int, cols: int, with_bias: bool = False) -> None:
        out.append(ParamShape(f"{prefix}.{name}.weight", (rows, cols)))
        if with_bias:
            out.append(ParamShape(f"{prefix}.{name}.bias", (rows,)))

    if config.get("kv_lora_rank"):  # DeepSeek multi-head latent attention
        qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        if q_rank:
            linear("q_a_proj", q_rank, hidden, bias)
            out.append(ParamShape(f"{prefix}.q_a_layernorm.weight", (q_rank,)))
            linear("q_b_proj", heads * qk_head, q_rank)
        else:
            linear("q_proj", heads * qk_head, hidden)
        linear("kv_a_proj_with_mqa", kv_rank + config["qk_rope_head_dim"], hidden, bias)
        out.append(ParamShape(f"{prefix}.kv_a_layernorm.weight", (kv_rank,)))
        linear("kv_b_proj", heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_rank)
        linear("o_proj", hidden, heads * config["v_head_dim"], bias)
        return out
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    qkv_bias = bias or config.get("model_type") == "qwen2"  # Qwen2's q, k, v always have one
    linear("q_proj", heads * head_dim, hidden, qkv_bias)
    linear("k_proj", kv_heads * head_dim, hidden, qkv_bias)
    linear("v_proj", kv_heads * head_dim, hidden, qkv_bias)
    # Helium builds o_proj (hidden, hidden) whatever heads x head_dim
    o_cols = hidden if config.get("model_type") == "helium" else heads * head_dim
    linear("o_proj", hidden, o_cols, bias)
    if str(config.get("model_type", "")).startswith("qwen3"):  # per-head RMSNorm on q and k
        out.append(ParamShape(f"{prefix}.q_norm.weight", (head_dim,)))
        out.append(ParamShape(f"{prefix}.k_norm.weight", (head_dim,)))
    return out


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> list[ParamShape]:
    out = []
    for name, rows, cols in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                             ("down_proj", hidden, inter)):  # fmt: skip
        out.append(ParamShape(f"{prefix}.{name}.weight", (rows, cols)))
        if bias:
            out.append(ParamShape(f"{prefix}.{name}.bias", (rows,)))
    return out


def _moe(config: Mapping[str, Any], prefix: str) -> list[ParamShape]:
    hidden, experts = config["hidden_size"], _num_experts(config)
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    # The experts as transformers 5 stores them (gate and up fused, declared in row
    # blocks) and the router (DeepSeek's e_score_correction_bias beside it is a buffer),
    # in the order it registers them: Mixtral's router first, the others' after.
    router = [ParamShape(f"{prefix}.gate.weight", (experts, hidden))]
    out = [
        ParamShape(f"{prefix}.experts.gate_up_proj", (experts, 2 * inter, hidden), (inter, inter)),
        ParamShape(f"{prefix}.experts.down_proj", (experts, hidden, inter)),
    ]
    out = router + out if config.get("model_type") == "mixtral" else out + router
    if config.get("n_shared_experts"):
        out += _mlp(f"{prefix}.shared_experts", hidden, inter * config["n_shared_experts"])
    return out


_REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# The `model_type`s whose params `from_config` lays out as transformers builds them; a config
# without one is taken as Llama-like.
MODELED_TYPES = (
    "llama", "mistral", "ministral", "granite", "helium", "qwen2", "qwen3", "qwen3_moe",
    "qwen3_vl_text", "mixtral", "deepseek_v2", "deepseek_v3",
)  # fmt: skip


def from_config(config: Mapping[str, Any]) -> tuple[ParamShape, ...]:
    """Params of a decoder-only model from Hugging Face config keys (see `PRESETS`)."""
    model_type = config.get("model_type")
    if model_type is None:  # transformers' config.json always names it
        raise ValueError(
            "config has no model_type, so which params it has is not known: add the "
            f"model_type of its config.json (this planner lays out {', '.join(MODELED_TYPES)})"
        )
    if model_type not in MODELED_TYPES:
        raise ValueError(
            f"config's model_type {model_type!r} is not one whose params this planner lays "
            f"out ({', '.join(MODELED_TYPES)}): its matrices would be guessed as a Llama's "
            "(GPT-NeoX's fused query_key_value, say, planned as q, k, v). Plan from the "
            "model itself, built on the meta device: muon_offload.estimate.estimate(model, "
            "...), which also reads its row_blocks"
        )
    missing = [key for key in _REQUIRED_SIZES if key not in config]
    if missing:
        raise ValueError(f"config is missing keys {missing}")
    for key in (*_REQUIRED_SIZES, "num_key_value_heads", "intermediate_size", "head_dim"):
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"config's {key} should be a whole number >= 1 but is: {value!r}")
    for key in _OPTIONAL_COUNTS:  # 0 (or null): none
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"config's {key} should be a whole number >= 0 but is: {value!r}")
    only = config.get("mlp_only_layers")
    if only is not None and (
        not isinstance(only, (list, tuple)) or not all(type(n) is int for n in only)
    ):
        raise ValueError(f"config's mlp_only_layers should be a list of layer numbers: {only!r}")
    dense = [n for n in range(config["num_hidden_layers"]) if not _is_moe_layer(config, n)]
    needed = ["intermediate_size"] if dense or not config.get("moe_intermediate_size") else []
    if config.get("kv_lora_rank"):
        needed += ["qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    missing = [key for key in needed if not config.get(key)]
    if missing:
        raise ValueError(f"config is missing keys {missing} (or gives 0)")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not config.get("kv_lora_rank") and heads % kv_heads:
        raise ValueError(  # transformers' attention repeats each key/value head alike
            f"config's num_attention_heads ({heads}) should be a multiple of its "
            f"num_key_value_heads ({kv_heads})"
        )
    layers = config["num_hidden_layers"]
    outside = [n for n in (config.get("mlp_only_layers") or ()) if not 0 <= n < layers]
    if outside:
        raise ValueError(
            f"config's mlp_only_layers {outside} are not layers of its {layers} (0 to {layers - 1})"
        )
    if (
        not config.get("kv_lora_rank")
        and not config.get("head_dim")
        and heads > config["hidden_size"]
    ):
        raise ValueError(  # hidden // heads: the attention's matrices would have 0 rows
            f"config's num_attention_heads ({heads}) is more than its hidden_size "
            f"({config['hidden_size']}) and it gives no head_dim: each head would have 0 dims"
        )
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = [ParamShape("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes += _attention(config, f"{prefix}.self_attn")
        if _is_moe_layer(config, layer):
            shapes += _moe(config, f"{prefix}.mlp")
        else:
            mlp_bias = bool(config.get("mlp_bias", False))
            shapes += _mlp(f"{prefix}.mlp", hidden, config["intermediate_size"], mlp_bias)
        shapes.append(ParamShape(f"{prefix}.input_layernorm.weight", (hidden,)))
        shapes.append(ParamShape(f"{prefix}.post_attention_layernorm.weight", (hidden,)))
    shapes.append(ParamShape("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(ParamShape("lm_head.weight", (vocab, hidden)))
    return tuple(shapes)


FSDP_WRAPS = ("per-layer", "torchtitan", "root", "none")
"""How a run applies `fully_shard` (`fsdp_modules`): each layer and the root; torchtitan's,
which also makes the modules after the last layer (final norm, head) one unit; the root;
none (a plain module, one device)."""


def fsdp_modules(shapes: Sequence[ParamShape], wrap: str) -> tuple[str, ...]:
    """The modules `wrap` gives `fully_shard`, by name ("" the root). A layer is a module
    named by a number (`model.layers.3`) inside no numbered module (not its experts)."""
    if wrap not in FSDP_WRAPS:
        raise ValueError(f"wrap should be one of {list(FSDP_WRAPS)} but is: {wrap!r}")
    if wrap == "none":  # a plain module: each module owns its own params
        return ()
    modules: dict[str, None] = {"": None}
    if wrap == "root":
        return tuple(modules)
    tail: dict[str, None] = {}  # modules of the params after the last layer's
    for spec in shapes:
        parts = spec.name.split(".")[:-1]
        numbered = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if numbered is None:
            tail[".".join(parts)] = None
        else:
            modules[".".join(parts[: numbered + 1])] = None
            tail.clear()
    if wrap == "torchtitan":
        modules.update(tail)
    return tuple(modules)


def meta_module(shapes: Sequence[ParamShape], check: Callable[[], None] | None = None) -> nn.Module:
    """An `nn.Module` on the meta device whose `named_parameters()` are exactly `shapes`,
    its modules declaring the shapes' row blocks (`row_blocks`). `check` is called every
    few thousand params (a planner's time limit)."""
    root = nn.Module()
    for index, spec in enumerate(shapes):
        if check is not None and index % 4096 == 0:
            check()
        *path, leaf = spec.name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, nn.Parameter(torch.empty(spec.shape, device="meta")))
        if spec.row_blocks:
            module.row_blocks = {**getattr(module, "row_blocks", {}), leaf: spec.row_blocks}
    named = [name for name, _ in root.named_parameters()]
    if named != [spec.name for spec in shapes]:
        raise ValueError("param names must be unique and list a module's own params first")
    return root
