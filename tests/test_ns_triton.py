"""The Triton Newton-Schulz path (muon/ns_triton.py) and the backend dispatch.

- dispatch tests run everywhere (CPU "auto" never leaves the plain path);
- interpreter tests run the kernels on CPU tensors under TRITON_INTERPRET=1; without
  that variable one test re-runs this file in a subprocess with it set (skipped
  where triton is missing), since triton reads it when the kernels are decorated;
- `gpu` tests compare against an fp64 reference on a CUDA device.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import (
    HAVE_TRITON,
    INTERPRET,
    interp,
    rerun_under_interpreter,
    runs_interpreter,
)

from muon.newton_schulz import get_backend, set_backend, zeropower
from muon.ns_schedules import SCHEDULES, NewtonSchulzSchedule


def _fp64_reference(x: torch.Tensor, schedule: NewtonSchulzSchedule) -> torch.Tensor:
    return zeropower(x.double(), schedule, backend="torch", algorithm="standard")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- dispatch (everywhere) ------------------------------------------------------------------------


def _muon_reference(x: torch.Tensor, schedule: NewtonSchulzSchedule, eps: float) -> torch.Tensor:
    """torch.optim.Muon's iteration (REFERENCE.md), one 2-D matrix at a time, any schedule."""
    results = []
    for m in x.reshape(-1, *x.shape[-2:]):
        tall = m.size(0) > m.size(1)
        m = m.T if tall else m
        m = m / (m.norm() * schedule.norm_scale).clamp(min=eps)
        for a, b, c in schedule.coefficients:
            gram = m @ m.T
            m = torch.addmm(m, torch.addmm(gram, gram, gram, beta=b, alpha=c), m, beta=a)
        results.append(m.T if tall else m)
    return torch.stack(results).reshape(x.shape)


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (24, 72)])
def test_cpu_auto_is_torch_muons_iteration_bitwise(shape):
    # on CPU, the default and "auto" backends and algorithms are torch.optim.Muon's
    # arithmetic, bit for bit, for every schedule (aspect 3: Gram on CUDA, not here)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    for schedule in SCHEDULES.values():
        ref = _muon_reference(x, schedule, 1e-7)
        assert torch.equal(zeropower(x, schedule), ref)
        assert torch.equal(zeropower(x, schedule, backend="auto", algorithm="auto"), ref)


def test_backend_setting():
    assert get_backend() in ("auto", "torch", "triton")
    previous = set_backend("torch")
    try:
        assert get_backend() == "torch"
        with pytest.raises(ValueError):
            set_backend("cutlass")
    finally:
        set_backend(previous)
    with pytest.raises(ValueError):
        zeropower(torch.randn(4, 8), SCHEDULES["keller_jordan"], backend="nope")


def test_sym_config_names_the_launch_order():
    # the bench and `config_for` select configs by name: the band height is part of it
    from muon.ns_triton import CONFIGS, LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG, SymConfig

    assert SymConfig(128, 64, 4, 3, group=1).name == "b128k64w4s3g1"
    assert SymConfig(128, 64, 8, 3, tma=True, group=16).name == "b128k64w8s3g16tma"
    assert SymConfig(128, 64, 8, 3, height=2).name == "b256x128k64w8s3g1"
    assert all(name == cfg.name for name, cfg in CONFIGS.items())
    assert {cfg.group for cfg in CONFIGS.values()} >= {1, 4, 8, 16}
    assert {LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG} <= set(CONFIGS)
    with pytest.raises(ValueError, match="group"):
        SymConfig(128, 64, 4, 3, group=0)
    with pytest.raises(ValueError, match="height"):
        SymConfig(128, 64, 4, 3, height=0)


@runs_interpreter
def test_interpreter_subprocess():
    rerun_under_interpreter(__file__)


# -- interpreter (CPU tensors, TRITON_INTERPRET=1) ------------------------------------------------


def _interp_configs():
    from muon.ns_triton import SymConfig

    return [
        SymConfig(16, 16, 4, 2),
        SymConfig(16, 32, 4, 2, tma=True),
        SymConfig(16, 16, 4, 2, height=2),
        SymConfig(16, 32, 4, 2, tma=True, height=2, group=2),
    ]


# The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): 1 ulp.
BF16_ULP = 2.0**-7


@interp
@pytest.mark.parametrize("shape", [(40, 72), (3, 37, 50), (2, 32, 64), (1, 17, 8)])
def test_interp_sym_matmul(shape):
    from muon.ns_triton import sym_matmul

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).bfloat16()
    ref = x.float() @ x.float().mT
    for config in _interp_configs():
        out = sym_matmul(x, config=config)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        assert torch.equal(out, out.mT)
        torch.testing.assert_close(out.float(), ref, rtol=BF16_ULP, atol=1e-3)


@interp
@pytest.mark.parametrize("shape", [(3, 37, 37), (40, 40)])
def test_interp_sym_matmul_epilogue(shape):
    from muon.ns_triton import sym_matmul

    gen = torch.Generator().manual_seed(1)
    g = torch.randn(*shape, generator=gen)
    a = ((g + g.mT) / shape[-1]).bfloat16()  # symmetric
    alpha, beta = 2.0315, -4.7750
    ref = beta * a.float() + alpha * (a.float() @ a.float())
    for config in _interp_configs():
        out = sym_matmul(a, a, alpha=alpha, beta=beta, config=config)
        assert torch.equal(out, out.mT)
        tol = 2 * BF16_ULP * ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, rtol=BF16_ULP, atol=tol)


@interp
@pytest.mark.parametrize("scale_power", [1, 2])
def test_interp_sym_matmul_diag_and_scale(scale_power):
    # s**p * (alpha x x^T + beta c + diag I), one s per matrix, x read through a transposed view
    from muon.ns_triton import sym_matmul

    gen = torch.Generator().manual_seed(4)
    stored = torch.randn(3, 50, 37, generator=gen).bfloat16()
    x = stored.mT  # (3, 37, 50), not contiguous
    g = torch.randn(3, 37, 37, generator=gen)
    c = ((g + g.mT) / 2).bfloat16()
    scale = torch.tensor([0.5, 2.0, 0.125])
    alpha, beta, diag = 0.75, -1.5, 3.4445
    eye = torch.eye(37)
    s = scale.view(3, 1, 1) ** scale_power
    ref = s * (alpha * (x.float() @ x.float().mT) + beta * c.float() + diag * eye)
    for config in _interp_configs():
        out = sym_matmul(
            x, c, alpha=alpha, beta=beta, diag=diag, scale=scale, scale_power=scale_power,
            config=config,
        )  # fmt: skip
        assert torch.equal(out, out.mT)
        tol = 2 * BF16_ULP * ref.abs().amax(dim=(-2, -1), keepdim=True)
        assert ((out.float() - ref).abs() <= tol).all()
    with pytest.raises(ValueError, match="scale"):
        sym_matmul(x, scale=scale.double())
    with pytest.raises(ValueError, match="scale_power"):
        sym_matmul(x, scale=scale, scale_power=3)


@interp
def test_interp_rejects_matrices_past_int32_offsets():
    from muon.ns_triton import sym_matmul, zeropower_triton

    huge = torch.empty(1, dtype=torch.bfloat16).expand(2**16, 2**15 + 1)  # no memory
    with pytest.raises(ValueError, match="2\\*\\*31"):
        sym_matmul(huge)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        zeropower_triton(huge, SCHEDULES["keller_jordan"], 1e-7)


@interp
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (2, 20, 36)])
def test_interp_zeropower(name, shape):
    # fp16 (the interpreter rounds it to nearest, as the GPU does): as accurate as the plain path
    from muon.ns_triton import SymConfig, zeropower_triton

    schedule = SCHEDULES[name]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=gen).half()
    fast = zeropower_triton(x, schedule, 1e-7, config=SymConfig(16, 16, 4, 2))
    assert fast.shape == x.shape and fast.dtype == torch.float16
    plain = zeropower(x, schedule, backend="torch")
    ref = _fp64_reference(x, schedule)
    assert _rel(fast, ref) <= 1.1 * _rel(plain, ref) + 1e-3
    assert _rel(fast, plain) <= 5e-3


@interp
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_interp_zeropower_bf16_dispatch(name):
    # bf16 through zeropower(backend="triton"): normalized and cast to fp16 (`_normalized`),
    # iterated in fp16 as on the GPU (`ns_path`), the result cast back. Measured here:
    # 0.18-0.33x the plain bf16 path's error against the fp64 iteration
    from muon.newton_schulz import path_for

    schedule = SCHEDULES[name]
    x = torch.randn(2, 20, 36, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert path_for(x, "triton").dtype == torch.float16
    fast = zeropower(x, schedule, backend="triton")
    assert fast.dtype == torch.bfloat16
    plain = zeropower(x, schedule, backend="torch")
    ref = _fp64_reference(x, schedule)
    assert _rel(fast, ref) <= 0.5 * _rel(plain, ref), (_rel(fast, ref), _rel(plain, ref))


@interp
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", [(48, 20), (20, 48), (3, 24, 40)])
def test_interp_zeropower_gram(name, shape):
    # Gram Newton-Schulz in fp16 on the symmetric kernels: more accurate than the plain
    # bf16 standard path against the fp64 iteration (issue 11's bar is 1.0x; measured here,
    # seeds 9 and 1: at most 0.23x, main's cuBLAS products 0.27x), close to plain Gram
    from muon.ns_triton import SymConfig, zeropower_gram_triton

    schedule = SCHEDULES[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9)).half()
    fast = zeropower_gram_triton(x, schedule, 1e-7, config=SymConfig(16, 16, 4, 2))
    assert fast.shape == x.shape and fast.dtype == torch.float16
    ref = _fp64_reference(x, schedule)
    plain = zeropower(x.bfloat16(), schedule, backend="torch", algorithm="standard")
    assert _rel(fast, ref) <= 0.5 * _rel(plain, ref), (_rel(fast, ref), _rel(plain, ref))
    gram16 = zeropower(x, schedule, backend="torch", algorithm="gram")
    assert _rel(fast, gram16) <= 1e-2
    # through the dispatch (its own config): forced Triton, Gram, in the input's dtype
    out = zeropower(x, schedule, backend="triton", algorithm="gram")
    assert out.dtype == torch.float16 and _rel(out, ref) <= 0.5 * _rel(plain, ref)


@interp
@pytest.mark.parametrize("seed", [9, 1])
def test_interp_gram_square_polar_express(seed):
    # where rounding-sized commutators hurt most (square: small singular values; Polar
    # Express: a steep first polynomial). Measured here, error / plain bf16 standard's:
    # 0.22 and 0.35 as built (cuBLAS P R and P Q, symmetric P (P R)^T); 0.7-1.1 with
    # P Q mirrored from one triangle, 1.4-2.6 with P R mirrored too; main's all-cuBLAS
    # products 0.25-0.47. The bar is 1.0 (issue 11); 0.5 catches a mirrored P Q.
    from muon.ns_triton import SymConfig, zeropower_gram_triton

    schedule = SCHEDULES["polar_express"]
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed)).half()
    fast = zeropower_gram_triton(x, schedule, 1e-7, config=SymConfig(16, 16, 4, 2))
    ref = _fp64_reference(x, schedule)
    plain = zeropower(x.bfloat16(), schedule, backend="torch", algorithm="standard")
    assert _rel(fast, ref) <= 0.5 * _rel(plain, ref), (_rel(fast, ref), _rel(plain, ref))


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 70, 45), (2, 45, 70), (130, 66)])
def test_interp_normalized_is_torch_division_bitwise(shape, dtype):
    # the Gram path's normalize pass: torch.div's bits (fp32 quotient, rounded once) into a
    # contiguous (batch, m, n) tensor; a tall input is read through its transposed view.
    # Shapes are not multiples of the 64-tile (masks); norms span magnitudes. fp16 out (what
    # the Gram path computes in) bitwise; bf16 out within the interpreter's truncation.
    from muon.ns_triton import _normalized, _oriented

    gen = torch.Generator().manual_seed(14)
    x = (torch.randn(*shape, generator=gen) * 3.0).to(dtype)
    view, tall, _ = _oriented(x)
    assert tall == (shape[-2] > shape[-1])
    norm = torch.tensor([0.37, 1e3, 2.5e-3])[: view.size(0)]
    for out_dtype in (torch.float16, torch.bfloat16):
        out = _normalized(view, norm, out_dtype)
        expected = torch.empty(view.shape, dtype=out_dtype)
        torch.div(view, norm.view(-1, 1, 1), out=expected)
        assert out.is_contiguous() and out.dtype == out_dtype
        if out_dtype == torch.float16:
            assert torch.equal(out, expected), (shape, dtype)
        else:
            exact = view.float() / norm.view(-1, 1, 1)
            assert ((out.float() - exact).abs() <= BF16_ULP * exact.abs()).all(), (shape, dtype)


def _zeropower_by_public_sym_matmul(x, schedule, eps, dtype, config):
    """zeropower_triton's iteration written with public `sym_matmul` calls, each checking
    its operands and making its own TMA descriptors (what zeropower_triton did before it
    made them once per call)."""
    from muon.ns_schedules import matrix_norms
    from muon.ns_triton import _normalized, _oriented, _restored, sym_matmul

    x, tall, squeeze = _oriented(x)
    norm = matrix_norms(x, torch.float32).view(x.size(0)) * schedule.norm_scale
    norm = norm.clamp(min=eps)
    inv_norm = norm.reciprocal() if dtype == x.dtype else None
    if inv_norm is None:
        x = _normalized(x, norm, dtype)
    for step, (a, b, c) in enumerate(schedule.coefficients):
        scale = inv_norm if step == 0 else None
        gram = sym_matmul(x, scale=scale, scale_power=2, config=config)
        poly = sym_matmul(gram, gram, alpha=c, beta=b, diag=a, scale=scale, config=config)
        x = torch.bmm(poly, x)
    return _restored(x, tall, squeeze)


def _check_zeropower_launches_once(device, configs):
    from muon.ns_triton import zeropower_triton

    schedule = SCHEDULES["polar_express"]
    gen = torch.Generator().manual_seed(4)
    for shape in [(40, 72), (72, 40), (3, 33, 64)]:
        for dtype in (torch.float16, torch.bfloat16):  # bf16: normalized into fp16 first
            x = torch.randn(*shape, generator=gen).to(device, dtype)
            for config in configs:
                fast = zeropower_triton(x, schedule, 1e-7, dtype=torch.float16, config=config)
                ref = _zeropower_by_public_sym_matmul(x, schedule, 1e-7, torch.float16, config)
                assert torch.equal(fast, ref), (shape, dtype, config)


@interp
def test_interp_zeropower_is_its_products_launched_one_by_one():
    _check_zeropower_launches_once("cpu", _interp_configs())


@interp
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_interp_batch_invariant(algorithm):
    # a matrix's result is the same bits whatever shares its batch (what the Triton paths
    # keep and their peak: test_gpu_keeps_nothing; under the interpreter, its own copies of
    # the kernel arguments would be counted)
    schedule = SCHEDULES["deepseek_v4"]
    x = torch.randn(5, 20, 44, generator=torch.Generator().manual_seed(10)).half()
    alone = zeropower(x[2:3], schedule, backend="triton", algorithm=algorithm)[0]
    assert torch.equal(zeropower(x, schedule, backend="triton", algorithm=algorithm)[2], alone)
    assert torch.equal(zeropower(x[1:], schedule, backend="triton", algorithm=algorithm)[1], alone)


def _grouped_order(tiles: int, group: int) -> list[tuple[int, int]]:
    """The launch order `_grouped_tile` promises: bands of `group` tile rows; in a band,
    the full columns j < r0 column-major, then the band's own triangle row-major."""
    order = []
    for r0 in range(0, tiles, group):
        rows = range(r0, min(tiles, r0 + group))
        order += [(i, j) for j in range(r0) for i in rows]
        order += [(i, j) for i in rows for j in range(r0, i + 1)]
    return order


if INTERPRET and HAVE_TRITON:
    import triton
    import triton.language as tl

    from muon.ns_triton import _grouped_tile

    @triton.jit
    def _tile_order_kernel(out_ptr, count, T, GROUP: tl.constexpr, N: tl.constexpr):
        # every launch index at once (`_grouped_tile` is elementwise)
        lanes = tl.arange(0, N)
        i, j = _grouped_tile(tl.minimum(lanes, count - 1), T, GROUP)
        tl.store(out_ptr + 2 * lanes, i, mask=lanes < count)
        tl.store(out_ptr + 2 * lanes + 1, j, mask=lanes < count)


@interp
@pytest.mark.parametrize(
    "tiles,group",
    [(1, 1), (6, 1), (7, 2), (7, 3), (9, 4), (9, 8), (5, 16), (33, 8), (130, 16), (200, 1)],
)
def test_interp_grouped_tile_order(tiles, group):
    # the kernels' launch index -> tile map: every lower tile exactly once, in the banded
    # order; group 1 is the row-major order the kernels used before bands
    count = tiles * (tiles + 1) // 2
    out = torch.full((count, 2), -1, dtype=torch.int32)
    _tile_order_kernel[(1,)](out, count, tiles, GROUP=group, N=triton.next_power_of_2(count))
    order = [tuple(t) for t in out.tolist()]
    assert order == _grouped_order(tiles, group)
    assert sorted(order) == [(i, j) for i in range(tiles) for j in range(i + 1)]
    if group == 1:
        assert order == [(i, j) for i in range(tiles) for j in range(i + 1)]


def _commuting_pair(batch: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric x and y = 0.5 x - 0.8 x^2 (fp64, exactly symmetric), scaled to |entries| <~ 1."""
    g = torch.randn(batch, m, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = (g + g.mT) / (2 * m**0.5)
    y = 0.5 * x - 0.8 * (x @ x)
    return x, (y + y.mT) / 2


def _lower_mirrored(a: torch.Tensor) -> torch.Tensor:
    return a.tril() + a.tril(-1).mT


@interp
def test_interp_sym_matmul_two_operands():
    # x @ y^T for commuting symmetric x, y in fp16 (M = 53: not a multiple of the 16-tile;
    # 4 tile rows, so group 2 runs a band in the grouped order): the lower triangle of the
    # fp64 product, mirrored, each element rounded once; exactly symmetric; every element
    # written (out starts as NaN); the epilogue on top (c = y, scale, diag)
    from muon.ns_triton import SymConfig, sym_matmul

    x64, y64 = _commuting_pair(3, 53, seed=11)
    x, y = x64.half(), y64.half()
    ref = _lower_mirrored(x.double() @ y.double().mT)
    ulp = 2.0**-10
    scale = torch.tensor([0.5, 2.0, 0.25])
    alpha, beta, diag = -1.25, 0.75, 2.5
    ref_epi = scale.view(3, 1, 1).double() ** 2 * (
        alpha * ref + beta * y.double() + diag * torch.eye(53, dtype=torch.float64)
    )
    configs = [
        SymConfig(16, 16, 4, 2, group=1),
        SymConfig(16, 32, 4, 2, tma=True, group=2),
        SymConfig(16, 16, 4, 2, height=2),  # 2 tile rows of 32: the last one partly past M
        SymConfig(16, 16, 4, 2, tma=True, height=2),
    ]
    for config in configs:
        out = sym_matmul(x, y=y, out=torch.full_like(x, float("nan")), config=config)
        assert torch.equal(out, out.mT), config.name
        torch.testing.assert_close(out.double(), ref, rtol=ulp, atol=1e-4, msg=config.name)
        # the same operand given twice (separate tensor: a second TMA descriptor) is x @ x^T
        assert torch.equal(sym_matmul(x, y=x.clone(), config=config), sym_matmul(x, config=config))
        out = sym_matmul(
            x, y, alpha=alpha, beta=beta, y=y, diag=diag, scale=scale, scale_power=2,
            out=torch.full_like(x, float("nan")), config=config,
        )  # fmt: skip
        assert torch.equal(out, out.mT), config.name
        tol = 2 * ulp * ref_epi.abs().amax(dim=(-2, -1), keepdim=True)
        assert ((out.double() - ref_epi).abs() <= tol).all(), config.name
    # 2-D, y through a transposed view (other strides than x's): x @ y^T with y = x's values
    x2 = torch.randn(37, 50, generator=torch.Generator().manual_seed(12)).half()
    out = sym_matmul(x2, y=x2.mT.contiguous().mT, config=configs[1])
    assert out.shape == (37, 37) and torch.equal(out, sym_matmul(x2, config=configs[1]))
    with pytest.raises(ValueError, match="y must have"):
        sym_matmul(x, y=y[:, :, :50])
    with pytest.raises(ValueError, match="y must have"):
        sym_matmul(x, y=y.float())


# -- GPU ------------------------------------------------------------------------------------------

GPU_SHAPES = {
    "tall": (2048, 768),
    "wide": (768, 2048),
    "square": (1024, 1024),
    "batched": (4, 640, 1280),
    "batched_tall_ragged": (3, 1000, 300),
    "large": (2048, 4096),  # `LARGE_CONFIG`
}


def _gpu_input(shape, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).bfloat16()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", sorted(GPU_SHAPES))
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_fp64_reference(kind, name):
    schedule = SCHEDULES[name]
    x = _gpu_input(GPU_SHAPES[kind])
    ref = _fp64_reference(x, schedule)
    plain = zeropower(x, schedule, backend="torch", algorithm="standard")
    fast = zeropower(x, schedule, backend="triton", algorithm="standard")
    assert fast.shape == x.shape and fast.dtype == torch.bfloat16
    err_plain, err_fast = _rel(plain, ref), _rel(fast, ref)
    assert err_fast <= 1.1 * err_plain + 2e-3, (err_fast, err_plain)
    # fast == plain within bf16 tolerance
    assert _rel(fast, plain) <= 2.5e-2
    # singular values in the same band as the plain path's
    sv_plain = torch.linalg.svdvals(plain.float())
    sv_fast = torch.linalg.svdvals(fast.float())
    assert abs(sv_fast.max().item() - sv_plain.max().item()) <= 0.05
    assert abs(sv_fast.min().item() - sv_plain.min().item()) <= 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_zeropower_is_its_products_launched_one_by_one():
    from muon.ns_triton import CONFIGS, LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG

    # The defaults and the tall tiles, pointer and TMA: every config compiles its kernels
    # for each case, and all 23 took more than 400 s on an H200.
    names = [LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG, "b256x128k64w8s3g1", "b256x128k64w8s3g8tma"]
    _check_zeropower_launches_once("cuda", [CONFIGS[name] for name in names])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_dense_input_at_an_unaligned_address():
    # A contiguous matrix 2 bytes into its storage (a view into a flat buffer) takes the
    # pointer kernel: a TMA descriptor needs a 16-byte aligned base (it failed an assert).
    from muon.ns_triton import LARGE_CONFIG, sym_matmul

    flat = _gpu_input((2048 * 256 + 8,), seed=5)
    aligned = flat[8:].view(2048, 256)
    shifted = flat[1 : 1 + 2048 * 256].view(2048, 256)
    ref = sym_matmul(shifted.clone(), config=LARGE_CONFIG)
    assert torch.equal(sym_matmul(shifted, config=LARGE_CONFIG), ref)
    assert torch.equal(sym_matmul(aligned, config=LARGE_CONFIG), sym_matmul(aligned.clone()))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_every_config():
    # Each config is correct and computes the default config's bits: a configuration is a
    # choice of speed, never of result (bench.sym_kernel's `bits` column says the same).
    import triton.runtime.errors

    from muon.ns_triton import CONFIGS, LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG, sym_matmul

    # two commuting symmetric operands (c = y): the lower triangle, mirrored
    xs, ys = (t.cuda().half() for t in _commuting_pair(2, 640, seed=13))
    ref2 = _lower_mirrored(xs.double() @ ys.double()) + 0.75 * ys.double()
    for shape in [(2, 640, 1000), (1024, 4096)]:
        x = _gpu_input(shape, seed=3)
        ref = (x.float() @ x.float().mT).to(torch.bfloat16)
        a = (ref.float() / ref.float().abs().max()).bfloat16()
        ref_b = (-4.775 * a.float() + 2.0315 * (a.float() @ a.float())).bfloat16()
        default = (
            sym_matmul(x),
            sym_matmul(a, a, alpha=2.0315, beta=-4.775),
            sym_matmul(xs, ys, beta=0.75, y=ys),
        )
        for cfg in CONFIGS.values():
            try:
                out = sym_matmul(x, config=cfg)
            except triton.runtime.errors.OutOfResources:
                # a candidate too big for this GPU's shared memory: never a default
                assert cfg.name not in (LARGE_CONFIG, MEDIUM_CONFIG, SMALL_CONFIG), cfg.name
                continue
            assert torch.equal(out, out.mT), cfg.name
            torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2, msg=cfg.name)
            out_b = sym_matmul(a, a, alpha=2.0315, beta=-4.775, config=cfg)
            torch.testing.assert_close(out_b, ref_b, rtol=1.6e-2, atol=2e-2, msg=cfg.name)
            out2 = sym_matmul(xs, ys, beta=0.75, y=ys, config=cfg)
            assert torch.equal(out2, out2.mT), cfg.name
            torch.testing.assert_close(out2.double(), ref2, rtol=2e-3, atol=1e-4, msg=cfg.name)
            for got, want in zip((out, out_b, out2), default, strict=True):
                assert torch.equal(got, want), cfg.name


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_auto_dispatch_and_muon():
    from muon import Muon
    from muon.newton_schulz import path_for

    small = _gpu_input((256, 512))
    assert path_for(small, "auto").backend == "torch"
    assert path_for(_gpu_input((1024, 2048)), "auto").backend == "triton"
    huge = torch.empty(1, device="cuda", dtype=torch.bfloat16).expand(2**16, 2**15 + 1)
    assert path_for(huge, "auto").backend == "torch"  # past int32 offsets: the plain path
    assert path_for(_gpu_input((1024, 2048)).float(), "auto").backend == "torch"
    # per shape, never per launch: one 1024^2 matrix and 8 of them take the same path
    eight = _gpu_input((8, 1024, 1024))
    assert path_for(eight[:1], "auto") == path_for(eight, "auto")
    schedule = SCHEDULES["keller_jordan"]
    assert torch.equal(zeropower(small, schedule), zeropower(small, schedule, backend="torch"))
    # muon.Muon under the triton backend stays close to the plain one
    shapes = [(1024, 2048), (2048, 1024), (1024, 2048)]
    params = {}
    for backend in ("torch", "triton"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        previous = set_backend(backend)
        try:
            Muon(ps, lr=0.02).step()
        finally:
            set_backend(previous)
        params[backend] = ps
    for p, q in zip(params["torch"], params["triton"], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_normalized_is_torch_division_bitwise():
    # the Gram path's normalize pass (div_rn: correctly rounded, as torch's CUDA division)
    from muon.ns_triton import _normalized, _oriented

    for shape in [(3, 2304, 768), (2, 768, 2304), (1000, 300)]:
        view, _, _ = _oriented(_gpu_input(shape, seed=9))
        norm = torch.linalg.vector_norm(view.float(), dim=(-2, -1))
        expected = torch.empty(view.shape, device="cuda", dtype=torch.float16)
        torch.div(view, norm.view(-1, 1, 1), out=expected)
        assert torch.equal(_normalized(view, norm, torch.float16), expected), shape


GPU_INVARIANCE_SHAPES = [(2048, 2048), (1024, 1024), (768, 2304), (2304, 768), (64, 512), (8, 48)]


@pytest.mark.parametrize("shape", GPU_INVARIANCE_SHAPES)
@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_batch_invariant_bitwise(backend, algorithm, shape):
    # issue 12: a matrix's result is the same bits whatever else shares its launch
    schedule = SCHEDULES["polar_express"]
    mats = _gpu_input((7, *shape), seed=5)
    others = 50 * _gpu_input((12, *shape), seed=6)

    def run(x):
        return zeropower(x, schedule, backend=backend, algorithm=algorithm)

    alone = run(mats[:1])[0]
    for batch in (mats[:3], mats, torch.cat([mats[:1], others]), torch.cat([mats[:1], others[:1]])):
        assert torch.equal(run(batch)[0], alone)
    assert torch.equal(run(mats)[5], run(mats[5:6])[0])


@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_keeps_nothing(backend, algorithm):
    # issue 12: nothing Newton-Schulz allocates outlives the call (no cached workspace)
    import gc

    from muon.newton_schulz import ns_workspace_numel, path_for

    schedule = SCHEDULES["keller_jordan"]
    xs = [_gpu_input(s, seed=7) for s in [(4, 1024, 3072), (2, 3072, 1024), (8, 256, 512)]]
    for x in xs:  # cuBLAS's per-stream workspace, allocated at first use, is not ours
        zeropower(x, schedule, backend=backend, algorithm=algorithm)
    torch.cuda.synchronize()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated()
        for x in xs:
            torch.cuda.reset_peak_memory_stats()
            out = zeropower(x, schedule, backend=backend, algorithm=algorithm)
            assert out.shape == x.shape and out.dtype == x.dtype
            peak = torch.cuda.max_memory_allocated() - before
            del out
            # the peak is the workspace model's, plus the per-matrix norms and the
            # caching allocator's 512-byte rounding (a few KiB)
            path = path_for(x, backend, algorithm)
            model = ns_workspace_numel([x.shape], schedule, lambda r, c, p=path: p)
            assert 0 <= peak - 2 * model <= 64 << 10, (path, peak, 2 * model)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", sorted(GPU_SHAPES))
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_gram_fp16_at_least_as_accurate_as_standard_bf16(kind, name):
    # issue 11: Gram in fp16 (both backends) against the fp64 iteration, vs plain bf16
    schedule = SCHEDULES[name]
    x = _gpu_input(GPU_SHAPES[kind], seed=8)
    ref = _fp64_reference(x, schedule)
    plain = zeropower(x, schedule, backend="torch", algorithm="standard")
    sv_ref = torch.linalg.svdvals(ref.float())
    for backend in ("torch", "triton"):
        gram = zeropower(x, schedule, backend=backend, algorithm="gram")
        assert gram.shape == x.shape and gram.dtype == torch.bfloat16
        assert _rel(gram, ref) <= _rel(plain, ref), (backend, _rel(gram, ref), _rel(plain, ref))
        sv = torch.linalg.svdvals(gram.float())
        assert abs(sv.max().item() - sv_ref.max().item()) <= 0.05, backend
        assert abs(sv.min().item() - sv_ref.min().item()) <= 0.05, backend


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", [(2, 24, 72), (40, 8)])
def test_gram_flops_symmetric_counts_what_the_triton_gram_path_computes(monkeypatch, name, shape):
    """The bench's floor for the Gram path: the products `zeropower_gram_triton` issues,
    counted (stand-ins for its kernels, so it runs without triton), against the formula."""
    from muon import ns_triton
    from muon.newton_schulz import gram_flops_symmetric

    counted = []

    def sym_matmul(x, c=None, alpha=1.0, beta=0.0, *, y=None, diag=0.0, out=None, **_):
        y = x if y is None else y
        *batch, m, k = x.shape
        counted.append(math.prod(batch) * m * m * k)  # half the tiles of x @ y^T
        result = alpha * x.float() @ y.float().mT + (0 if c is None else beta * c.float())
        result = (result + diag * torch.eye(m)).to(x.dtype)
        return result if out is None else out.copy_(result)

    def bmm(a, b, out=None):
        counted.append(2 * a.size(0) * a.size(1) * a.size(2) * b.size(2))
        return torch.matmul(a, b, out=out)

    monkeypatch.setattr(ns_triton, "_check", lambda x: None)
    monkeypatch.setattr(ns_triton, "sym_matmul", sym_matmul)
    monkeypatch.setattr(
        ns_triton, "_normalized", lambda x, norm, dtype: (x / norm.view(-1, 1, 1)).to(dtype)
    )
    monkeypatch.setattr(ns_triton.torch, "bmm", bmm)
    x = torch.randn(*shape).bfloat16()
    ns_triton.zeropower_gram_triton(x, SCHEDULES[name], 1e-7, dtype=torch.bfloat16)
    count = x.size(0) if x.ndim == 3 else 1
    assert sum(counted) == count * gram_flops_symmetric(*shape[-2:], SCHEDULES[name])
