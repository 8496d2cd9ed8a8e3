"""Newton-Schulz schedules as data, and the per-matrix norm every path normalizes by.

It sits below both Newton-Schulz implementations: `muon.ns_triton` and
`muon.newton_schulz` (which dispatches to `muon.ns_triton`) import these from here,
so the import graph has no circle.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]

# Keller Jordan's quintic, the torch.optim.Muon default:
# https://kellerjordan.github.io/posts/muon/
KELLER_JORDAN_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
# Norm clamp of torch.optim.Muon (`EPS`).
DEFAULT_EPS = 1e-7
# Polar Express (arXiv 2505.16932) normalizes by ||X|| * 1.02 so that bf16
# rounding never pushes a singular value above 1 (as dion / modded-nanogpt do).
POLAR_EXPRESS_NORM_SCALE = 1.02
# Gram Newton-Schulz (Dao-AILab, 2026-03) restarts once, after iteration 2.
DEFAULT_GRAM_RESTARTS = (2,)


def _tuple_of(values: object, name: str) -> tuple:
    """`values` (a list, a tuple, any iterable but a string) as a tuple."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} should be a sequence but is: {values!r}")
    return tuple(values)


def _finite_real(value: object) -> bool:
    """A real number (not a bool) that is finite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class NewtonSchulzSchedule:
    """Quintic Newton-Schulz iterations: X <- a X + (b A + c A^2) X with A = X X^T."""

    coefficients: tuple[Coefficients, ...]
    """(a, b, c) for each iteration, in order."""
    norm_scale: float = 1.0
    """The input is divided by max(norm_scale * ||X||_F, eps)."""
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS
    """Gram Newton-Schulz only: before each of these iterations, X <- Q X and the Gram
    matrix is recomputed from it. Indices at or past the last iteration do nothing."""

    def __post_init__(self) -> None:
        # Held as tuples whatever sequences were given: the step caches by the schedule
        # (a list inside made its first step raise halfway, unhashable).
        given = _tuple_of(self.coefficients, "coefficients")
        triples = tuple(_tuple_of(t, "each iteration's (a, b, c)") for t in given)
        object.__setattr__(self, "coefficients", triples)
        object.__setattr__(self, "gram_restarts", _tuple_of(self.gram_restarts, "gram_restarts"))
        if not self.coefficients:
            raise ValueError("a Newton-Schulz schedule needs at least one iteration")
        for triple in self.coefficients:
            if len(triple) != 3:
                raise ValueError(f"each iteration needs (a, b, c) but got: {triple}")
            if not all(_finite_real(v) for v in triple):
                raise ValueError(f"each iteration needs finite real (a, b, c) but got: {triple}")
            if triple[0] == 0.0:
                # Gram Newton-Schulz divides by a when it folds a I into Q (`_gram_torch`)
                raise ValueError(f"each iteration needs a != 0 but got: {triple}")
        if not (_finite_real(self.norm_scale) and self.norm_scale > 0.0):
            raise ValueError(f"norm_scale should be finite and > 0 but is: {self.norm_scale!r}")
        restarts = self.gram_restarts
        if any(r <= 0 for r in restarts) or list(restarts) != sorted(set(restarts)):
            raise ValueError(f"gram_restarts should be increasing and > 0 but is: {restarts}")

    @classmethod
    def repeat(cls, coefficients: Coefficients, steps: int) -> NewtonSchulzSchedule:
        """One (a, b, c) for `steps` iterations (torch.optim.Muon's ns_coefficients, ns_steps)."""
        if not 0 < steps < 100:
            raise ValueError(f"ns_steps should be in [1, 99] but is: {steps}")
        return cls((tuple(coefficients),) * steps)

    @property
    def steps(self) -> int:
        return len(self.coefficients)

    def to_json(self) -> str:
        """The schedule as one string: what an optimizer state dict holds for it.
        Checkpoint code takes only plain types (DCP's full-state gather raises on
        others, torch.load(weights_only=True) refuses them) and flattens lists and dicts
        into per-element keys that it merges with the loading optimizer's own, which
        would splice two schedules of different lengths; a string is one leaf."""
        return json.dumps(
            {
                "coefficients": self.coefficients,
                "norm_scale": self.norm_scale,
                "gram_restarts": self.gram_restarts,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> NewtonSchulzSchedule:
        """The schedule `to_json` wrote."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {
            "coefficients",
            "norm_scale",
            "gram_restarts",
        }:
            raise ValueError(
                "a Newton-Schulz schedule's JSON needs exactly the keys coefficients, "
                f"norm_scale and gram_restarts but is: {text!r}"
            )
        return cls(
            tuple(tuple(triple) for triple in data["coefficients"]),
            norm_scale=data["norm_scale"],
            gram_restarts=tuple(data["gram_restarts"]),
        )

    def gram_segments(self) -> tuple[range, ...]:
        """The iterations between Gram restarts, in order (they cover every iteration)."""
        bounds = [0, *(r for r in self.gram_restarts if r < self.steps), self.steps]
        return tuple(range(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False))


KELLER_JORDAN = NewtonSchulzSchedule.repeat(KELLER_JORDAN_COEFFICIENTS, DEFAULT_NS_STEPS)
"""Keller Jordan's quintic, 5 iterations (torch.optim.Muon's default)."""

POLAR_EXPRESS = NewtonSchulzSchedule(
    (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    norm_scale=POLAR_EXPRESS_NORM_SCALE,
)
"""Polar Express (arXiv 2505.16932), 5 iterations, as used by dion / modded-nanogpt."""

# Its 10 iterations restart Gram Newton-Schulz three times: one restart leaves Q to
# accumulate 8 iterations, 1.1e-3 relative from the standard iteration in fp32
# (3 x 64 x 160 Gaussian, CPU); restarts (2, 5, 8) 8e-6, as close as the 5-step schedules.
DEEPSEEK_V4_GRAM_RESTARTS = (2, 5, 8)
DEEPSEEK_V4 = NewtonSchulzSchedule(
    (KELLER_JORDAN_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2,
    gram_restarts=DEEPSEEK_V4_GRAM_RESTARTS,
)
"""DeepSeek-V4 hybrid: 8 quintic iterations to converge fast, then 2 to settle at 1."""

SCHEDULES: dict[str, NewtonSchulzSchedule] = {
    "keller_jordan": KELLER_JORDAN,
    "polar_express": POLAR_EXPRESS,
    "deepseek_v4": DEEPSEEK_V4,
}


def matrix_norms(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Frobenius norm of each matrix of `x` ((m, n) -> (); (batch, m, n) -> (batch, 1, 1)).

    One reduction per matrix, so a matrix's norm is the same bits whatever the batch
    (a batched reduction may split differently with the number of outputs); for one
    matrix it is torch.optim.Muon's `X.norm()`.
    """
    if x.ndim == 2:
        return torch.linalg.vector_norm(x, dtype=dtype)
    norms = [torch.linalg.vector_norm(m, dtype=dtype) for m in x.unbind(0)]
    return torch.stack(norms).view(-1, 1, 1)
