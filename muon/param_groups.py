"""Split a model's params into Muon and AdamW param groups by name, module and shape."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

# _user_stacklevel: warnings point at the caller, past setup_optimizer
from muon.optimizer import _MUON_KEYS, _user_stacklevel

# Names of params Muon should not orthogonalize even though they are matrices:
# embeddings and the output head (Keller Jordan, Moonlight): the weight of a module
# named lm_head or head or of one directly inside it (timm's `head.fc`, OLMo-core's
# `lm_head.w_out`), every param of a task head named classifier,
# classification_head, score or qa_outputs (and of the modules inside it: RoBERTa's
# `classifier.out_proj`, ResNet's `classifier.1`; VGG's hidden classifier layers too),
# the weight of a module named output outside any numbered block (torchtitan's head,
# under wrappers too; `layers.0.attention.output` is a hidden projection) or named
# output_layer at the model's top under wrappers only (Megatron's head, in DDP's and
# Float16Module's `module`; TimesFM's `input_ff_layer.output_layer` is hidden),
# learned tokens (BLIP-2's `query_tokens`, ViT's `cls_token`), norms, biases, MoE
# routers named "router" (a router named `gate` is found by module: `_moe_gates`) and
# state-space models' log decay rates (Mamba's `A_log`, channels x states: a table of
# scalars, not a linear map).
# Words are looked for in a param's own name, its module's and that module's parent's
# (list indices skipped: `patch_embed.0.weight`, DBRX's `router.layer.weight`, DETR's
# `bbox_embed.layers.0.weight`), not in the modules above: a wrapper attribute named
# `embedder` or `normalizer` holding a whole backbone would send every matrix in it to
# AdamW.
NORM_PATTERN = r"(^|\.)[^.]*norm(?!al)[^.]*(\.\d+)*(\.[^.]+(\.\d+)*){0,2}$"  # not normal(ize)
"""Norms' params, by the name of the param, its module or that module's parent; not the
matrices of a module that fuses a norm into a linear map (`_fused_norm_matrices`)."""
DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    r"(^|\.)[^.]*embed[^.]*(\.\d+)*(\.[^.]+(\.\d+)*){0,2}$",
    r"(^|\.)(lm_head|head)(\.[^.]+)?\.weight$",
    r"(^|\.)(classifier|classification_head|score|qa_outputs)(\.\d+)*(\.[^.]+(\.\d+)*){0,2}$",
    r"^(?!.*\.\d+\.)(.*\.)?output\.weight$",  # not in a numbered block: a hidden one
    r"^((module|_orig_mod|model)\.)*output_layer\.weight$",  # at the top, under wrappers
    r"(^|\.)[^.]*tokens?$",
    NORM_PATTERN,
    r"(^|\.)[^.]*bias[^.]*(\.\d+)*(\.[^.]+(\.\d+)*){0,2}$",
    r"(^|\.)[^.]*router[^.]*(\.\d+)*(\.[^.]+(\.\d+)*){0,2}$",
    r"(^|\.)A_log$",
)
# Names of params that usually hold several logical matrices (q|k|v, gate|up): Phi3's
# qkv_proj and gate_up_proj, MoE expert stacks' gate_up_proj, GPT-NeoX's query_key_value,
# GPT-2's c_attn, Baichuan's W_pack, MPT's Wqkv, nn.MultiheadAttention's in_proj_weight,
# TransformerEngine's layernorm_qkv, Megatron's linear_qkv.
# Without `row_blocks` Muon orthogonalizes each as one matrix, so they are warned about,
# as are recurrent gate weights (`_gate_row_blocks`), found by module since nn.RNN's
# unfused weights have the same names.
FUSED_PATTERNS: tuple[str, ...] = (
    r"(^|\.)(qkv|qkv_proj|in_proj_qkv|Wqkv|W_pack|query_key_value|c_attn|gate_up_proj)\.weight$",
    r"(^|\.)(layernorm_qkv|linear_qkv)\.weight$",  # TransformerEngine's, Megatron's
    r"(^|\.)(gate_up_proj|in_proj_weight)$",
)
# Modules whose params go to AdamW whatever their names: embeddings (GPT-2's wte, wpe;
# an output head tied to one is the same param) and convolutions, whose 3-D+ weights
# are kernels, not stacks of matrices.
DEFAULT_ADAMW_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _output_heads(model: nn.Module) -> list[nn.Module]:
    """The output heads the model's modules name themselves (transformers'
    `get_output_embeddings()`, whatever the head's name: BERT's `cls.predictions.decoder`):
    asked of every module, so a wrapper that hides the method (DDP, `nn.Sequential(model)`)
    and a container of several models (a teacher and a student) give each model's head."""
    heads = []
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if not callable(get):
            continue
        try:
            head = get()
        except NotImplementedError:  # models without a head may say so by raising
            continue
        if isinstance(head, nn.Module):
            heads.append(head)
    return heads


def _moe_gates(model: nn.Module) -> set[int]:
    """Params of MoE routers named `gate` (Mixtral, Qwen-MoE, OLMoE, DeepSeek): a `gate`
    module beside `experts` (a module or an expert stack). A `gate` elsewhere (a gated
    layer's projection) is a linear map, for Muon."""
    routers: set[int] = set()
    for parent in model.modules():
        children = dict(parent.named_children())
        beside = "experts" in children or "experts" in dict(parent.named_parameters(recurse=False))
        if "gate" in children and beside:
            routers |= {id(p) for p in children["gate"].parameters()}
    return routers


def _gate_row_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Row blocks of recurrent gate weights, by param name: nn.LSTM's and nn.GRU's
    `weight_ih_l*` / `weight_hh_l*` (their cells': `weight_ih` / `weight_hh`) stack 4 / 3
    gates of `hidden_size` rows each (nn.RNN's hold one gate: not listed)."""
    blocks: dict[str, tuple[int, ...]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            continue
        hidden = module.hidden_size
        for name, p in module.named_parameters(recurse=False):
            if name.startswith(("weight_ih", "weight_hh")) and p.shape[0] > hidden:
                blocks[f"{prefix}.{name}" if prefix else name] = (hidden,) * (p.shape[0] // hidden)
    return blocks


def model_row_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Fused params' logical row blocks, declared by modules as `row_blocks = {name: rows}`.

    Returns name patterns (as `muon_param_groups` takes them, which reads these itself),
    one per distinct block layout, for the params that train (frozen ones are in no
    group). A module's `row_blocks` of None declares nothing; a name that is none of the
    module's params is refused.
    """
    by_blocks: dict[tuple[int, ...], list[str]] = {}
    # A param reached by several names (an alias of its module, a module shared by two
    # parents) is named as `muon_param_groups` names it: by the first.
    first_name = {id(p): name for name, p in model.named_parameters()}
    declared_at: dict[int, tuple[str, tuple[int, ...]]] = {}  # by param: (name, rows) first seen
    for module_name, module in model.named_modules():
        declared = getattr(module, "row_blocks", None)
        if declared is None:
            continue
        if not isinstance(declared, Mapping) or not all(
            isinstance(name, str) and _is_row_counts(rows) for name, rows in declared.items()
        ):
            where = f"module {module_name!r}" if module_name else "the model"
            raise TypeError(
                f"{where} ({type(module).__name__}) has row_blocks = {declared!r}; it should "
                "be a dict of param name -> row counts of its logical matrices, e.g. "
                "{'qkv.weight': (q, k, v)}, or None"
            )
        params = dict(module.named_parameters(remove_duplicate=False))  # aliases too
        for param_name, rows in declared.items():
            if param_name not in params:
                where = f"module {module_name!r}" if module_name else "the model"
                raise ValueError(
                    f"{where} ({type(module).__name__}) declares row_blocks for "
                    f"{param_name!r}, which is none of its params ({sorted(params)}); name "
                    "the param as module.named_parameters() names it"
                )
            param = params[param_name]
            where = f"{module_name}.{param_name}" if module_name else param_name
            earlier = declared_at.setdefault(id(param), (where, tuple(rows)))
            if earlier[1] != tuple(rows):
                raise ValueError(
                    f"param {first_name[id(param)]} is declared with row_blocks {earlier[1]} "
                    f"as {earlier[0]} and {tuple(rows)} as {where}: declare one layout"
                )
            names = by_blocks.setdefault(tuple(rows), [])
            full = re.escape(first_name[id(param)])
            if param.requires_grad and full not in names:  # a frozen one is in no group
                names.append(full)
    return {f"^({'|'.join(names)})$": blocks for blocks, names in by_blocks.items() if names}


def _is_row_counts(rows: Any) -> bool:
    """A sequence of ints (their values are checked where the param's rows are known)."""
    return (
        isinstance(rows, Sequence)
        and not isinstance(rows, (str, bytes))
        and all(isinstance(n, int) for n in rows)
    )


def muon_param_groups(
    model: nn.Module,
    *,
    row_blocks: Mapping[str, Sequence[int]] | None = None,
    adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS,
    adamw_modules: tuple[type[nn.Module], ...] = DEFAULT_ADAMW_MODULES,
    adamw_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for `muon.Muon`: 2-D / 3-D params to Muon, the rest to AdamW.

    A param goes to AdamW if it has fewer than 2 or more than 3 dims, its matrices are
    vectors (a side of at most 1: a ViT's class token (1, 1, d), RWKV's time-mix
    weights, whose orthogonalization would only normalize them), one of its names (a tied
    param has several) matches one of `adamw_patterns` (regular expressions, `re.search`
    over the dotted name; by default embeddings, the output head, norms, biases and
    routers, looked for in the param's own name, its module's and that module's parent's,
    not in a wrapper's above; a module that fuses a norm into a linear map, such as
    TransformerEngine's LayerNormLinear, keeps its matrices for Muon),
    it is an MoE router's (a module `gate` beside `experts`), a module of a type in
    `adamw_modules` holds it (by default embeddings and convolutions, nn.Conv1d / 2d /
    3d and their transposes: a conv weight is a kernel, not a stack of matrices), or
    the `get_output_embeddings()` of the model or of any of its modules (as transformers'
    models define it; a wrapper such as DDP hides the model's) returns the module holding
    it: an output head, whatever its name.
    `row_blocks` maps a name pattern to the row blocks of matching fused params
    (e.g. {r"qkv_proj.weight$": (q, k, v)}); each pattern gets its own Muon group
    and must match at least one Muon param. The row blocks modules declare
    (`row_blocks = {param name: rows}` on the module: `model_row_blocks`) are added, for
    the params no pattern matches, in groups after the patterns'. A Muon param named
    like a fused one (`FUSED_PATTERNS`: qkv_proj, gate_up_proj, query_key_value, c_attn,
    in_proj_weight, ...) or an nn.LSTM / nn.GRU gate weight (weight_ih*, weight_hh*;
    their cells' too) that no `row_blocks` pattern matches is orthogonalized as one
    matrix, with one warning per call listing them (for gate weights, with the row_blocks
    to pass).
    `adamw_options` (lr, betas, eps, weight_decay) go into the AdamW group. Every
    trainable param lands in exactly one group; empty groups are left out; a call that
    leaves none to Muon warns, and FSDP1 modules (whose params it flattens) are refused:
    build the groups on an FSDP2 (`fully_shard`) or unwrapped model. Frozen params
    (`requires_grad=False` now) are left out, as transformers' Trainer leaves them: one
    unfrozen later is never stepped, so build the groups (and the optimizer) after
    unfreezing, or add it with `optimizer.add_param_group` (not once the optimizer is
    wrapped in a `CPUOffloadOptimizer`, which plans its host slabs once: wrap anew).
    """
    if not isinstance(model, nn.Module):  # the names choose the groups
        raise TypeError(
            "muon_param_groups takes the model (an nn.Module, whose param names choose the "
            f"groups), not its params: got {type(model).__name__}"
        )
    row_blocks = dict(row_blocks or {})
    declared = model_row_blocks(model)  # exact names; the caller's patterns come first
    if isinstance(adamw_patterns, str):  # a string is a sequence of one-letter patterns
        raise TypeError(
            f"adamw_patterns takes a sequence of regular expressions, not one string: "
            f"({adamw_patterns!r},)"
        )
    for option in ("params", "algorithm"):
        if option in (adamw_options or {}):
            raise ValueError(
                f"adamw_options may not set {option!r}: muon_param_groups fills the AdamW "
                "group's params and algorithm itself (lr, betas, eps, weight_decay go there)"
            )
    muon_only = [
        option
        for option in (*_MUON_KEYS, "ns_coefficients", "ns_steps", "row_blocks")
        if option in (adamw_options or {})
    ]
    if muon_only:  # else kept in the group and never read
        raise ValueError(
            f"adamw_options sets {muon_only}, which only Muon groups read (AdamW's momentum "
            "is betas[0]): pass them to Muon(...) instead"
        )
    for pattern, rows in row_blocks.items():
        if not _is_row_counts(rows):
            raise TypeError(
                f"row_blocks[{pattern!r}] is {rows!r}; it should be the row counts of the "
                "param's logical matrices, e.g. (q, k, v), or (rows,) for one block size"
            )
    for where, patterns in (("row_blocks", row_blocks), ("adamw_patterns", adamw_patterns)):
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"{where} pattern {pattern!r} is no regular expression: {error}"
                ) from None
    _refuse_flattened(model)
    lazy = next((name for name, p in model.named_parameters() if nn.parameter.is_lazy(p)), None)
    if lazy is not None:  # its shape, which chooses its group, is not known yet
        raise ValueError(
            f"param {lazy} is uninitialized (a lazy module's, e.g. nn.LazyLinear), so its "
            "shape, which chooses Muon or AdamW, is not known yet: run the model's forward "
            "once first, then build the groups"
        )
    not_muon: dict[str, list[str]] = {}  # names a row_blocks pattern matches outside Muon
    plain: list[nn.Parameter] = []
    unsplit_fused: list[str] = []
    unnamed_stacks: list[str] = []  # 3-D params not named as expert stacks
    fused: dict[str, list[nn.Parameter]] = {pattern: [] for pattern in row_blocks}
    by_module_blocks: dict[str, list[nn.Parameter]] = {pattern: [] for pattern in declared}
    adamw: list[nn.Parameter] = []
    by_module = {
        id(p) for m in model.modules() if isinstance(m, adamw_modules) for p in m.parameters()
    }
    by_module |= {id(p) for head in _output_heads(model) for p in head.parameters()}
    by_module |= _moe_gates(model)
    fused_norm = _fused_norm_matrices(model)
    gates = _gate_row_blocks(model)
    # Every name of a tied param: named_parameters() gives only its first
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, p in model.named_parameters():
        outside = "frozen" if not p.requires_grad else None
        if outside is None and (
            p.ndim not in (2, 3)
            or min(p.shape[-2:]) <= 1
            or id(p) in by_module
            or any(
                re.search(pattern, n)
                for n in names[id(p)]
                for pattern in adamw_patterns
                if not (pattern == NORM_PATTERN and id(p) in fused_norm)
            )
        ):
            adamw.append(p)
            outside = "AdamW"
        if outside is not None:
            for pattern in (*row_blocks, *declared):
                if re.search(pattern, name):
                    not_muon.setdefault(pattern, []).append(f"{name} ({outside})")
            continue
        matches = [pattern for pattern in row_blocks if re.search(pattern, name)]
        if len(matches) > 1:
            raise ValueError(f"param {name} matches several row_blocks patterns: {matches}")
        if not matches:
            matches = [pattern for pattern in declared if re.search(pattern, name)]
        if matches:
            (fused if matches[0] in fused else by_module_blocks)[matches[0]].append(p)
        else:
            plain.append(p)
        if p.ndim == 3 and not matches and "expert" not in name.lower():
            unnamed_stacks.append(f"{name} {tuple(p.shape)}")
        if not matches and (
            name in gates or any(re.search(pattern, name) for pattern in FUSED_PATTERNS)
        ):
            unsplit_fused.append(name)
    for pattern, params in fused.items():
        if not params:
            seen = not_muon.get(pattern)
            raise ValueError(
                f"row_blocks pattern {pattern!r} matches no Muon param"
                + (f": it matches only {seen}" if seen else "")
                + "; drop it, or fix the pattern (re.search over model.named_parameters())"
            )
    for pattern, params in by_module_blocks.items():
        if not params and pattern in not_muon:  # declared fused, and no Muon param
            raise ValueError(
                f"modules declare row_blocks {declared[pattern]} for {not_muon[pattern]}, "
                "which Muon does not take: drop the declaration, or keep the param from "
                "AdamW (adamw_patterns, adamw_modules)"
            )
    if unsplit_fused:
        unsplit_gates = {name: gates[name] for name in unsplit_fused if name in gates}
        warnings.warn(
            _unsplit_fused_warning(unsplit_fused, unsplit_gates), stacklevel=_user_stacklevel()
        )
    if unnamed_stacks:
        warnings.warn(
            f"muon_param_groups: {unnamed_stacks} are 3-D and not named as expert stacks; "
            "Muon takes each as a stack of (dim 1, dim 2) matrices, each orthogonalized "
            "alone: right for expert or per-head stacks, wrong for one linear map stored in "
            "three dims (XLNet's (d_model, heads, head_dim) q/k/v) or a table. Send those to "
            "AdamW with adamw_patterns (or reshape them); declare a real stack's rows, "
            "row_blocks={pattern: (rows,)}, to silence this",
            stacklevel=_user_stacklevel(),
        )
    groups: list[dict[str, Any]] = []
    if plain:
        groups.append({"params": plain})
    groups.extend(
        {"params": params, "row_blocks": tuple(row_blocks[pattern])}
        for pattern, params in fused.items()
    )
    groups.extend(
        {"params": params, "row_blocks": declared[pattern]}
        for pattern, params in by_module_blocks.items()
        if params
    )
    if adamw:
        groups.append({"params": adamw, "algorithm": "adamw", **dict(adamw_options or {})})
    if adamw and not plain and not fused and not any(by_module_blocks.values()):
        warnings.warn(
            f"muon_param_groups: all {len(adamw)} trainable params go to AdamW, none to Muon "
            "(Muon takes 2-D and 3-D matrices whose names match no adamw_patterns): check "
            "that the model's params have their real shapes (DeepSpeed ZeRO-3 empties them)",
            stacklevel=_user_stacklevel(),
        )
    grouped = sum(len(g["params"]) for g in groups)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert grouped == trainable, f"{grouped} params grouped, {trainable} trainable"
    return groups


def _fused_norm_matrices(model: nn.Module) -> set[int]:
    """Ids of the matrices of modules that fuse a norm into a linear map, whose class
    name says both (TransformerEngine's LayerNormLinear and LayerNormMLP, Megatron's
    TELayerNormColumnParallelLinear): TransformerEngine names them `layernorm_qkv` and
    `layernorm_mlp`, and the norm pattern would send their matrices to AdamW."""
    return {
        id(p)
        for m in model.modules()
        if re.search(r"Norm.*(Linear|MLP)", type(m).__name__)
        for name, p in m.named_parameters(recurse=False)
        if p.ndim >= 2 and "norm" not in name.lower()
    }


def _refuse_flattened(model: nn.Module) -> None:
    """FSDP1 (`FullyShardedDataParallel`) flattens each unit's params into one 1-D
    `FlatParameter` shard: every matrix would go to AdamW, silently."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    flattened = [
        name or "(the root)"
        for name, m in model.named_modules()
        if isinstance(m, FullyShardedDataParallel) and any(p.requires_grad for p in m.parameters())
    ]
    if flattened:
        raise ValueError(
            f"muon_param_groups: {flattened[:3]} are FSDP1 (FullyShardedDataParallel) modules, "
            "which flatten their params into 1-D shards: Muon, which orthogonalizes each "
            "matrix whole, could take none of them. Shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), which keeps each param's shape"
        )


def _unsplit_fused_warning(names: Sequence[str], gates: Mapping[str, tuple[int, ...]]) -> str:
    """The warning for fused-looking `names`; `gates`: the row blocks of those that are
    recurrent gate weights, given as the `row_blocks` that declares them."""
    text = (
        f"muon_param_groups: {list(names)} look fused (q|k|v or gate|up in one param) and no "
        "row_blocks pattern matches them: Muon orthogonalizes each as one matrix. Where the "
        "blocks are rows (nn.Linear(in, q + k + v); experts stored (E, gate + up, in), as "
        "Qwen3-MoE's and Mixtral's), declare them: row_blocks={r'qkv_proj\\.weight$': (q, k, v)} "
        "here, or a module attribute row_blocks = {'qkv_proj.weight': (q, k, v)} for "
        "setup_optimizer; one block, (rows,), keeps a param whole and silences this. Blocks "
        "in columns (GPT-2's Conv1D c_attn, experts stored (E, in, gate + up)) or interleaved "
        "per head (GPT-NeoX's query_key_value) cannot be declared."
    )
    if gates:
        declared = {f"^{re.escape(name)}$": blocks for name, blocks in gates.items()}
        text += (
            " nn.LSTM's and nn.GRU's weight_ih / weight_hh stack their gates in rows "
            f"(i|f|g|o, r|z|n; hidden_size each): row_blocks={declared}"
        )
    return text
