"""The fused elementwise kernels (muon/fused.py) and the elementwise backend switch.

- dispatch tests run everywhere (CPU "auto" stays on the torch ops, never imports muon.fused);
- interpreter tests run the kernels on CPU tensors under TRITON_INTERPRET=1 (one test re-runs
  this file in a subprocess with it set; skipped where triton is missing) and compare with
  the torch ops bit for bit. The interpreter is patched to round as the GPU does: `tl.fma`
  with one rounding (it computes x * y + z with two), fp32 -> bf16 to nearest even (it
  truncates), and float arguments as fp32 (it keeps Python floats);
- `gpu` tests compare the kernels and the Muon step with the torch ops on a CUDA device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from spawn_ranks import run_on_ranks
from triton_interpreter import (
    HAVE_TRITON,
    INTERPRET,
    interp,
    rerun_under_interpreter,
    runs_interpreter,
)

from muon import Muon, elementwise

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton"
)


def _fma_f32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 fma, rounded once: exact product in fp64, the sum rounded to odd, then to fp32."""
    p = x.astype(np.float64) * y.astype(np.float64)
    z = np.broadcast_to(z.astype(np.float64), p.shape)
    s = p + z
    virtual = s - p
    err = (p - (s - virtual)) + (z - virtual)  # s + err == p + z exactly (TwoSum)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _gpu_rounding_interpreter_shim() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_muon_fused_shim", False):
        return
    convert = interpreter._convert_float

    def convert_rne(data, src, dst, rounding_mode):
        if rounding_mode is None and (src, dst) == (tl.float32, tl.bfloat16):
            out = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return out.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding_mode)

    def create_fma(self, x, y, z):
        assert z.data.dtype == np.float32, z.data.dtype
        return interpreter.TensorHandle(_fma_f32(x.data, y.data, z.data), z.dtype.scalar)

    implicit_cvt = interpreter._implicit_cvt

    def fp32_scalars(arg):  # the GPU launcher passes a float argument as fp32
        if isinstance(arg, float):
            handle = interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32)
            return tl.tensor(handle, tl.float32)
        return implicit_cvt(arg)

    interpreter._implicit_cvt = fp32_scalars
    interpreter._convert_float = convert_rne
    interpreter.InterpreterBuilder.create_fma = create_fma
    interpreter._muon_fused_shim = True


if INTERPRET and HAVE_TRITON:
    _gpu_rounding_interpreter_shim()


def test_fma_reference():
    # the shim's fma against exact rationals, on cases where x * y + z rounded twice differs
    from fractions import Fraction

    gen = np.random.default_rng(0)
    x = gen.standard_normal(4000).astype(np.float32)
    y = gen.standard_normal(4000).astype(np.float32)
    z = (-x.astype(np.float64) * y).astype(np.float32)  # cancellation: the product's low bits
    got = _fma_f32(x, y, z)
    for a, b, c, r in zip(x[:300], y[:300], z[:300], got[:300], strict=True):
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        assert r == np.float32(float(exact)), (a, b, c)  # exact is a dyadic of <= 49 bits
    assert (got != x * y + z).any()


# -- dispatch (everywhere) ------------------------------------------------------------------------


def test_backend_setting():
    assert elementwise.get_backend() in elementwise.BACKENDS
    previous = elementwise.set_backend("torch")
    try:
        assert not elementwise.use_fused(torch.device("cuda"))
        elementwise.set_backend("triton")
        assert elementwise.use_fused(torch.device("cpu"))
        elementwise.set_backend("auto")
        assert not elementwise.use_fused(torch.device("cpu"))
        with pytest.raises(ValueError):
            elementwise.set_backend("cuda")
    finally:
        elementwise.set_backend(previous)


@pytest.mark.skipif(INTERPRET, reason="the subprocess sets its own environment")
def test_cpu_step_does_not_import_fused():
    # importing triton at startup (before gloo) made spawned workers abort at exit now and then
    code = (
        "import sys, torch\n"
        "from muon import Muon\n"
        "p = torch.nn.Parameter(torch.randn(6, 4)); p.grad = torch.randn(6, 4)\n"
        "Muon([p]).step()\n"
        "assert 'muon.fused' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MUON_ELEMENTWISE_BACKEND"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@runs_interpreter
def test_interpreter_subprocess():
    rerun_under_interpreter(__file__)


# -- kernels vs torch ops (interpreter and GPU) ---------------------------------------------------

# (rows, cols): ragged against the 64 x 64 tiles, one tile, a single row
SHAPES = [(37, 50), (64, 64), (130, 67), (1, 7)]


def _rect(shape, dtype, device, gen, layout):
    """A `shape` tensor: contiguous, a window of a larger one, or a transposed view."""
    rows, cols = shape
    if layout == "window":
        return torch.randn(rows + 3, cols + 5, device=device, generator=gen).to(dtype)[2:-1, 1:-4]
    if layout == "transposed":
        return torch.randn(cols, rows, device=device, generator=gen).to(dtype).mT
    return torch.randn(rows, cols, device=device, generator=gen).to(dtype)


def _check_momentum(device, shape, grad_dtype, out_dtype, nesterov, momentum, equal):
    from muon import fused

    gen = torch.Generator(device=device).manual_seed(0)
    for layout in ("contiguous", "window", "transposed"):
        grad = _rect(shape, grad_dtype, device, gen, layout)
        buf = _rect(shape, torch.float32, device, gen, "window")
        out = _rect(shape, out_dtype, device, gen, layout)
        ref_buf = buf.clone()
        ref_buf.lerp_(grad.float(), 1 - momentum)
        ref_out = grad.float().lerp(ref_buf, momentum) if nesterov else ref_buf
        fused.momentum_(grad, buf, out, momentum, nesterov)
        equal(buf, ref_buf, layout)
        equal(out, ref_out.to(out_dtype), layout)


def _check_apply(device, shape, param_dtype, update_dtype, round_to, equal):
    from muon import fused

    gen = torch.Generator(device=device).manual_seed(1)
    lr, weight_decay, alr = 0.02, 0.1, 0.02 * 1.37
    for layout in ("contiguous", "window", "transposed"):
        param_layout = "window" if layout == "window" else "contiguous"  # params are row-major
        param = _rect(shape, param_dtype, device, gen, param_layout)
        update = _rect(shape, update_dtype, device, gen, layout)
        rounded = update if round_to is None else update.to(round_to)
        ref = param.clone()
        ref.mul_(1 - lr * weight_decay)
        if device.type == "cuda" or param_dtype == torch.float32:
            ref.add_(rounded, alpha=-alr)
        else:  # torch's CPU add rounds alpha to a bf16 param's dtype; CUDA's keeps it fp32
            fma = _fma_f32(np.float32(-alr), rounded.float().numpy(), ref.float().numpy())
            ref.copy_(torch.from_numpy(fma))
        fused.apply_(param, update, 1 - lr * weight_decay, -alr, round_to)
        equal(param, ref, layout)


def _bitwise(got, want, where):
    assert got.dtype == want.dtype
    diff = (got != want).sum().item()
    assert diff == 0, f"{where}: {diff} of {got.numel()} differ, max {(got - want).abs().max()}"


MOMENTUM_CASES = [
    (torch.float32, torch.bfloat16, True, 0.95),
    (torch.bfloat16, torch.bfloat16, True, 0.95),
    (torch.float32, torch.float32, False, 0.95),
    (torch.float32, torch.bfloat16, True, 0.3),  # the other branch of each lerp
    (torch.float16, torch.float32, False, 0.0),
]
APPLY_CASES = [  # param, update, the dtype the update is rounded to (None: its own)
    (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float32, torch.float32, None),
    (torch.float32, torch.float16, torch.bfloat16),  # an fp16 Newton-Schulz result, bf16 step
    (torch.bfloat16, torch.float16, torch.bfloat16),
]


@interp
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", MOMENTUM_CASES)
def test_interp_momentum_bitwise(shape, case):
    _check_momentum(torch.device("cpu"), shape, *case, _bitwise)


@interp
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", APPLY_CASES)
def test_interp_apply_bitwise(shape, case):
    _check_apply(torch.device("cpu"), shape, *case, _bitwise)


@interp
def test_interp_rejects():
    from muon import fused

    x = torch.zeros(3, 4)
    with pytest.raises(ValueError):
        fused.momentum_(x, x.bfloat16(), x.clone(), 0.9, True)  # a bf16 momentum buffer
    with pytest.raises(ValueError):
        fused.apply_(torch.zeros(3, 4), torch.zeros(4, 3), 1.0, -0.1)
    with pytest.raises(ValueError):
        fused.apply_(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 1.0, -0.1)
    with pytest.raises(ValueError, match="rounded"):
        fused.apply_(x, x, 1.0, -0.1, torch.float64)


# -- the Muon step, fused vs torch elementwise ----------------------------------------------------


def _muon_run(device, backend, dtype, steps=3):
    """Params and state after `steps` Muon steps under the elementwise `backend`.

    `dtype` is one param's (torch's CPU add rounds alpha to a bf16 param's dtype; the fused
    kernel, as torch's CUDA add, keeps it fp32).
    """
    gen = torch.Generator(device=device).manual_seed(0)

    def param(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.randn(*shape, device=device, generator=gen).to(dtype))

    plain = [param(37, 50), param(50, 37), param(3, 20, 12), param(9, 70, dtype=dtype)]
    qkv = param(24, 16)
    groups = [
        {"params": plain},
        {"params": [qkv], "row_blocks": (8, 8, 8), "nesterov": False, "weight_decay": 0.0},
        {"params": [param(5), param(3, 4)], "algorithm": "adamw"},
    ]
    params = plain + [qkv] + groups[2]["params"]
    previous = elementwise.set_backend(backend)
    try:
        opt = Muon(groups, lr=0.02, adjust_lr_fn="match_rms_adamw", bucket_cap_bytes=3000)
        for step in range(steps):
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, device=device, generator=gen).to(p.dtype)
                p.grad = None if (step, i) == (1, 0) else grad
            opt.step()
    finally:
        elementwise.set_backend(previous)
    return params, opt


@interp
def test_interp_muon_step_bitwise():
    (fused_params, fused_opt), (torch_params, torch_opt) = (
        _muon_run(torch.device("cpu"), b, torch.float32) for b in ("triton", "torch")
    )
    for p, q in zip(fused_params, torch_params, strict=True):
        _bitwise(p, q, f"param {tuple(p.shape)}")
        for key, value in torch_opt.state[q].items():
            _bitwise(fused_opt.state[p][key], value, f"{key} {tuple(p.shape)}")


def _distributed_worker(rank: int, world: int) -> None:
    from test_muon_distributed import CONFIGS, ONE_D, _check_case
    from torch.distributed.device_mesh import init_device_mesh

    assert elementwise.use_fused(torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world,))
    _check_case(mesh, ONE_D, CONFIGS[0], "1d fused")  # bf16, Nesterov, several buckets


@interp
def test_interp_distributed_equals_single_process(monkeypatch):
    # the fused kernels on pieces (exchange) and whole matrices (local) == one process, bitwise
    monkeypatch.setenv("MUON_ELEMENTWISE_BACKEND", "triton")  # for the spawned workers
    run_on_ranks(_distributed_worker, 3)


# -- GPU ------------------------------------------------------------------------------------------


# torch's CUDA lerp and add(alpha) are one fma per element (nvcc contracts Lerp.h's and
# add's expressions), as the kernels' tl.fma: expected bitwise, checked here.


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES + [(4096, 1000)])
@pytest.mark.parametrize("case", MOMENTUM_CASES)
def test_gpu_momentum_bitwise(shape, case):
    _check_momentum(torch.device("cuda"), shape, *case, _bitwise)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES + [(1000, 4096)])
@pytest.mark.parametrize("case", APPLY_CASES)
def test_gpu_apply_bitwise(shape, case):
    _check_apply(torch.device("cuda"), shape, *case, _bitwise)


@pytest.mark.gpu
@needs_gpu
def test_gpu_muon_step_fused_vs_torch():
    # Same inputs to the same Newton-Schulz: equal given the two tests above; held to rounding
    # here so that a rare kernel-choice difference elsewhere does not mask the kernel tests.
    device = torch.device("cuda")
    assert elementwise.get_backend() != "auto" or elementwise.use_fused(device)
    (fused_params, fused_opt), (torch_params, torch_opt) = (
        _muon_run(device, b, torch.bfloat16) for b in ("triton", "torch")
    )
    for p, q in zip(fused_params, torch_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3)
        for key, value in torch_opt.state[q].items():
            torch.testing.assert_close(fused_opt.state[p][key], value)
