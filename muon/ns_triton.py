"""Newton-Schulz with symmetric Triton kernels (CUDA; Hopper measured).

Per quintic iteration on X (m x n, m <= n after orientation):

    A = X X^T                   sym_matmul(X)                             (half the tiles)
    P = a I + b A + c A A       sym_matmul(A, c=A, alpha=c, beta=b, diag=a) (A A = A A^T)
    X = P X                     torch.bmm (cuBLAS)

`sym_matmul` launches only the output tiles on or below the diagonal of
`x @ y^T` (y = x unless given; symmetric in exact arithmetic), one program per
(tile, matrix of the batch), accumulates in fp32, applies the epilogue
`s * (alpha * acc + beta * c + diag * I)` in fp32 (one rounding), and writes each
tile to (i, j) and, transposed, to (j, i); a tile across the diagonal keeps its
elements on or below it and mirrors them: the result is exactly symmetric. Tiles are
square or tall (`SymConfig.height`); programs run in bands of GROUP tile rows
(`_grouped_tile`) so that the ones running together share operand blocks in L2.
Folding `a X` into P as `a I` leaves cuBLAS a plain product (`baddbmm` would first
copy X into its output to add `a X`). The iteration runs in fp16 for 16-bit inputs
(`muon.newton_schulz.ns_path`): a bf16 P with a I in it rounds too coarsely.
Configurations are fixed per shape class (`config_for`); nothing is autotuned at step
time. The first call of each (config, K-divisibility, epilogue) variant JIT-compiles
(about a second each; Triton's disk cache makes later processes load in milliseconds);
`bench/newton_schulz.py` prints the cost.

Gram Newton-Schulz (`zeropower_gram_triton`) uses the same kernel for R = X X^T,
P = a I + b R + c R R and, with a second operand, R <- P (P R)^T; cuBLAS for the
products that are symmetric only in exact arithmetic (P R, P Q) and Q X; and one Triton
pass (`_normalize_kernel`) for X / ||X|| cast to fp16.

Batch invariance: the kernel runs one program per (tile, matrix) with a configuration
fixed per shape, so a matrix's result does not depend on the batch; `auto_takes` is a
rule per matrix shape; norms are one reduction per matrix (`matrix_norms`); cuBLAS
products are batch-invariant for these sizes (`muon.newton_schulz`
`CUBLAS_BATCH_INVARIANT_MIN_SIDE`).

Triton is imported lazily; `available()` is False where it is missing and the
plain torch path in `muon.newton_schulz` is used instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

try:  # ships with CUDA builds of torch; this module is imported only off the CPU default path
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = tl = None

from muon.ns_schedules import NewtonSchulzSchedule, matrix_norms

# `backend="auto"` takes this path on GPUs of these compute capabilities (major) for
# matrices whose short side is at least AUTO_MIN_SIDE: a rule per matrix shape, never
# per launch, so a matrix's result does not depend on what shares its batch.
# Chosen by `python -m bench.newton_schulz`: batched launches from a short side of 768 up
# beat the plain path, a lone 1024-side matrix did not (a batch of one fills few SMs;
# Muon batches same-shape matrices, so the batched numbers decide).
AUTO_CAPABILITIES = frozenset({9})
AUTO_MIN_SIDE = 768
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_MATRIX_NUMEL = 2**31 - 1
"""Offsets within one matrix are int32 in the kernels (the batch offset is int64)."""


@dataclass(frozen=True)
class SymConfig:
    """One fixed launch configuration of the symmetric kernel."""

    block: int
    """Output tile width; the tile is `height * block` rows by `block` columns."""
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """Load operands through host-side TMA descriptors (Hopper+), else pointer loads."""
    group: int = 1
    """Tile rows per band of the launch order (`_grouped_tile`); 1 is row-major, the order
    every configuration was measured in before bands."""
    height: int = 1
    """Output tile rows in units of `block`. A tall tile (2) holds two square tiles of one
    tile column, so each block of y it loads feeds twice the products; its tile row's last
    tile is half above the diagonal, computed and not stored (3% more work at m = 4096,
    counted: 544 square tiles computed for 528 stored)."""

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"group should be >= 1 but is: {self.group}")
        if self.height < 1:
            raise ValueError(f"height should be >= 1 but is: {self.height}")

    @property
    def name(self) -> str:
        edge = f"{self.block}" if self.height == 1 else f"{self.height * self.block}x{self.block}"
        tiles = f"b{edge}k{self.block_k}w{self.num_warps}s{self.num_stages}"
        return f"{tiles}g{self.group}" + ("tma" if self.tma else "")


CONFIGS: dict[str, SymConfig] = {
    c.name: c
    for c in (
        SymConfig(128, 64, 8, 3),
        SymConfig(128, 64, 8, 4),
        SymConfig(128, 64, 4, 3),
        SymConfig(128, 128, 8, 3),
        SymConfig(64, 64, 4, 4),
        SymConfig(128, 64, 8, 3, tma=True),
        SymConfig(128, 64, 8, 4, tma=True),
        SymConfig(128, 128, 8, 3, tma=True),
        # the launch order's band height, on the large default and the TMA candidate
        *(SymConfig(128, 64, 4, 3, group=g) for g in (4, 8, 16)),
        *(SymConfig(128, 64, 8, 3, tma=True, group=g) for g in (4, 8, 16)),
        # tall tiles (256 x 128): Triton's Hopper GEMM shape, two warpgroups
        SymConfig(128, 64, 8, 3, height=2),
        SymConfig(128, 64, 8, 4, height=2),
        SymConfig(128, 64, 8, 3, height=2, group=8),
        *(SymConfig(128, 64, 8, s, tma=True, height=2, group=g) for s in (3, 4) for g in (1, 8)),
        # square TMA tiles, deeper pipelines, in bands
        *(SymConfig(128, 64, 8, s, tma=True, group=8) for s in (4, 5)),
    )
}
"""Candidates the bench times; `config_for` picks among them by shape class."""

# Chosen by `python -m bench.sym_kernel` at m = 4096: square TMA tiles with 8 warps and
# 4 stages beat the tall (256 x 128) tiles where Muon's 512 MiB buckets launch 1 or 2
# matrices of a shape (a 4096 x 4096 output is 272 tall tiles, a last wave almost empty
# on a GPU of 132 SMs, or 528 square ones, whole waves); at 24 matrices the tall tiles
# are faster. Every configuration computes the same bits (tests/test_ns_triton.py), so
# this is speed only.
LARGE_CONFIG = "b128k64w8s4g8tma"
"""m >= 2048 (the Qwen3-8B hidden and MLP sides)."""
MEDIUM_CONFIG = "b128k64w4s3g1"
"""512 <= m < 2048 (b128k64w4s3: least total time over the Qwen3-8B shapes before tall tiles)."""
SMALL_CONFIG = "b64k64w4s4g1"
"""m < 512: more, smaller tiles to fill the SMs."""


def config_for(m: int, k: int) -> SymConfig:
    """The fixed configuration for an m x m output with reduction length k."""
    del k  # one class per m for now; the bench reports per (m, k)
    if m >= 2048:
        return CONFIGS[LARGE_CONFIG]
    return CONFIGS[MEDIUM_CONFIG if m >= 512 else SMALL_CONFIG]


def available() -> bool:
    """Whether triton imports (it ships with CUDA builds of torch)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _numpy24_interpreter_shim() -> None:
    """Triton 3.6's interpreter does int() on 1-element arrays, an error since numpy 2.4:
    give its tensors an `__index__` (interpreter only; private API, one place; checked on
    triton 3.6.0 with numpy 2.4)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_muon_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._muon_shim = True
    interpreter._patch_lang_tensor = patched


if triton is not None and _interpreting():
    _numpy24_interpreter_shim()


def _fits_int32(x: Tensor) -> bool:
    return x.shape[-2] * x.shape[-1] <= MAX_MATRIX_NUMEL


def auto_takes(rows: int, cols: int, dtype: torch.dtype, capability: int | None) -> bool:
    """Whether `backend="auto"` takes this path for rows x cols matrices of `dtype`."""
    if dtype not in SUPPORTED_DTYPES or rows * cols > MAX_MATRIX_NUMEL:
        return False
    if min(rows, cols) < AUTO_MIN_SIDE or capability not in AUTO_CAPABILITIES:
        return False
    return available()


if triton is not None:

    @triton.jit
    def _tile(pid):
        # pid -> (i, j), i >= j, row-major over the lower triangle; fp32 sqrt then fix by one.
        i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
        i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
        return i, pid - i * (i + 1) // 2

    @triton.jit
    def _grouped_tile(pid, T, GROUP: tl.constexpr):
        # pid -> (i, j), i >= j, over a T x T tile grid's lower triangle in bands of GROUP
        # tile rows (the last band may be shorter), bands in order. A band holds whole rows,
        # so the row-major index's row tells the band. Inside band [r0, r0 + h): first the
        # full columns j < r0, column-major (consecutive programs share y's block j and
        # cycle over the band's h blocks of x), then the band's own h x h triangle,
        # row-major. GROUP = 1 is `_tile`'s row-major order.
        row, _ = _tile(pid)
        r0 = row // GROUP * GROUP
        h = tl.minimum(T - r0, GROUP)
        q = pid - r0 * (r0 + 1) // 2
        full = h * r0
        a, b = _tile(tl.maximum(q - full, 0))
        in_full = q < full
        return tl.where(in_full, r0 + q % h, r0 + a), tl.where(in_full, q // h, r0 + b)

    @triton.jit
    def _tile_of(pid, M, BLOCK: tl.constexpr, HEIGHT: tl.constexpr, GROUP: tl.constexpr):
        # pid -> (tile row i of HEIGHT * BLOCK rows, tile column j of BLOCK columns): tile
        # row i holds columns j < (i + 1) * HEIGHT, HEIGHT per step of `_grouped_tile`'s
        # triangle (whose row i has i + 1 entries), so the tiles cover each element on or
        # below the diagonal exactly once.
        i, jj = _grouped_tile(pid // HEIGHT, tl.cdiv(M, BLOCK * HEIGHT), GROUP)
        return i, jj * HEIGHT + pid % HEIGHT

    @triton.jit
    def _epilogue(
        acc, i, j, bid, c_ptr, out_ptr, scale_ptr, M, scb, scm, scn, sob, som, son,
        alpha, beta, diag,
        HAS_C: tl.constexpr, SCALE_POWER: tl.constexpr, BLOCK: tl.constexpr,
        HEIGHT: tl.constexpr,
    ):  # fmt: skip
        BLOCK_M: tl.constexpr = BLOCK * HEIGHT
        offs_i = i * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_j = j * BLOCK + tl.arange(0, BLOCK)
        mask = (offs_i[:, None] < M) & (offs_j[None, :] < M)
        # strictly below the diagonal: every element is stored, and mirrored
        below = i * BLOCK_M >= (j + 1) * BLOCK
        acc = acc * alpha
        if HAS_C:
            c_tile = tl.load(
                c_ptr + bid * scb + offs_i[:, None] * scm + offs_j[None, :] * scn,
                mask=mask,
                other=0.0,
            )
            acc = acc + beta * c_tile.to(tl.float32)
        if not below:
            acc = tl.where(offs_i[:, None] == offs_j[None, :], acc + diag, acc)
        if SCALE_POWER > 0:
            s = tl.load(scale_ptr + bid)
            if SCALE_POWER == 2:
                s = s * s
            acc = acc * s
        out = acc.to(out_ptr.dtype.element_ty)
        out_base = out_ptr + bid * sob
        out_ptrs = out_base + offs_i[:, None] * som + offs_j[None, :] * son
        mirror_ptrs = out_base + offs_j[:, None] * som + offs_i[None, :] * son
        mask_t = (offs_j[:, None] < M) & (offs_i[None, :] < M)
        # Each branch stores with masks it builds itself: a mask merged from branches loses
        # the compiler's contiguity facts and the stores go scalar (`bench.sym_kernel`).
        # x_p . y_q and x_q . y_p round differently unless y is x, so on the diagonal
        # only the lower triangle (p >= q, what tiles below it hold) is kept and mirrored.
        if below:
            tl.store(out_ptrs, out, mask=mask)
            tl.store(mirror_ptrs, tl.trans(out), mask=mask_t)
        elif HEIGHT == 1:  # the square diagonal tile: its lower triangle and its mirror
            out = tl.where(offs_i[:, None] >= offs_j[None, :], out, tl.trans(out))
            tl.store(out_ptrs, out, mask=mask)
        else:  # a tall tile across the diagonal: elements on or below it, then their mirrors
            tl.store(out_ptrs, out, mask=mask & (offs_i[:, None] >= offs_j[None, :]))
            upper = offs_i[None, :] > offs_j[:, None]
            tl.store(mirror_ptrs, tl.trans(out), mask=mask_t & upper)

    @triton.jit
    def _sym_kernel(
        x_ptr, y_ptr, c_ptr, out_ptr, scale_ptr, M, K,
        sxb, sxm, sxk, syb, sym, syk, scb, scm, scn, sob, som, son,
        alpha, beta, diag,
        HAS_C: tl.constexpr, SCALE_POWER: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, GROUP: tl.constexpr,
        HEIGHT: tl.constexpr,
    ):  # fmt: skip
        BLOCK_M: tl.constexpr = BLOCK * HEIGHT
        i, j = _tile_of(tl.program_id(0), M, BLOCK, HEIGHT, GROUP)
        bid = tl.program_id(1).to(tl.int64)
        # Rows past M wrap (their outputs are masked at the store): no load masks on M.
        rows_i = (i * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        rows_j = (j * BLOCK + tl.arange(0, BLOCK)) % M
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + bid * sxb + rows_i[:, None] * sxm + offs_k[None, :] * sxk
        b_ptrs = y_ptr + bid * syb + rows_j[:, None] * sym + offs_k[None, :] * syk
        acc = tl.zeros((BLOCK_M, BLOCK), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_mask = offs_k[None, :] < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_mask, other=0.0)
                b = tl.load(b_ptrs, mask=k_mask, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * syk
        _epilogue(
            acc, i, j, bid, c_ptr, out_ptr, scale_ptr, M, scb, scm, scn, sob, som, son,
            alpha, beta, diag, HAS_C, SCALE_POWER, BLOCK, HEIGHT,
        )  # fmt: skip

    @triton.jit
    def _sym_kernel_tma(
        x_desc, y_desc, c_ptr, out_ptr, scale_ptr, M, K,
        scb, scm, scn, sob, som, son,
        alpha, beta, diag,
        HAS_C: tl.constexpr, SCALE_POWER: tl.constexpr, BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, GROUP: tl.constexpr, HEIGHT: tl.constexpr,
    ):  # fmt: skip
        # x_desc and y_desc view the batch as (batch * M, K): rows past a matrix's M read
        # the next matrix (or TMA's zero fill) and only reach masked outputs; K is zero-filled.
        i, j = _tile_of(tl.program_id(0), M, BLOCK, HEIGHT, GROUP)
        bid = tl.program_id(1).to(tl.int64)
        row_i = (bid * M + i * BLOCK * HEIGHT).to(tl.int32)
        row_j = (bid * M + j * BLOCK).to(tl.int32)
        acc = tl.zeros((BLOCK * HEIGHT, BLOCK), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([row_i, k * BLOCK_K])
            b = y_desc.load([row_j, k * BLOCK_K])
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
        _epilogue(
            acc, i, j, bid, c_ptr, out_ptr, scale_ptr, M, scb, scm, scn, sob, som, son,
            alpha, beta, diag, HAS_C, SCALE_POWER, BLOCK, HEIGHT,
        )  # fmt: skip

    @triton.jit
    def _normalize_kernel(
        x_ptr, out_ptr, norm_ptr, M, N, sxb, sxm, sxn, sob, som, son,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One tile of one matrix: x / norm in fp32 (correctly rounded, as torch's division),
        # rounded once to out's dtype. Strides of 1 are specialized, so a transposed x is
        # read along its storage and written along out's.
        tiles_n = tl.cdiv(N, BLOCK_N)
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x_ptrs = x_ptr + bid * sxb + offs_m[:, None] * sxm + offs_n[None, :] * sxn
        v = tl.math.div_rn(tl.load(x_ptrs, mask=mask).to(tl.float32), tl.load(norm_ptr + bid))
        out_ptrs = out_ptr + bid * sob + offs_m[:, None] * som + offs_n[None, :] * son
        tl.store(out_ptrs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton path takes bfloat16 or float16 but got: {x.dtype}")
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"the Triton path needs a CUDA tensor (or TRITON_INTERPRET=1): {x.device}")
    if not available():
        raise RuntimeError("the Triton Newton-Schulz path needs triton, which is not importable")
    if x.ndim >= 2 and not _fits_int32(x):
        raise ValueError(
            f"the Triton path takes matrices of at most 2**31 - 1 elements: {tuple(x.shape)}; "
            "use the torch path"
        )


@dataclass(frozen=True)
class _SymLaunch:
    """A `sym_matmul` launch of checked (batch, m, k) operands: the configuration, grid
    and upcast, worked out once for every product of one Newton-Schulz call (each costs
    host time at every launch, which the overlapped step pays on the forward's path)."""

    m: int
    k: int
    cfg: SymConfig
    grid: tuple[int, int]
    upcast: bool

    @classmethod
    def of(cls, batch: int, m: int, k: int, config: SymConfig | str | None) -> _SymLaunch:
        cfg = CONFIGS[config] if isinstance(config, str) else config or config_for(m, k)
        rows = -(-m // (cfg.block * cfg.height))  # tile rows of `_tile_of`
        grid = (cfg.height * rows * (rows + 1) // 2, batch)
        # Triton 3.6's interpreter multiplies bf16 dot operands as raw bits: upcast there.
        return cls(m, k, cfg, grid, _interpreting())

    def descriptors(self, x: Tensor, y: Tensor) -> tuple[Any, Any] | None:
        """TMA descriptors of x and y (x: one for both, where it can), or None where the
        pointer kernel runs: no TMA configuration, or operands TMA cannot address (it
        needs contiguous operands with 16-byte aligned rows and base addresses)."""
        cfg, (batch, m, k) = self.cfg, x.shape
        dense = (
            x.is_contiguous()
            and y.is_contiguous()
            and (k * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0
            and y.data_ptr() % 16 == 0
        )
        if not (cfg.tma and dense):
            return None
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(
            x.view(batch * m, k), [cfg.height * cfg.block, cfg.block_k]
        )
        if y is x and cfg.height == 1:
            return x_desc, x_desc
        return x_desc, TensorDescriptor.from_tensor(y.view(batch * m, k), [cfg.block, cfg.block_k])

    def __call__(
        self,
        x: Tensor,
        y: Tensor,
        c: Tensor | None,
        out: Tensor,
        scale: Tensor | None,
        scale_power: int,
        alpha: float,
        beta: float,
        diag: float,
        descriptors: tuple[Any, Any] | None,
    ) -> None:
        """out = `sym_matmul(x, c, alpha, beta, y=y, diag=diag, scale=scale, ...)`;
        `descriptors`: `self.descriptors(x, y)`, made once per buffer by a caller that
        launches on the same buffers again."""
        cfg, m, k = self.cfg, self.m, self.k
        has_c = c is not None
        cc = c if has_c else out  # never read when HAS_C is False
        power = 0 if scale is None else scale_power
        scale_arg = out if scale is None else scale  # never read when SCALE_POWER is 0
        scalars = (float(alpha), float(beta), float(diag))
        if descriptors is not None:
            _sym_kernel_tma[self.grid](
                *descriptors, cc, out, scale_arg, m, k, *cc.stride(), *out.stride(), *scalars,
                HAS_C=has_c, SCALE_POWER=power, BLOCK=cfg.block, BLOCK_K=cfg.block_k,
                UPCAST=self.upcast, GROUP=cfg.group, HEIGHT=cfg.height,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
        else:
            _sym_kernel[self.grid](
                x, y, cc, out, scale_arg, m, k, *x.stride(), *y.stride(), *cc.stride(),
                *out.stride(), *scalars,
                HAS_C=has_c, SCALE_POWER=power, EVEN_K=k % cfg.block_k == 0, BLOCK=cfg.block,
                BLOCK_K=cfg.block_k, UPCAST=self.upcast, GROUP=cfg.group, HEIGHT=cfg.height,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip


def sym_matmul(
    x: Tensor,
    c: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    y: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
    out: Tensor | None = None,
    config: SymConfig | str | None = None,
) -> Tensor:
    """`s**scale_power * (alpha * x @ y^T + beta * c + diag * I)`, fp32 accumulation.

    x and y (default: x) have shape (m, k) or (batch, m, k), any strides (a transposed
    view is read in place). Only the lower-triangular output tiles are computed and
    mirrored, so `x @ y^T` must be symmetric in exact arithmetic: y = x; y = x S for a
    symmetric S (x S x^T; Gram Newton-Schulz's P (P R)^T); or x and y symmetric matrices
    that commute (for symmetric y, `x @ y^T` is `x @ y`). `scale`, when given, is a
    float32 tensor with one `s` per matrix of the batch (else s = 1); `scale_power` is 1
    or 2. `c`, when given, must be symmetric (only its lower triangle is read). The
    epilogue runs in fp32 and rounds once; the result has x's dtype and is exactly
    symmetric (its lower triangle, mirrored). `out` must not overlap x, y or c.
    """
    _check(x)
    same = y is None or y is x  # one operand (one TMA descriptor)
    if x.ndim not in (2, 3):
        raise ValueError(f"sym_matmul takes (m, k) or (batch, m, k) but got: {tuple(x.shape)}")
    if not same and (y.shape != x.shape or y.dtype != x.dtype or y.device != x.device):
        raise ValueError(
            f"y must have x's shape, dtype and device {tuple(x.shape)} {x.dtype} {x.device} "
            f"but has: {tuple(y.shape)} {y.dtype} {y.device}"
        )
    squeeze = x.ndim == 2
    if squeeze:
        x = x.unsqueeze(0)
        y = None if same else y.unsqueeze(0)
        c = None if c is None else c.unsqueeze(0)
        out = None if out is None else out.unsqueeze(0)
    y = x if same else y
    batch, m, k = x.shape
    if out is None:
        out = torch.empty(batch, m, m, device=x.device, dtype=x.dtype)
    if out.shape != (batch, m, m) or (c is not None and c.shape != (batch, m, m)):
        raise ValueError("out and c must have shape (batch, m, m)")
    if scale is not None and (
        scale.shape != (batch,) or scale.dtype != torch.float32 or not scale.is_contiguous()
    ):
        raise ValueError(f"scale must be a contiguous float32 tensor of shape ({batch},)")
    if scale_power not in (1, 2):
        raise ValueError(f"scale_power should be 1 or 2 but is: {scale_power}")
    launch = _SymLaunch.of(batch, m, k, config)
    launch(x, y, c, out, scale, scale_power, alpha, beta, diag, launch.descriptors(x, y))
    return out.squeeze(0) if squeeze else out


def _oriented(x: Tensor) -> tuple[Tensor, bool, bool]:
    """x as (batch, m, n) with m <= n (a view), and whether it was tall / 2-D."""
    _check(x)
    if x.ndim not in (2, 3):
        raise ValueError(f"zeropower takes (rows, cols) or (batch, rows, cols): {tuple(x.shape)}")
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    squeeze = x.ndim == 2
    return (x.unsqueeze(0) if squeeze else x), tall, squeeze


def _restored(x: Tensor, tall: bool, squeeze: bool) -> Tensor:
    if squeeze:
        x = x.squeeze(0)
    return x.mT if tall else x


def zeropower_triton(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    eps: float,
    *,
    dtype: torch.dtype | None = None,
    config: SymConfig | str | None = None,
) -> Tensor:
    """`muon.newton_schulz.zeropower` (standard algorithm) with symmetric products, in
    `dtype` (default: x's).

    Same orientation, norm and schedule as the plain path, regrouped so that no pass
    is spent outside the matrix products: each iteration is

        A = X X^T              sym_matmul(X)
        P = a I + b A + c A A  sym_matmul(A, c=A, alpha=c, beta=b, diag=a)
        X = P X                torch.bmm (cuBLAS, no epilogue, no copy of X)

    In x's dtype the normalization X / ||X|| is folded into the first iteration (A
    scaled by 1/||X||^2 and P by 1/||X|| in their epilogues), so a tall input is read
    through a transposed view and never copied; in another dtype X is normalized and
    cast once (`_normalized`) into the first of the two iterate buffers. Agrees with the
    plain path to rounding (not bitwise). Returns `dtype` (a transposed view for tall x).
    """
    x, tall, squeeze = _oriented(x)
    dtype = x.dtype if dtype is None else dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton path computes in bfloat16 or float16 but got: {dtype}")
    batch, m, n = x.shape
    norm = matrix_norms(x, torch.float32).view(batch)  # one reduction per matrix
    if schedule.norm_scale != 1.0:
        norm = norm * schedule.norm_scale
    norm = norm.clamp(min=eps)
    gram = torch.empty(batch, m, m, device=x.device, dtype=dtype)
    poly = torch.empty_like(gram)
    if dtype == x.dtype:
        inv_norm = norm.reciprocal()
        buffers = [torch.empty(batch, m, n, device=x.device, dtype=dtype) for _ in range(2)]
    else:
        inv_norm = None
        x = _normalized(x, norm, dtype)
        buffers = [torch.empty_like(x), x]  # step 0 writes over the other buffer
    # What the products share, and each buffer's TMA descriptors, made once.
    gram_of, square = _SymLaunch.of(batch, m, n, config), _SymLaunch.of(batch, m, m, config)
    x_descriptors = {t.data_ptr(): gram_of.descriptors(t, t) for t in (x, *buffers)}
    gram_descriptors = square.descriptors(gram, gram)
    for step, (a, b, c) in enumerate(schedule.coefficients):
        scale = inv_norm if step == 0 else None
        gram_of(x, x, None, gram, scale, 2, 1.0, 0.0, 0.0, x_descriptors[x.data_ptr()])
        square(gram, gram, gram, poly, scale, 1, c, b, a, gram_descriptors)
        x = torch.bmm(poly, x, out=buffers[step % 2])
    return _restored(x, tall, squeeze)


# Tiles of the normalize pass: memory-bound, one 64 x 64 tile per program.
NORMALIZE_BLOCK = 64


def _normalized(x: Tensor, norm: Tensor, dtype: torch.dtype) -> Tensor:
    """x / norm per matrix (x: (batch, m, n), any strides; norm: (batch,) float32), computed
    in fp32 and rounded once to `dtype`: the same bits as `torch.div(x, norm, out=...)`
    into a fresh contiguous (batch, m, n) tensor, in one pass (torch's mixed-dtype,
    broadcast division takes its slow generic kernel, and transposes a tall x in it)."""
    batch, m, n = x.shape
    out = torch.empty(batch, m, n, device=x.device, dtype=dtype)
    tiles = -(-m // NORMALIZE_BLOCK) * -(-n // NORMALIZE_BLOCK)
    _normalize_kernel[(tiles, batch)](
        x, out, norm, m, n, *x.stride(), *out.stride(),
        BLOCK_M=NORMALIZE_BLOCK, BLOCK_N=NORMALIZE_BLOCK, num_warps=4,
    )  # fmt: skip
    return out


def zeropower_gram_triton(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    eps: float,
    *,
    dtype: torch.dtype = torch.float16,
    config: SymConfig | str | None = None,
) -> Tensor:
    """Gram Newton-Schulz (`muon.newton_schulz`) in `dtype` with symmetric products.

    X (m x n, m <= n) is normalized and cast once (`_normalized`); per restart segment:

        R = X X^T                  sym_matmul(X)
        P = a I + b R + c R R      sym_matmul(R, c=R, alpha=c, beta=b, diag=a)
        W = P R                    torch.bmm (cuBLAS, both triangles)
        R = P W^T = P R P          sym_matmul(P, y=W, out=R)
        Q = P Q                    torch.bmm (cuBLAS, out=W; Q = P at the segment's first)
        X = Q X                    torch.bmm, once at the segment's end

    P R P is symmetric for any symmetric P and R, so its product computes half the tiles.
    W and Q stay whole products: P, R and Q commute only in exact arithmetic, and
    mirroring one triangle of the rounded P R or P Q turns their rounding-sized
    commutator into an error of the same size that Polar Express's steep first
    polynomial amplifies (TRITON_INTERPRET=1, fp16, 128 x 128: 1.4-2.6x the plain bf16
    path's error against the fp64 iteration with both mirrored, 0.7-1.1x with Q
    mirrored, 0.22-0.35x as here; cuBLAS for both W = R P and P W: 0.25-0.47x).
    R is not updated after a segment's last iteration. a I is added in the fp32 epilogue
    of P's product (rounded once). Writing R's and Q's updates over dead buffers holds at
    most R, Q, P and W, what `muon.newton_schulz.gram_workspace_numel` counts. Returns
    `dtype` (a transposed view for tall x).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton path computes in bfloat16 or float16 but got: {dtype}")
    x, tall, squeeze = _oriented(x)
    norm = matrix_norms(x, torch.float32).view(x.size(0))  # one reduction per matrix
    if schedule.norm_scale != 1.0:
        norm = norm * schedule.norm_scale
    xs = _normalized(x, norm.clamp(min=eps), dtype)
    for segment in schedule.gram_segments():
        r = sym_matmul(xs, config=config)
        q = None
        for k in segment:
            a, b, c = schedule.coefficients[k]
            p = sym_matmul(r, r, alpha=c, beta=b, diag=a, config=config)
            w = None
            if k == segment[-1]:
                del r
            else:  # P (P R)^T, not R P^2: P^2 rounded to 16 bits swamps P's small end
                w = torch.bmm(p, r)
                sym_matmul(p, y=w, out=r, config=config)
            q = p if q is None else torch.bmm(p, q, out=w)
            del p, w
        xs = torch.bmm(q, xs)
        del q
    return _restored(xs, tall, squeeze)
