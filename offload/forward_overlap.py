"""Which module's forward first reads which params, and hooks that wait there.

With forward overlap the offloaded step's chunks update params on a side stream
while the next forward runs. A module must not read (FSDP2: all-gather) its
params before the chunk holding them has stepped, so a forward pre-hook,
prepended so it runs before FSDP2's own unshard hook, waits for that chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def param_owners(model: nn.Module) -> list[tuple[nn.Module, list[Tensor]]]:
    """(module, params it reads first), in module registration order (~ forward order).

    Under FSDP2 a `fully_shard`-ed module all-gathers its whole subtree's params
    minus nested FSDP2 modules' at once, so it owns all of them; without FSDP2
    each module owns its direct params.
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
        def pre_hook(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                before_module(index)

            return hook

        self.handles = [
            module.register_forward_pre_hook(pre_hook(i), prepend=True)
            for i, (module, _) in enumerate(owners)
        ]
        self.handles.append(model.register_forward_hook(lambda *_: after_forward()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
