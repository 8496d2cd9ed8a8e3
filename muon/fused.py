"""Fused elementwise kernels of the Muon step (Triton, CUDA).

Two one-pass kernels over 2-D rectangles (any strides), with torch's arithmetic:

- `momentum_`: `buf.lerp_(grad, 1 - momentum)`, then the Newton-Schulz input
  (`grad.lerp(buf, momentum)` with Nesterov, else `buf`) cast to the destination's
  dtype and written there (the exchange's send slot or the full-matrix view).
  The plain path reads and writes the matrix about four times for this.
- `apply_`: `param.mul_(decay)` then `param.add_(update.to(dtype), alpha=alpha)`,
  rounding to the param's dtype after each, as the torch ops do. Rounding the update
  here spares the pass that would cast a Newton-Schulz result computed in fp16 to the
  step's bf16 (a pass over every matrix; `bench/muon_step.py --profile` times it).

torch's CPU and CUDA kernels compute lerp as one fused multiply-add,
`base + coef * (end - start)` (aten/src/ATen/native/Lerp.h; coef = weight, base =
start for |weight| < 0.5, else coef = weight - 1, base = end), and `add` with alpha
as `fma(alpha, other, self)` in fp32. These kernels use `tl.fma` in the same places,
so they agree with torch bit for bit where its kernels are compiled that way (CPU:
explicit fmadd; CUDA: nvcc's default contraction). One known difference: torch's
CPU add rounds alpha to a bf16 param's dtype first; its CUDA add, as these kernels,
keeps it fp32.

Imported only where these kernels run (`muon.elementwise` picks them), so that
CPU runs never import triton.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # ships with CUDA builds of torch
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = tl = None

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 8


def available() -> bool:
    """Whether triton imports (it ships with CUDA builds of torch)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _lerp(start, end, weight):
        # torch.lerp: fma(weight, end - start, start) if |weight| < 0.5,
        # else fma(weight - 1, end - start, end); weight is an fp32 scalar.
        small = tl.abs(weight) < 0.5
        coef = tl.where(small, weight, weight - 1.0)
        return tl.fma(coef, end - start, tl.where(small, start, end))

    @triton.jit
    def _offsets(M, N, sm, sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        return rows[:, None] * sm + cols[None, :] * sn, mask

    @triton.jit
    def _momentum_kernel(
        grad_ptr, buf_ptr, out_ptr, M, N,
        sgm, sgn, sbm, sbn, som, son,
        buf_weight, nesterov_weight,
        NESTEROV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        g_offs, mask = _offsets(M, N, sgm, sgn, BLOCK_M, BLOCK_N)
        b_offs, _ = _offsets(M, N, sbm, sbn, BLOCK_M, BLOCK_N)
        o_offs, _ = _offsets(M, N, som, son, BLOCK_M, BLOCK_N)
        grad = tl.load(grad_ptr + g_offs, mask=mask).to(tl.float32)
        buf = _lerp(tl.load(buf_ptr + b_offs, mask=mask), grad, buf_weight)
        tl.store(buf_ptr + b_offs, buf, mask=mask)
        if NESTEROV:
            out = _lerp(grad, buf, nesterov_weight)
        else:
            out = buf
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _apply_kernel(
        param_ptr, update_ptr, M, N, spm, spn, sum_, sun, decay, alpha,
        UPDATE_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        p_offs, mask = _offsets(M, N, spm, spn, BLOCK_M, BLOCK_N)
        u_offs, _ = _offsets(M, N, sum_, sun, BLOCK_M, BLOCK_N)
        dtype = param_ptr.dtype.element_ty
        param = tl.load(param_ptr + p_offs, mask=mask).to(tl.float32)
        param = (param * decay).to(dtype).to(tl.float32)  # mul_ rounds to the param dtype
        update = tl.load(update_ptr + u_offs, mask=mask).to(UPDATE_DTYPE).to(tl.float32)
        tl.store(param_ptr + p_offs, tl.fma(alpha, update, param).to(dtype), mask=mask)


_TRITON_DTYPES = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if triton is not None
    else {}
)


def _check(*tensors: Tensor) -> None:
    if not available():
        raise RuntimeError("the fused Muon kernels need triton, which is not importable")
    for t in tensors:
        if t.ndim != 2:
            raise ValueError(f"the fused Muon kernels take 2-D rectangles but got: {t.shape}")
        if not (t.is_cuda or _interpreting()):
            raise ValueError(f"the fused Muon kernels need CUDA tensors: {t.device}")
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(f"shapes differ: {[tuple(t.shape) for t in tensors]}")


def _grid(t: Tensor) -> tuple[int, int]:
    return triton.cdiv(t.shape[0], BLOCK_M), triton.cdiv(t.shape[1], BLOCK_N)


def momentum_(grad: Tensor, buf: Tensor, out: Tensor, momentum: float, nesterov: bool) -> None:
    """`buf.lerp_(grad, 1 - momentum)`; `out.copy_(grad.lerp(buf, momentum) if nesterov else buf)`.

    `grad` any float dtype, `buf` fp32 (updated in place), `out` any float dtype.
    """
    _check(grad, buf, out)
    if buf.dtype != torch.float32:
        raise ValueError(f"the momentum buffer must be float32 but is: {buf.dtype}")
    if out.numel() == 0:
        return
    _momentum_kernel[_grid(out)](
        grad, buf, out, out.shape[0], out.shape[1],
        grad.stride(0), grad.stride(1), buf.stride(0), buf.stride(1),
        out.stride(0), out.stride(1),
        float(1 - momentum), float(momentum),
        NESTEROV=nesterov, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip


def apply_(
    param: Tensor, update: Tensor, decay: float, alpha: float, dtype: torch.dtype | None = None
) -> None:
    """`param.mul_(decay)`, then `param.add_(update.to(dtype), alpha=alpha)`, in one pass.

    `dtype` (default: update's) is what the update is rounded to (nearest even, as
    `Tensor.to`) before it is added.
    """
    _check(param, update)
    dtype = update.dtype if dtype is None else dtype
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"the update is rounded to one of {list(_TRITON_DTYPES)}, not {dtype}")
    if param.numel() == 0:
        return
    _apply_kernel[_grid(param)](
        param, update, param.shape[0], param.shape[1],
        param.stride(0), param.stride(1), update.stride(0), update.stride(1),
        float(decay), float(alpha), UPDATE_DTYPE=_TRITON_DTYPES[dtype],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip
