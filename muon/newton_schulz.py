"""Newton-Schulz orthogonalization with the iteration schedule as data.

A schedule is the list of quintic coefficients (a, b, c), one triple per
iteration, plus the factor the Frobenius norm is multiplied by before the
first iteration. `zeropower` runs a schedule over a batch of same-shape
matrices by one of two algorithms, the same iteration in exact arithmetic:

- "standard": torch.optim.Muon's arithmetic (the fused addmm form), so one matrix
  through the plain path equals torch.optim.Muon's result bit for bit on CPU.
- "gram" (Gram Newton-Schulz, Dao-AILab 2026): for X of shape m x n, m <= n, every
  iteration's polynomial P_k = a I + b A_k + c A_k^2 is a polynomial in the first
  Gram matrix R = X X^T, so the iteration runs on m x m matrices: R_{k+1} = P_k^2 R_k,
  Q = P_k ... P_s, and X is touched only to form R and to apply Q X. A restart
  (`NewtonSchulzSchedule.gram_restarts`) applies Q and recomputes R from the new X,
  so rounding in Q does not compound over all iterations.

Which algorithm, backend (`muon.backend.BACKENDS`) and compute dtype a matrix takes
is `ns_path`, a pure function of one matrix's shape, dtype and device: a matrix's
result never depends on the other matrices of its batch or on the batch size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from muon.backend import BACKENDS, BackendSetting
from muon.ns_schedules import DEFAULT_EPS, KELLER_JORDAN, NewtonSchulzSchedule, matrix_norms

ALGORITHMS = ("auto", "standard", "gram")

# `algorithm="auto"` takes Gram Newton-Schulz on CUDA for matrices with
# long side / short side >= GRAM_MIN_ASPECT[backend], the backend the matrix takes.
# Chosen by `python -m bench.newton_schulz --aspect-sweep` (aspects 1 to 4 at short sides
# 2048 and 4096, standard / Gram time): the plain path's Gram wins from 2, the symmetric
# Triton path's only from 3, since its standard iteration is faster.
GRAM_MIN_ASPECT = {"torch": 2.0, "triton": 3.0}
# cuBLAS batched products were batch-invariant for every shape measured with a short
# side of 256 and up (bf16 and fp16); fp16 `x @ x.mT` of 2 x 2048 matrices was not.
# tests/test_muon_gpu.py holds a matrix's update to it. Below this short side the plain
# CUDA path launches per matrix.
CUBLAS_BATCH_INVARIANT_MIN_SIDE = 256


# Newton-Schulz implementations (`muon.backend.BACKENDS`): "torch" is the plain path
# below (the default on CPU and what CI tests); "triton" is `muon.ns_triton` (symmetric
# Triton kernels, CUDA, bf16/fp16); "auto" takes "triton" for the matrix shapes
# `muon.ns_triton.auto_takes` says were measured to win.
_setting = BackendSetting("MUON_NS_BACKEND")


def set_backend(backend: str) -> str:
    """Set the process-wide default backend of `zeropower`; returns the previous one."""
    return _setting.set(backend)


def get_backend() -> str:
    """The process-wide default backend (`MUON_NS_BACKEND`, else "auto")."""
    return _setting.value


@dataclass(frozen=True, slots=True)
class NewtonSchulzPath:
    """How `zeropower` orthogonalizes matrices of one shape (`ns_path`)."""

    algorithm: str
    """"standard" or "gram"."""
    backend: str
    """"torch" (plain products) or "triton" (`muon.ns_triton`)."""
    dtype: torch.dtype
    """The dtype the iteration runs in; always of the input's element size."""
    per_matrix: bool = False
    """Launch each matrix of a batch alone, with 2-D products (batched products are not
    batch-invariant for it)."""


def every_matrix_alone(device_type: str) -> bool:
    """Whether the plain path launches every matrix alone on a device of this type,
    whatever its shape (on CUDA that depends on the shape, `ns_path`): what the planner's
    workspace model takes (`MuonPlan.ns_per_matrix`)."""
    return device_type == "cpu"


@functools.cache
def ns_path(
    rows: int,
    cols: int,
    dtype: torch.dtype,
    device_type: str,
    capability: int | None = None,
    backend: str = "auto",
    algorithm: str = "auto",
) -> NewtonSchulzPath:
    """The path for a rows x cols matrix of `dtype` on a device of `device_type`.

    `capability` is the CUDA compute capability's major version (None elsewhere).
    "auto" algorithm: Gram where the aspect ratio pays on the matrix's backend
    (`GRAM_MIN_ASPECT`) on CUDA, else standard (on CPU always standard, so one matrix
    equals torch.optim.Muon's result bit for bit). The plain path launches per matrix with
    2-D products on CPU and for the CUDA shapes below `CUBLAS_BATCH_INVARIANT_MIN_SIDE` or
    in fp32 (`NewtonSchulzPath.per_matrix`). Gram runs in float16 for 16-bit inputs
    on every device, as does the standard iteration on the Triton backend; else the input's
    dtype. Gram in bf16 is not stable: in one CPU run over 256 x 256, 768 x 256 and 64 x 256
    inputs it returned NaN for deepseek_v4 on skewed spectra and 1.0-6.4x the plain bf16
    path's error otherwise, fp16 0.13-0.79x (tests/test_newton_schulz.py holds a skewed case).
    CPU float16 matmuls are slow (there Gram took 9-73x bf16's time at 256 x 256), a cost
    only a forced CPU Gram pays: "auto" never takes Gram on CPU. On CUDA the fp16 paths'
    error against the fp64 iteration is below the plain bf16 path's (`bench/ns_accuracy.py`
    measures it; tests/test_ns_triton.py holds it); Triton standard in bf16
    (P = a I + b A + c A^2 rounded to 8 bits, a I included) was not, on square shapes.
    "auto" backend: `muon.ns_triton.auto_takes` on CUDA, else "torch".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend should be one of {BACKENDS} but is: {backend!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm should be one of {ALGORITHMS} but is: {algorithm!r}")
    cuda = device_type == "cuda"
    if backend == "auto":
        backend = "torch"
        if cuda:  # CPU tensors never import triton under "auto"
            from muon import ns_triton

            # Both 16-bit dtypes take the same kernels: decide before the compute dtype.
            if ns_triton.auto_takes(rows, cols, dtype, capability):
                backend = "triton"
    if algorithm == "auto":
        aspect = max(rows, cols) / max(1, min(rows, cols))
        algorithm = "gram" if cuda and aspect >= GRAM_MIN_ASPECT[backend] else "standard"
    compute = dtype
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    if sixteen_bit and (algorithm == "gram" or backend == "triton"):
        compute = torch.float16
    # fp32 batched cuBLAS products were not batch-invariant on CUDA (a matrix's Muon
    # update changed with the bucket cap, tests/test_muon_gpu.py); bf16 ones were. CPU
    # bf16 baddbmm was not batch-invariant for small shapes, nor equal to 2-D addmm
    # (tests/test_newton_schulz.py): on CPU every matrix takes torch.optim.Muon's 2-D ops.
    variant = min(rows, cols) < CUBLAS_BATCH_INVARIANT_MIN_SIDE or compute == torch.float32
    per_matrix = backend == "torch" and (every_matrix_alone(device_type) or (cuda and variant))
    return NewtonSchulzPath(algorithm, backend, compute, per_matrix)


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def path_for(x: Tensor, backend: str | None = None, algorithm: str = "auto") -> NewtonSchulzPath:
    """`ns_path` for the matrices of `x` (shape (..., rows, cols))."""
    backend = _setting.value if backend is None else backend
    capability = _capability_major(x.device.index or 0) if x.is_cuda else None
    rows, cols = x.shape[-2:]
    return ns_path(rows, cols, x.dtype, x.device.type, capability, backend, algorithm)


def zeropower(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    eps: float = DEFAULT_EPS,
    backend: str | None = None,
    algorithm: str = "auto",
    *,
    cast: bool = True,
) -> Tensor:
    """Orthogonalize each matrix of `x` (shape (rows, cols) or (batch, rows, cols)).

    Tall matrices are transposed so the Gram matrix is the small one, then
    transposed back (the result may be a transposed view). `x` is not modified.
    `backend` (default: `get_backend()`) and `algorithm` ("auto", "standard" or
    "gram") choose the path per matrix shape (`ns_path`). The result has x's dtype,
    or with `cast=False` the path's compute dtype (`NewtonSchulzPath.dtype`), for a
    caller that rounds it to x's dtype where it reads it anyway (the Muon step's
    apply kernel), sparing a pass over the result. Each matrix's result is the same
    bits whatever else shares the batch (given batch-invariant matrix products: the
    plain path on CPU, see the README for CUDA).
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"zeropower takes (rows, cols) or (batch, rows, cols): {tuple(x.shape)}")
    path = path_for(x, backend, algorithm)
    return zeropower_along(x, schedule, eps, path, x.dtype if cast else path.dtype)


def zeropower_along(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    eps: float,
    path: NewtonSchulzPath,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """`zeropower` along a given path (`ns_path`); the result in `dtype` (default: the
    path's compute dtype)."""
    dtype = path.dtype if dtype is None else dtype
    if path.per_matrix and x.ndim == 3:
        # one 2-D matrix at a time: the same launches whatever the batch
        single = dataclasses.replace(path, per_matrix=False)
        first = zeropower_along(x[0], schedule, eps, single, dtype)
        if x.size(0) == 1:  # no output to fill: the workspace of a batch of one
            return first.unsqueeze(0)
        # Each result laid out as a batch of one's (a tall matrix's is a transposed view):
        # the CPU's bf16 `add_` of the update rounds differently by the update's layout.
        transposed = not first.is_contiguous() and first.mT.is_contiguous()
        shape = (x.size(0), x.size(-1), x.size(-2)) if transposed else x.shape
        out = torch.empty(shape, dtype=dtype, device=x.device)
        out = out.mT if transposed else out
        out[0].copy_(first)
        del first
        for i in range(1, x.size(0)):
            out[i].copy_(zeropower_along(x[i], schedule, eps, single))
        return out
    if path.backend == "triton":
        from muon import ns_triton

        if path.algorithm == "gram":
            out = ns_triton.zeropower_gram_triton(x, schedule, eps, dtype=path.dtype)
        else:
            out = ns_triton.zeropower_triton(x, schedule, eps, dtype=path.dtype)
        return out.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if path.algorithm == "gram":
        out = _gram_torch(x, schedule, eps, path.dtype)
    else:
        out = _standard_torch(x, schedule, eps)
    out = out.to(dtype)
    return out.mT if tall else out


def _standard_torch(x: Tensor, schedule: NewtonSchulzSchedule, eps: float) -> Tensor:
    """torch.optim.Muon's iteration on x (m <= n), batched with baddbmm."""
    norm = matrix_norms(x)
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
    return x


def _gram_torch(
    x: Tensor, schedule: NewtonSchulzSchedule, eps: float, dtype: torch.dtype
) -> Tensor:
    """Gram Newton-Schulz on x (m <= n) in `dtype`, plain products.

    With Z = b R + c R^2 (one baddbmm), P = a I + Z enters every product through its
    beta: P M = a M + Z M, so R <- P (P R) and Q <- P Q never form P. Only a segment's
    first Q = P is formed (a added to Z's diagonal in place). Q is kept whole: splitting
    it into q I + (Q - q I) cancels catastrophically in 16 bits (Q - q I has eigenvalues
    near -q where Q's are near 1). R's update is written over R and Q's over W (P R), dead
    by then, so the live m x m matrices are what `gram_workspace_numel` counts, the same
    as `muon.ns_triton.zeropower_gram_triton`'s.
    """
    squeeze = x.ndim == 2
    if squeeze:
        x = x.unsqueeze(0)
    norm = matrix_norms(x, torch.float32)
    if schedule.norm_scale != 1.0:
        norm = norm * schedule.norm_scale
    xs = torch.empty(x.shape, dtype=dtype, device=x.device)
    torch.div(x, norm.clamp(min=eps), out=xs)  # normalized and cast, rounded once
    for segment in schedule.gram_segments():
        r = xs @ xs.mT
        q = None
        for k in segment:
            a, b, c = schedule.coefficients[k]
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)
            first = q is None
            if first:  # the segment's first P, formed: Q = P
                z.diagonal(dim1=-2, dim2=-1).add_(a)
            w = None
            if k == segment[-1]:
                del r
            elif first:  # P itself: P R, then P (P R)
                w = torch.bmm(z, r)
                torch.bmm(z, w, out=r)
            else:
                w = torch.baddbmm(r, z, r, beta=a)
                torch.baddbmm(w, z, w, beta=a, out=r)
            q = z if first else torch.baddbmm(q, z, q, beta=a, out=w)
            del z, w
        xs = torch.bmm(q, xs)
        del q
    return xs.squeeze(0) if squeeze else xs


def _iteration_numel(segments: tuple[range, ...], m: int) -> int:
    """Most m x m matrices the Gram iterations hold at once (both backends), times m^2."""
    most = 0
    for segment in segments:
        length = len(segment)
        # P is Z on the torch path. One iteration: R, P (then Q = P). First and not last:
        # R, P, W (P R; P W is written over R). Last and not first: Q, P, the new Q (R
        # freed). In between: R, Q, P, W (the new Q is written over W, dead after R's update)
        most = max(most, 2 if length == 1 else 3 if length == 2 else 4)
    return most * m * m


def gram_workspace_numel(count: int, rows: int, cols: int, schedule: NewtonSchulzSchedule) -> int:
    """Peak elements Gram Newton-Schulz allocates for `count` rows x cols matrices.

    The normalized copy X (m x n, m <= n) lives throughout; on top of it the m x m
    matrices of the iterations (`_iteration_numel`), or, when Q is applied, the new X
    and Q. The result (one X) is included; per-matrix norms (`count` scalars) are not.
    """
    m, n = min(rows, cols), max(rows, cols)
    iterations = m * n + _iteration_numel(schedule.gram_segments(), m)
    return count * max(iterations, 2 * m * n + m * m)


def standard_workspace_numel(count: int, rows: int, cols: int) -> int:
    """Peak elements standard Newton-Schulz allocates for `count` rows x cols matrices.

    The iterate, its successor and two Gram-sized temporaries (m x m, m = min(rows,
    cols)); the torch and Triton paths hold the same (the Triton path allocates its two
    iterates and two Gram-sized buffers up front and reads a tall input through a
    view). The result (one iterate) is included; per-matrix norms are not.
    """
    m = min(rows, cols)
    return count * (2 * rows * cols + 2 * m * m)


def ns_workspace_numel(
    batches: Iterable[tuple[int, int, int]],
    schedule: NewtonSchulzSchedule = KELLER_JORDAN,
    path: Callable[[int, int], NewtonSchulzPath] | None = None,
    gram: Sequence[NewtonSchulzSchedule | None] | None = None,
    per_matrix: bool = False,
) -> int:
    """Peak elements `zeropower` allocates for (count, rows, cols) batches run in this order.

    Each batch's result stays alive until the bucket is applied, so batch j's
    workspace sits on top of the earlier results. `path(rows, cols)` is the path each
    shape takes (e.g. `functools.partial(ns_path, dtype=..., device_type=...)`); None
    means the standard algorithm. `gram`, when given, says per batch instead: the
    schedule of a batch that takes Gram Newton-Schulz, None for the standard algorithm
    (the planner, which knows a group's `ns_algorithm` but not the device). Elements are
    of the input's size (`NewtonSchulzPath.dtype` always is). `per_matrix`: every batch
    launches one matrix at a time (`NewtonSchulzPath.per_matrix`, the plain path on CPU).
    """
    if path is not None and gram is not None:
        raise ValueError("ns_workspace_numel takes `path` or `gram`, not both")
    peak = done = 0
    for j, (count, rows, cols) in enumerate(batches):
        chosen = path(rows, cols) if path is not None else None
        launch = 1 if per_matrix or (chosen is not None and chosen.per_matrix) else count
        if gram is not None:
            gram_schedule = gram[j]
        else:
            gram_schedule = schedule if chosen is not None and chosen.algorithm == "gram" else None
        if gram_schedule is not None:
            need = gram_workspace_numel(launch, rows, cols, gram_schedule)
        else:
            need = standard_workspace_numel(launch, rows, cols)
        if launch < count:  # the output, filled one matrix at a time
            need += count * rows * cols
        peak = max(peak, done + need)
        done += count * rows * cols
    return peak


def ns_flops(rows: int, cols: int, steps: int = 1) -> int:
    """FLOPs of `steps` quintic iterations on a rows x cols matrix (dense kernels, no symmetry)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m * m * m)


def gram_flops_symmetric(rows: int, cols: int, schedule: NewtonSchulzSchedule) -> int:
    """FLOPs of Gram Newton-Schulz as `muon.ns_triton.zeropower_gram_triton` computes it.

    Per restart segment of L iterations (m <= n): m^2 n for R = X X^T (half the tiles)
    and 2 m^2 n for Q X; per iteration m^3 for P (half); after each iteration but the
    last, 2 m^3 for W = P R and m^3 for R = P W^T (half); for each iteration but the
    first, 2 m^3 for Q = P Q.
    """
    m, n = min(rows, cols), max(rows, cols)
    total = 0
    for segment in schedule.gram_segments():
        steps = len(segment)
        total += 3 * m * m * n + steps * m**3 + 3 * (steps - 1) * m**3 + 2 * (steps - 1) * m**3
    return total


def ns_flops_symmetric(rows: int, cols: int, steps: int = 1) -> int:
    """FLOPs of `steps` iterations when X X^T and A A compute only half (the symmetric kernels).

    Per iteration: m^2 n for X X^T, m^3 for A A, 2 m^2 n for P X (m <= n).
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (3 * m * m * n + m * m * m)
