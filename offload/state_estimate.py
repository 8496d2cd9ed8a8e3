"""How much state an optimizer without a subset step will create, before it steps.

The serial path learns its layout from the state the optimizer creates, so it can
only check the host's memory in advance by asking a dry run: the optimizer's own
class, stepped once over meta-device copies of the params (no memory, no math).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from offload.subset_step import _IMPLEMENTATION_OPTIONS, local_tensor, step_without_hooks


def dry_run_state_bytes(optimizer: torch.optim.Optimizer, params: Collection[Tensor]) -> int | None:
    """Bytes of tensor state (ndim >= 1) one step of `optimizer` creates for `params`,
    with the grads they hold now; None when its class cannot step on the meta device
    (it needs a closure, or reads values)."""
    wanted = {id(p) for p in params}
    groups = []
    for group in optimizer.param_groups:
        metas = []
        for p in group["params"]:
            if id(p) not in wanted or p.grad is None:
                continue
            meta = torch.nn.Parameter(torch.empty_like(local_tensor(p), device="meta"))
            meta.grad = local_tensor(p.grad).to("meta")
            metas.append(meta)
        if metas:
            options = {k: v for k, v in group.items() if k != "params"}
            options.update({k: v for k, v in _IMPLEMENTATION_OPTIONS.items() if k in options})
            groups.append({"params": metas, **options})
    if not groups:
        return 0
    try:
        shadow = type(optimizer)(groups)
        step_without_hooks(shadow)
    except Exception:  # e.g. LBFGS (needs a closure whose loss it reads)
        return None
    return sum(
        v.numel() * v.element_size()
        for entries in shadow.state.values()
        for v in entries.values()
        if isinstance(v, Tensor) and v.ndim >= 1
    )
