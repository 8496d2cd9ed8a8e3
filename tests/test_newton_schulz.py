"""Newton-Schulz on CPU: Gram vs standard, batch invariance, path choice, workspace model."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
from ns_alloc_tracker import PeakTracker

from muon.newton_schulz import (
    GRAM_MIN_ASPECT,
    NewtonSchulzPath,
    ns_path,
    ns_workspace_numel,
    zeropower,
    zeropower_along,
)
from muon.ns_schedules import DEEPSEEK_V4, KELLER_JORDAN, SCHEDULES, NewtonSchulzSchedule


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (3, 36, 90), (4, 90, 36), (48, 48)])
def test_gram_matches_standard_in_fp32(name, shape):
    schedule = SCHEDULES[name]
    x = _randn(*shape)
    standard = zeropower(x, schedule, algorithm="standard")
    gram = zeropower(x, schedule, algorithm="gram")
    assert gram.shape == x.shape and gram.dtype == torch.float32
    assert _rel(gram, standard) <= 1e-4
    if x.ndim == 3:  # per matrix, not only on the whole batch
        for g, s in zip(gram, standard, strict=True):
            assert _rel(g, s) <= 1e-4


def test_gram_restarts_are_data():
    # every placement of the restarts is the same iteration (to rounding); more restarts
    # leave less for Q to accumulate in one segment
    x = _randn(2, 40, 100)
    standard = zeropower(x, DEEPSEEK_V4, algorithm="standard")
    errors = {}
    for restarts in [(), (2,), (2, 5, 8), (1, 2, 3, 4, 5, 6, 7, 8, 9), (4, 40)]:
        schedule = dataclasses.replace(DEEPSEEK_V4, gram_restarts=restarts)
        errors[restarts] = _rel(zeropower(x, schedule, algorithm="gram"), standard)
    assert all(e <= 1e-2 for e in errors.values()), errors
    assert errors[(2, 5, 8)] <= 1e-4 and errors[(1, 2, 3, 4, 5, 6, 7, 8, 9)] <= 1e-4, errors
    assert DEEPSEEK_V4.gram_segments() == (range(0, 2), range(2, 5), range(5, 8), range(8, 10))
    with pytest.raises(ValueError, match="gram_restarts"):
        dataclasses.replace(KELLER_JORDAN, gram_restarts=(3, 2))
    with pytest.raises(ValueError, match="a != 0"):
        NewtonSchulzSchedule(((0.0, 1.0, 1.0),))


@pytest.mark.parametrize(
    "coefficients, norm_scale",
    [
        (((float("nan"), 1.0, 1.0),), 1.0),
        (((3.0, float("inf"), 1.0),), 1.0),
        (((3.0, "4", 1.0),), 1.0),
        (((3.0, True, 1.0),), 1.0),
        (((3.0, -4.0, 1.0),), float("inf")),
    ],
)
def test_a_schedule_takes_only_finite_real_numbers(coefficients, norm_scale):
    with pytest.raises((TypeError, ValueError), match="finite|real|norm_scale"):
        NewtonSchulzSchedule(coefficients, norm_scale=norm_scale)


def _skewed(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """U diag(10^(-4u)) V^T in bf16: singular values spread over four decades."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    return ((u * 10 ** (-4 * torch.rand(k, generator=gen))) @ v.mT).bfloat16()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_cpu_gram_of_16_bit_inputs_is_as_accurate_as_plain_bf16(name):
    # Gram in bf16 (8 bits) returned NaN for deepseek_v4 on a skewed spectrum and up to 6.4x
    # the plain bf16 path's error otherwise; it runs in fp16 on every device now
    schedule = SCHEDULES[name]
    x = _skewed(64, 256)
    assert ns_path(64, 256, torch.bfloat16, "cpu", algorithm="gram").dtype == torch.float16
    ref = zeropower(x.double(), schedule, algorithm="standard")
    gram = zeropower(x, schedule, algorithm="gram")
    assert gram.dtype == torch.bfloat16 and gram.isfinite().all()
    assert _rel(gram, ref) <= _rel(zeropower(x, schedule, algorithm="standard"), ref)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tall", [False, True])
def test_batch_invariant_bitwise(algorithm, dtype, tall):
    # a matrix's result is the same bits whatever the batch size and the other matrices
    mats = _randn(7, 40, 72).to(dtype)
    if tall:
        mats = mats.mT.contiguous()
    others = (100 * _randn(6, *mats.shape[1:], seed=1)).to(dtype)
    schedule = SCHEDULES["polar_express"]
    alone = zeropower(mats[0], schedule, algorithm=algorithm)
    for batch in (mats[:1], mats[:3], mats, torch.cat([mats[:1], others[:2]])):
        assert torch.equal(zeropower(batch, schedule, algorithm=algorithm)[0], alone)
    # and a matrix in the middle of a batch equals itself alone
    assert torch.equal(
        zeropower(mats, schedule, algorithm=algorithm)[4],
        zeropower(mats[4:5], schedule, algorithm=algorithm)[0],
    )


def test_cpu_auto_is_standard_and_bit_equal_to_torch_muon_iteration():
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in [(64, 192), (192, 64)]:  # aspect 3: Gram on CUDA, standard on CPU
        x = _randn(*shape)
        ref = _zeropower_via_newtonschulz(x, KELLER_JORDAN.coefficients[0], 5, 1e-7)
        assert torch.equal(zeropower(x.bfloat16(), KELLER_JORDAN), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_shape_small_matrices_are_each_torch_muons_result(dtype):
    # CPU batched baddbmm of small bf16 matrices rounded otherwise than 2-D addmm: over
    # 100 seeds, 6 (16, 16) matrices changed with the batch, 2 (7, 5) ones differed from
    # torch.optim.Muon
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape, seed in itertools.product([(3, 16, 16), (3, 7, 5)], range(100)):
        mats = _randn(*shape, seed=seed).to(dtype)
        batch = zeropower(mats, KELLER_JORDAN)
        for i, mat in enumerate(mats):
            alone = zeropower(mats[i : i + 1], KELLER_JORDAN)[0]
            assert torch.equal(batch[i], alone), (seed, i)
            if dtype == torch.bfloat16:  # torch.optim.Muon iterates in bf16 only
                ref = _zeropower_via_newtonschulz(mat, KELLER_JORDAN.coefficients[0], 5, 1e-7)
                assert torch.equal(alone, ref), (seed, i)


def test_ns_path_is_per_shape():
    cpu = functools.partial(ns_path, dtype=torch.bfloat16, device_type="cpu")
    for rows, cols in [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]:
        plain = NewtonSchulzPath("standard", "torch", torch.bfloat16, per_matrix=True)
        assert cpu(rows, cols) == plain
        path = cpu(rows, cols, algorithm="gram")
        assert path == NewtonSchulzPath("gram", "torch", torch.float16, per_matrix=True)
    # the pure rule for CUDA (backend forced: no triton needed to decide)
    cuda = functools.partial(
        ns_path, dtype=torch.bfloat16, device_type="cuda", capability=9, backend="torch"
    )
    assert cuda(4096, 4096).algorithm == "standard"
    side = 2048
    long = int(side * GRAM_MIN_ASPECT["torch"])
    assert cuda(long, side) == NewtonSchulzPath("gram", "torch", torch.float16)
    assert cuda(side, long) == NewtonSchulzPath("gram", "torch", torch.float16)
    assert cuda(long - 1, side).algorithm == "standard"
    assert cuda(side, side, algorithm="gram").dtype == torch.float16
    # the Triton standard iteration in fp16 too (bf16 folds a I into P at 8 bits)
    triton = ns_path(4096, 4096, torch.bfloat16, "cuda", 9, "triton", "standard")
    assert triton == NewtonSchulzPath("standard", "triton", torch.float16)
    assert cuda(side, side).dtype == torch.bfloat16  # the plain standard path keeps bf16
    assert ns_path(64, 192, torch.float32, "cuda", 9, "torch", "gram").dtype == torch.float32
    with pytest.raises(ValueError, match="`path` or `gram`"):
        ns_workspace_numel([(1, 8, 8)], path=cpu, gram=[None])
    with pytest.raises(ValueError, match="algorithm"):
        cpu(8, 8, algorithm="polar")
    with pytest.raises(ValueError, match="algorithm"):
        zeropower(_randn(8, 8), KELLER_JORDAN, algorithm="polar")
    with pytest.raises(ValueError, match="backend"):
        cpu(8, 8, backend="cutlass")


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("schedule", [KELLER_JORDAN, DEEPSEEK_V4], ids=["kj", "dsv4"])
def test_workspace_model_is_what_the_torch_path_allocates(algorithm, schedule):
    # a bucket's batches run in order, each result kept until the bucket is applied
    batches = [(3, 24, 40), (2, 56, 16), (1, 32, 32), (4, 8, 40)]
    variants = [schedule.gram_restarts, (1,), ()] if algorithm == "gram" else [()]
    for restarts in variants:  # restarts do not touch the standard algorithm
        sched = dataclasses.replace(schedule, gram_restarts=restarts)
        inputs = [_randn(*b, seed=i) for i, b in enumerate(batches)]
        tracker = PeakTracker(ignore_numel=max(b[0] for b in batches))
        results = []
        with tracker:
            for x in inputs:
                results.append(zeropower(x, sched, algorithm=algorithm))
        path = functools.partial(
            ns_path, dtype=torch.float32, device_type="cpu", algorithm=algorithm
        )
        model = ns_workspace_numel(batches, sched, path)
        assert tracker.peak == model, (restarts, tracker.peak, model)
    if algorithm == "standard":  # the default model (no path) is the standard algorithm's
        assert ns_workspace_numel(batches, per_matrix=True) == model


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_per_matrix_launches_match_the_batch_and_the_model(algorithm):
    # the plain CUDA path launches small matrices one by one (`per_matrix`): same bits as
    # the batch on CPU, and the workspace model counts the output filled one at a time
    batches = [(3, 24, 40), (2, 40, 16)]
    path = NewtonSchulzPath(algorithm, "torch", torch.float32, per_matrix=True)
    inputs = [_randn(*b, seed=i) for i, b in enumerate(batches)]
    tracker = PeakTracker(ignore_numel=3)
    with tracker:
        results = [zeropower_along(x, KELLER_JORDAN, 1e-7, path) for x in inputs]
    assert tracker.peak == ns_workspace_numel(batches, KELLER_JORDAN, lambda r, c: path)
    for x, out in zip(inputs, results, strict=True):
        assert torch.equal(out, zeropower(x, KELLER_JORDAN, algorithm=algorithm))
    cuda = ns_path(8, 64, torch.bfloat16, "cuda", 9, "torch", "auto")
    assert cuda.per_matrix and not ns_path(256, 512, torch.bfloat16, "cuda", 9, "torch").per_matrix
