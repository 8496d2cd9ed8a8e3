"""The one check of each Muon hyperparameter, for every door that takes one.

`muon.Muon` (its arguments and every param group, at construction, in
`add_param_group` and again at each step), `muon_offload.OptimizerConfig` (its
fields, `muon_options`, the CLI flags and TOML) and the planner's settings call
these, so a value is accepted or refused the same way whichever door it comes
through. Each check names the value as that door spells it (`name`) and says
what is allowed, as torch.optim does: one check per hyperparameter, the bad
value in the message.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from muon.newton_schulz import ALGORITHMS as NS_ALGORITHMS
from muon.ns_schedules import SCHEDULES, NewtonSchulzSchedule
from muon.planning import REPLICA_OWNERS, SpreadModel

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# dtypes on the wire and in Newton-Schulz, also by name (TOML and the CLI cannot
# write a torch.dtype).
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _number(value: Any, name: str) -> float:
    if isinstance(value, Tensor):
        raise ValueError(f"Tensor {name} is not supported; pass a float")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} should be a number but is: {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} should be finite but is: {value}")
    return value


def _count(value: Any, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be an int but is: {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} should be >= {least} but is: {value}")


def check_lr(value: Any, name: str = "lr") -> None:
    if not _number(value, name) >= 0:
        raise ValueError(f"{name} should be >= 0 but is: {value}")


def check_weight_decay(value: Any, name: str = "weight_decay") -> None:
    if not _number(value, name) >= 0:
        raise ValueError(f"{name} should be >= 0 but is: {value}")


def check_eps(value: Any, name: str = "eps") -> None:
    if not _number(value, name) >= 0:
        raise ValueError(f"{name} should be >= 0 but is: {value}")


def check_momentum(value: Any, name: str = "momentum") -> None:
    if not 0 <= _number(value, name) < 1:
        raise ValueError(f"{name} should be in [0, 1) but is: {value}")


def check_beta(value: Any, name: str) -> None:
    """One of AdamW's betas."""
    if not 0 <= _number(value, name) < 1:
        raise ValueError(f"{name} should be in [0, 1) but is: {value}")


def check_betas(value: Any, name: str = "betas") -> None:
    """AdamW's (beta1, beta2), each in [0, 1)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} should be a pair (beta1, beta2) but is: {value!r}")
    for i, beta in enumerate(value):
        check_beta(beta, f"{name}[{i}]")


def check_nesterov(value: Any, name: str = "nesterov") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} should be True or False but is: {value!r}")


def check_adamw_flag(value: Any, name: str) -> None:
    """AdamW's amsgrad or maximize (AdamW groups only)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} should be True or False but is: {value!r}")


def check_adjust_lr_fn(value: Any, name: str = "adjust_lr_fn") -> None:
    if value not in ADJUST_LR_FNS:
        raise ValueError(f"{name} should be one of {ADJUST_LR_FNS} but is: {value!r}")


def check_ns_algorithm(value: Any, name: str = "ns_algorithm") -> None:
    if value not in NS_ALGORITHMS:
        raise ValueError(f"{name} should be one of {NS_ALGORITHMS} but is: {value!r}")


def check_ns_schedule(value: Any, name: str = "ns_schedule") -> None:
    """A schedule by name (a key of `muon.SCHEDULES`), where a schedule object cannot be
    written (config, CLI, TOML, planner)."""
    if value not in SCHEDULES:
        raise ValueError(f"{name} should be one of {list(SCHEDULES)} but is: {value!r}")


def check_ns_steps(value: Any, name: str = "ns_steps") -> None:
    """None (5, or a schedule's own length) or an iteration count in [1, 99]."""
    if value is None:
        return
    _count(value, name, 1)
    if value > 99:
        raise ValueError(f"{name} should be None or in [1, 99] but is: {value}")


def check_ns_steps_of_schedule(
    value: Any, schedule: NewtonSchulzSchedule, name: str = "ns_steps", of: str = "this schedule"
) -> None:
    """ns_steps beside a schedule, which sets its own iterations: None or their count."""
    if value is not None and value != schedule.steps:
        raise ValueError(
            f"{name} should be None or {schedule.steps} for {of} (a schedule sets its own "
            f"iterations) but is: {value}"
        )


def check_ns_coefficients(value: Any, name: str = "ns_coefficients") -> None:
    """A `NewtonSchulzSchedule`, or one (a, b, c) of finite real numbers."""
    if isinstance(value, NewtonSchulzSchedule):
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"{name} should be (a, b, c) or a NewtonSchulzSchedule but is: {value!r}")
    for i, coefficient in enumerate(value):
        _number(coefficient, f"{name}[{i}]")


def ns_dtype_from(value: Any, name: str = "ns_dtype") -> torch.dtype:
    """`value` (a torch.dtype or its name, e.g. "float32") as a torch.dtype of `NS_DTYPES`."""
    dtype = NS_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in NS_DTYPES.values():
        raise ValueError(
            f"{name} should be torch.bfloat16 or torch.float32 (or their names "
            f"{list(NS_DTYPES)}) but is: {value!r}"
        )
    return dtype


def check_ns_dtype(value: Any, name: str = "ns_dtype") -> None:
    ns_dtype_from(value, name)


def check_bucket_cap_bytes(value: Any, name: str = "bucket_cap_bytes") -> None:
    _count(value, name, 1)


def check_max_inflight(value: Any, name: str = "max_inflight") -> None:
    _count(value, name, 1)


def check_collect_timings(value: Any, name: str = "collect_timings") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} should be True or False but is: {value!r}")


def check_replica_owners(value: Any, name: str = "replica_owners") -> None:
    if value not in REPLICA_OWNERS:
        raise ValueError(f"{name} should be one of {REPLICA_OWNERS} but is: {value!r}")


def check_replica_bytes_per_s(value: Any, name: str = "replica_bytes_per_s") -> None:
    if not _number(value, name) > 0:
        raise ValueError(f"{name} should be > 0 but is: {value}")


def check_spread_model(value: Any, name: str = "spread_model") -> None:
    """A `SpreadModel` with rates > 0 and a step count >= 1."""
    if not isinstance(value, SpreadModel):
        raise TypeError(f"{name} should be a muon.SpreadModel but is: {value!r}")
    for field in ("ns_flops_per_s", "replica_bytes_per_s"):
        if not _number(getattr(value, field), f"{name}.{field}") > 0:
            raise ValueError(f"{name}.{field} should be > 0 but is: {getattr(value, field)}")
    _count(value.ns_steps, f"{name}.ns_steps", 1)


def check_row_blocks(value: Any, rows: int, name: str = "row_blocks") -> None:
    """None, or the row counts (each >= 1) of a fused param's logical matrices, summing
    to its `rows`."""
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} should be a sequence of row counts but is: {value!r}")
    for i, block in enumerate(value):
        _count(block, f"{name}[{i}]", 1)
    if sum(value) != rows:
        raise ValueError(f"{name} should sum to {rows} rows but is: {value}")


CHECKS: dict[str, Callable[[Any, str], None]] = {
    "lr": check_lr,
    "weight_decay": check_weight_decay,
    "momentum": check_momentum,
    "nesterov": check_nesterov,
    "eps": check_eps,
    "betas": check_betas,
    "adjust_lr_fn": check_adjust_lr_fn,
    "ns_steps": check_ns_steps,
    "ns_algorithm": check_ns_algorithm,
    "ns_dtype": check_ns_dtype,
    "bucket_cap_bytes": check_bucket_cap_bytes,
    "max_inflight": check_max_inflight,
    "collect_timings": check_collect_timings,
    "replica_owners": check_replica_owners,
    "spread_model": check_spread_model,
}
"""Checks by `Muon` argument or group key (ns_coefficients and row_blocks are checked
where a schedule or a param's shape is known)."""
