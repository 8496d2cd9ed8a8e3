"""Which module's forward first reads which params, and hooks that wait there.

With forward overlap the offloaded step's chunks update params on a side stream
while the next forward runs. A module must not read (FSDP2: all-gather) its
params before the chunk holding them has stepped, so a forward pre-hook,
prepended so it runs before FSDP2's own unshard hook, waits for that chunk (and for
the chunks of the modules FSDP2 prefetches from there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def param_owners(model: nn.Module) -> list[tuple[nn.Module, list[Tensor]]]:
    """(module, params it reads first), in module registration order (~ forward order).

    Under FSDP2 a `fully_shard`-ed module all-gathers its whole subtree's params
    minus nested FSDP2 modules' at once, so it owns all of them; without FSDP2
    each module owns its direct params (its forward waits for its whole subtree's,
    see `waited_params`).
    """
    owner: dict[Tensor, nn.Module] = {}
    fsdp_modules = [m for m in model.modules() if _is_fsdp(m)]
    if fsdp_modules:
        for module in fsdp_modules:  # pre-order: a nested module overrides its parent
            for p in module.parameters():
                owner[p] = module
    else:
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owner.setdefault(p, module)
    owned: dict[nn.Module, list[Tensor]] = {}
    for p, module in owner.items():
        owned.setdefault(module, []).append(p)
    order = {m: i for i, m in enumerate(model.modules())}
    return sorted(owned.items(), key=lambda item: order[item[0]])


def waited_params(module: nn.Module) -> list[Tensor]:
    """Params whose update `module`'s forward must wait for.

    An FSDP2 module reads only what it all-gathers. A plain module may read its
    children's params without running their forward (`nn.MultiheadAttention`
    calls `F.linear` on `out_proj.weight`), so it waits for its whole subtree.
    """
    if _is_fsdp(module):
        return [p for m, ps in param_owners(module) if m is module for p in ps]
    return list(module.parameters())


def fsdp_all_gather_streams(module: nn.Module) -> list[torch.Stream]:
    """The streams FSDP2 copies `module`'s shards in on for its all-gather.

    FSDP2 orders them after the trainer's stream once per forward, at the root,
    so a wait on the trainer's stream alone does not hold back a later module's
    all-gather: they must wait for the chunk themselves. Private API
    (`_get_fsdp_state()._comm_ctx`), absent before FSDP2's lazy init and on CPU.
    """
    if not _is_fsdp(module):
        return []
    context = getattr(module._get_fsdp_state(), "_comm_ctx", None)
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    return [getattr(context, n) for n in names if getattr(context, n, None) is not None]


def forward_prefetched(module: nn.Module) -> list[nn.Module]:
    """Modules whose all-gather FSDP2 issues in `module`'s pre-forward.

    Set by `set_modules_to_forward_prefetch`, possibly after the optimizer is built,
    so it is read at each forward. Private API (`_states_to_forward_prefetch`).
    """
    if not _is_fsdp(module):
        return []
    states = getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", ())
    return [m for state in states for m in getattr(state, "_modules", ())]


class ForwardHooks:
    """Calls `before_module(i)` ahead of owner module i's forward (and FSDP2 unshard),
    and `after_forward()` when the model's forward returns."""

    def __init__(
        self,
        model: nn.Module,
        owners: list[tuple[nn.Module, list[Tensor]]],
        before_module: Callable[[int], None],
        after_forward: Callable[[], None],
    ) -> None:
        # Compiled forwards run the hooks eagerly: traced, the optimizer's step would
        # become part of the user's graph (and recompile as chunks advance).
        def pre_hook(index: int) -> Callable[..., None]:
            @torch.compiler.disable
            def hook(module: nn.Module, args: Any) -> None:
                before_module(index)

            return hook

        @torch.compiler.disable
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            after_forward()

        self.handles = [
            module.register_forward_pre_hook(pre_hook(i), prepend=True)
            for i, (module, _) in enumerate(owners)
        ]
        self.handles.append(model.register_forward_hook(post_hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
