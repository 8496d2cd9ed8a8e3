"""Newton-Schulz orthogonalization with the iteration schedule as data.

A schedule is the list of quintic coefficients (a, b, c), one triple per
iteration, plus the factor the Frobenius norm is multiplied by before the
first iteration. `zeropower` runs a schedule over a batch of same-shape
matrices with torch.optim.Muon's arithmetic (the fused addmm form), so one
matrix through `zeropower` equals torch.optim.Muon's result bit for bit on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from muon.backend import BACKENDS, BackendSetting

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


@dataclass(frozen=True, slots=True)
class NewtonSchulzSchedule:
    """Quintic Newton-Schulz iterations: X <- a X + (b A + c A^2) X with A = X X^T."""

    coefficients: tuple[Coefficients, ...]
    """(a, b, c) for each iteration, in order."""
    norm_scale: float = 1.0
    """The input is divided by max(norm_scale * ||X||_F, eps)."""

    def __post_init__(self) -> None:
        if not self.coefficients:
            raise ValueError("a Newton-Schulz schedule needs at least one iteration")
        for triple in self.coefficients:
            if len(triple) != 3:
                raise ValueError(f"each iteration needs (a, b, c) but got: {triple}")
        if not self.norm_scale > 0.0:
            raise ValueError(f"norm_scale should be > 0 but is: {self.norm_scale}")

    @classmethod
    def repeat(cls, coefficients: Coefficients, steps: int) -> NewtonSchulzSchedule:
        """One (a, b, c) for `steps` iterations (torch.optim.Muon's ns_coefficients, ns_steps)."""
        if not 0 < steps < 100:
            raise ValueError(f"ns_steps should be in [1, 99] but is: {steps}")
        return cls((tuple(coefficients),) * steps)

    @property
    def steps(self) -> int:
        return len(self.coefficients)


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

DEEPSEEK_V4 = NewtonSchulzSchedule((KELLER_JORDAN_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2)
"""DeepSeek-V4 hybrid: 8 quintic iterations to converge fast, then 2 to settle at 1."""

SCHEDULES: dict[str, NewtonSchulzSchedule] = {
    "keller_jordan": KELLER_JORDAN,
    "polar_express": POLAR_EXPRESS,
    "deepseek_v4": DEEPSEEK_V4,
}


# Newton-Schulz implementations (`muon.backend.BACKENDS`): "torch" is the plain path
# below (the default on CPU and what CI tests); "triton" is `muon.ns_triton` (symmetric
# Triton kernels, CUDA, bf16/fp16); "auto" takes "triton" only where
# `muon.ns_triton.wins` says it was measured to win.
_setting = BackendSetting("MUON_NS_BACKEND")


def set_backend(backend: str) -> str:
    """Set the process-wide default backend of `zeropower`; returns the previous one."""
    return _setting.set(backend)


def get_backend() -> str:
    """The process-wide default backend (`MUON_NS_BACKEND`, else "auto")."""
    return _setting.value


def zeropower(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    eps: float = DEFAULT_EPS,
    backend: str | None = None,
) -> Tensor:
    """Orthogonalize each matrix of `x` (shape (..., rows, cols)) in `x.dtype`.

    Tall matrices are transposed so the Gram matrix is the small one, then
    transposed back (the result may be a transposed view). `x` is not modified.
    `backend` (default: `get_backend()`) picks the implementation, see `BACKENDS`.
    """
    backend = _setting.value if backend is None else backend
    if backend != "torch":
        if backend not in BACKENDS:
            raise ValueError(f"backend should be one of {BACKENDS} but is: {backend!r}")
        # CPU tensors never import triton under "auto".
        if backend == "triton" or x.is_cuda:
            from muon import ns_triton

            if backend == "triton" or ns_triton.wins(x):
                return ns_triton.zeropower_triton(x, schedule, eps)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if schedule.norm_scale != 1.0:
        norm = norm * schedule.norm_scale
    x = x / norm.clamp(min=eps)
    batched = x.ndim == 3
    for a, b, c in schedule.coefficients:
        gram = x @ x.mT
        if batched:
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, update, x, beta=a)
        else:
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
    return x.mT if tall else x


def ns_flops(rows: int, cols: int, steps: int = 1) -> int:
    """FLOPs of `steps` quintic iterations on a rows x cols matrix (dense kernels, no symmetry)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m * m * m)


def ns_flops_symmetric(rows: int, cols: int, steps: int = 1) -> int:
    """FLOPs of `steps` iterations when X X^T and A A compute only half (the symmetric kernels).

    Per iteration: m^2 n for X X^T, m^3 for A A, 2 m^2 n for P X (m <= n).
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (3 * m * m * n + m * m * m)
