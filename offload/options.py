"""The one check of each `CPUOffloadOptimizer` option, for every door that takes one.

The constructor calls `check_offload_options` with its argument names;
`muon_offload.OptimizerConfig` (its fields, CLI flags and TOML) with
`prefix="offload_"`, its field names; the planner checks its settings with the
single-option checks. Each check names the value as its door spells it and says
what is allowed.
"""

from __future__ import annotations

import numbers
from typing import Any


def _count(value: Any, name: str, least: int, kind: str = "an int") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be {kind} but is: {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} should be >= {least} but is: {value}")


def check_chunk_bytes(value: Any, name: str = "chunk_bytes") -> None:
    _count(value, name, 1)


def check_staging_slots(value: Any, name: str = "staging_slots") -> None:
    _count(value, name, 1)


def check_gpu_resident_bytes(value: Any, name: str = "gpu_resident_bytes") -> None:
    """A byte count >= 0, or "auto"."""
    if isinstance(value, str):
        if value == "auto":
            return
        raise ValueError(f"{name} should be an int >= 0 or 'auto' but is: {value!r}")
    _count(value, name, 0, "an int or 'auto'")


def check_bytes(value: Any, name: str) -> None:
    """A byte count >= 0."""
    _count(value, name, 0)


def check_optional_bytes(value: Any, name: str) -> None:
    """None (the default) or a byte count >= 0."""
    if value is not None:
        _count(value, name, 0, "an int or None")


def check_load_in_backward(value: Any, name: str = "load_in_backward") -> None:
    """None (the default), True, False, or a byte count >= 1."""
    if value is None or isinstance(value, bool):
        return
    kind = "True, False, None or a byte count"
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be {kind} but is: {value!r} ({type(value).__name__})")
    if value < 1:  # 0 reads as "nothing": that is False
        raise ValueError(
            f"{name} should be a byte count >= 1, or False to load nothing in the backward, "
            f"but is: {value}"
        )


def check_offload_options(
    *,
    chunk_bytes: Any,
    staging_slots: Any,
    gpu_resident_bytes: Any,
    gpu_budget_bytes: Any = None,
    overlap_forward: bool,
    load_in_backward: Any,
    prefix: str = "",
) -> None:
    """Every option and how they combine; names are `prefix` + the constructor's
    (`overlap_forward` is a model there, a bool in the config)."""
    overlap_on = f"{prefix}overlap_forward=True" if prefix else "overlap_forward=model"
    check_chunk_bytes(chunk_bytes, f"{prefix}chunk_bytes")
    check_staging_slots(staging_slots, f"{prefix}staging_slots")
    check_gpu_resident_bytes(gpu_resident_bytes, f"{prefix}gpu_resident_bytes")
    check_optional_bytes(gpu_budget_bytes, f"{prefix}gpu_budget_bytes")
    auto = gpu_resident_bytes == "auto"
    check_load_in_backward(load_in_backward, f"{prefix}load_in_backward")
    # Without "auto", the budget bounds the default's backward loads (grown to what the
    # forward stalls for): with state kept resident or the loads given, nothing is chosen.
    tuned = gpu_resident_bytes == 0 and overlap_forward and load_in_backward is None
    if gpu_budget_bytes is not None and not (auto or tuned):
        chosen_by_hand = [
            f"{prefix}gpu_resident_bytes={gpu_resident_bytes!r}" if gpu_resident_bytes else "",
            f"{prefix}load_in_backward={load_in_backward!r}"
            if load_in_backward is not None
            else "",
            "" if overlap_forward else f"no {overlap_on}",
        ]
        raise ValueError(
            f"{prefix}gpu_budget_bytes bounds what the optimizer chooses to hold on the GPU: "
            f"what {prefix}gpu_resident_bytes='auto' keeps, or, with {overlap_on} and "
            f"nothing resident, what the backward loads by default; here nothing is chosen ("
            + ", ".join(reason for reason in chosen_by_hand if reason)
            + f"): leave {prefix}gpu_budget_bytes unset, or let the optimizer choose"
        )
    if load_in_backward not in (None, False) and not overlap_forward:
        raise ValueError(
            f"{prefix}load_in_backward={load_in_backward!r} needs {overlap_on} (the forward "
            f"overlap's hooks find where the backward is); set both or turn "
            f"{prefix}load_in_backward off"
        )
