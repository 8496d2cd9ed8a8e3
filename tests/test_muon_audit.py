"""Audit fixes to `muon.Muon`: a pending overlapped step keeps the settings it began with (checked
as the constructor checks them), a bf16 update does not depend on its batch, the
step ignores an enclosing autocast, and a scheduler cycling `momentum` into AdamW groups
(which do not read it) is warned about once."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CyclicLR, LRScheduler, OneCycleLR

from muon import Muon, elementwise, muon_param_groups, newton_schulz
from offload import CPUOffloadOptimizer

torch.set_num_threads(1)
CHUNK_BYTES = 4096  # several chunks, so most of an overlapped step runs in the next forward


class _Net(nn.Module):
    """Muon matrices of two shapes and AdamW params (embedding, biases, norm, head); one
    layer's weight per 4 KiB chunk, so most of an overlapped step is pending after `step()`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(24))
        self.wide = nn.Linear(32, 48)
        self.norm = nn.LayerNorm(48)
        self.lm_head = nn.Linear(48, 20, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.lm_head(self.norm(self.wide(x)))


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(20, (4, 7), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(_tokens(step)).float().square().mean()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)]
    assert not differ, f"params {differ} differ"


# -- 1. a pending overlapped step keeps the settings it began with ------------------------------


def _two_steps_then_change(
    offload: bool, change: Callable[[Muon], None]
) -> tuple[list[torch.Tensor], Muon]:
    """Two steps; `change` runs after the second `step()`, before the forward that (with
    overlap) runs that step's chunks."""
    model = _model()
    inner = Muon(muon_param_groups(model), lr=0.02)
    opt = (
        CPUOffloadOptimizer(inner, chunk_bytes=CHUNK_BYTES, overlap_forward=model)
        if offload
        else inner
    )
    for step in range(2):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    change(inner)
    model(_tokens(2))
    if offload:
        opt.wait_for_optimizer_step()
    return _params(model), inner


def _change_settings(opt: Muon) -> None:
    opt.ns_dtype = torch.float32
    opt.max_inflight = 1
    opt.collect_timings = True


def test_settings_changed_after_step_do_not_reach_its_pending_chunks() -> None:
    plain, _ = _two_steps_then_change(False, _change_settings)
    offloaded, inner = _two_steps_then_change(True, _change_settings)
    _assert_bitwise(plain, offloaded)
    # collect_timings was off when the step began: none of its buckets timed
    assert inner.metrics and all(m.ns_s is None for m in inner.metrics)


@pytest.mark.parametrize("set_backend", [newton_schulz.set_backend, elementwise.set_backend])
def test_a_backend_changed_after_step_does_not_reach_its_pending_chunks(
    set_backend: Callable[[str], str],
) -> None:
    """A backend set to "triton" (not importable here) after `step()` must not reach the
    step's pending chunks; it takes effect from the next step."""
    previous: list[str] = []
    plain, _ = _two_steps_then_change(False, lambda _: None)
    try:
        offloaded, _ = _two_steps_then_change(
            True, lambda _: previous.append(set_backend("triton"))
        )
    finally:
        for backend in previous:
            set_backend(backend)
    _assert_bitwise(plain, offloaded)


# -- 2. the step ignores an enclosing autocast -------------------------------------------------


def _train(ns_dtype: torch.dtype, in_autocast: bool, overlap: bool = False) -> list[torch.Tensor]:
    model = _model()
    opt = Muon(muon_param_groups(model), lr=0.02, ns_dtype=ns_dtype)
    if overlap:
        opt = CPUOffloadOptimizer(opt, chunk_bytes=CHUNK_BYTES, overlap_forward=model)
    for step in range(3):
        _loss(model, step).backward()  # the forward outside autocast: the same grads
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=in_autocast):
            opt.step()
        opt.zero_grad()
    if overlap:
        opt.wait_for_optimizer_step()
    return _params(model)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_step_in_autocast_equals_step_outside(ns_dtype: torch.dtype) -> None:
    outside = _train(ns_dtype, in_autocast=False)
    _assert_bitwise(outside, _train(ns_dtype, in_autocast=True))
    # an overlapped step's chunks run in the next forward, with autocast off: the same
    _assert_bitwise(outside, _train(ns_dtype, in_autocast=True, overlap=True))


# -- 3. a scheduler cycling momentum into AdamW groups is warned about -------------------------


def _one_cycle(opt: torch.optim.Optimizer, cycle: bool) -> LRScheduler:
    return OneCycleLR(opt, max_lr=1e-2, total_steps=10, cycle_momentum=cycle)


def _cyclic(opt: torch.optim.Optimizer, cycle: bool) -> LRScheduler:
    return CyclicLR(opt, 1e-4, 1e-2, step_size_up=2, cycle_momentum=cycle)


def _scheduled_steps(
    make: Callable[[torch.optim.Optimizer, bool], LRScheduler] | None,
    cycle: bool,
    offload: bool = False,
    steps: int = 4,
) -> None:
    model = _model()
    opt: torch.optim.Optimizer = Muon(muon_param_groups(model), lr=1e-3)
    if offload:
        opt = CPUOffloadOptimizer(opt, chunk_bytes=CHUNK_BYTES)
    scheduler = make(opt, cycle) if make is not None else None
    for step in range(steps):
        _loss(model, step).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()


@pytest.mark.parametrize("make", [_one_cycle, _cyclic])
@pytest.mark.parametrize("offload", [False, True])
def test_momentum_cycled_into_adamw_groups_warns_once(
    make: Callable[[torch.optim.Optimizer, bool], LRScheduler], offload: bool
) -> None:
    with pytest.warns(UserWarning, match="cycle_momentum=False") as caught:
        _scheduled_steps(make, cycle=True, offload=offload)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts  # once per optimizer, though every step sees it cycled
    assert "algorithm='adamw'" in texts[0] and "betas[0]" in texts[0]


@pytest.mark.parametrize("make", [_one_cycle, _cyclic, None])
def test_no_momentum_warning_without_cycling(
    make: Callable[[torch.optim.Optimizer, bool], LRScheduler] | None,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _scheduled_steps(make, cycle=False)


def test_no_momentum_warning_after_loading_a_checkpoint_of_another_momentum() -> None:
    # torch's load puts the checkpoint's momentum in every group; the AdamW group's then
    # differed from the one it was added with, and the warning blamed a cyclic scheduler
    model = _model()
    saved = Muon(muon_param_groups(model), lr=1e-3, momentum=0.95)
    _loss(model, 0).backward()
    saved.step()
    resumed = Muon(muon_param_groups(model), lr=1e-3, momentum=0.5)
    resumed.load_state_dict(saved.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(model, 1).backward()
        resumed.step()
    assert [g["momentum"] for g in resumed.param_groups] == [0.95] * len(resumed.param_groups)


@pytest.mark.parametrize("offload", [False, True])
def test_a_refused_load_leaves_the_momentum_warnings_baseline_as_it_was(offload) -> None:
    # the refused load's momentum became the baseline while the groups went back: the next
    # step warned that a scheduler had cycled the momentum
    model = _model()
    muon = Muon(muon_param_groups(model), lr=1e-3, momentum=0.95)
    opt = CPUOffloadOptimizer(muon, chunk_bytes=CHUNK_BYTES) if offload else muon
    _loss(model, 0).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["momentum"] = 0.5
    if offload:  # refused by the wrapper after the inner optimizer loaded the groups
        entry = next(v for v in saved["state"].values() if "exp_avg" in v)
        del entry["exp_avg"]
    else:  # refused by a post-hook after torch's load
        opt.register_load_state_dict_post_hook(_raise_refused)
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        opt.load_state_dict(saved)
    assert [g["momentum"] for g in muon.param_groups] == [0.95] * len(muon.param_groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(model, 1).backward()
        opt.step()


def _raise_refused(optimizer) -> None:
    raise RuntimeError("refused by a post-hook")


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=["tall", "wide"])
def test_bf16_matrices_update_alike_alone_or_batched(shape):
    """A batch of one returned a tall matrix's result as a transposed view, a larger batch
    as a contiguous copy, and the CPU's bf16 `add_` rounds by the update's layout: the
    update depended on what else was in the batch."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(shape, generator=gen).bfloat16() for _ in range(3)]
    grads = [[torch.randn(shape, generator=gen).bfloat16() for _ in init] for _ in range(3)]
    runs = []
    for cap in (None, 1):  # the default: one batch of three; 1: a bucket a matrix
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = Muon(params, lr=0.02, **({} if cap is None else {"bucket_cap_bytes": cap}))
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        runs.append(params)
    for batched, alone in zip(*runs, strict=True):
        assert torch.equal(batched, alone)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("ns_dtype", torch.float16, "ns_dtype should be"),
        ("max_inflight", 0, "max_inflight should be >= 1"),
        ("bucket_cap_bytes", -1, "bucket_cap_bytes should be >= 1"),
    ],
)
def test_settings_changed_between_steps_are_checked_as_the_constructor_checks_them(
    name, value, message
):
    # ns_dtype float16 and max_inflight 0 stepped silently; the name "float32" crashed
    param = nn.Parameter(torch.randn(8, 4))
    opt = Muon([param], lr=0.02)
    param.grad = torch.randn(8, 4)
    setattr(opt, name, value)
    with pytest.raises(ValueError, match=message):
        opt.step()
    opt.ns_dtype, opt.max_inflight, opt.bucket_cap_bytes = "float32", 1, 2**20
    opt.step()
    assert opt.ns_dtype is torch.float32


@pytest.mark.parametrize("key, value", [("ns_dtype", torch.float32), ("max_inflight", 1)])
def test_an_optimizer_setting_in_a_group_is_refused(key, value):
    # a group's ns_dtype gave the bf16 result, bit for bit, without a word
    param = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=rf"param group 0: {key} is a setting of the whole"):
        Muon([{"params": [param], key: value}], lr=0.02)


def test_match_rms_adamw_lr_is_torchs_float():
    # lr * 0.2 * sqrt(n) was 1 ulp off torch's lr * (0.2 * sqrt(n)): float64 params differed
    from torch.optim._muon import _adjust_lr

    from muon.optimizer import adjusted_lr

    for lr in (0.02, 0.01, 3e-4, 1e-3):
        for shape in ((64, 512), (512, 64), (7, 3), (4096, 1024)):
            expected = _adjust_lr(lr, "match_rms_adamw", torch.Size(shape))
            assert adjusted_lr(lr, "match_rms_adamw", *shape) == expected, (lr, shape)


def test_coefficients_the_step_cannot_use_are_refused_at_construction():
    # a = 0 was accepted, then refused by step() (under overlap, inside the next forward)
    param = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"param group 0: ns_coefficients=\(0.0, .*a != 0"):
        Muon([param], ns_coefficients=(0.0, -4.775, 2.0315))


def test_a_load_refused_after_torchs_load_leaves_the_groups_and_state_as_they_were():
    # a bad schedule string raised after torch's load had replaced the groups and state
    param = nn.Parameter(torch.randn(8, 4))
    opt = Muon([param], lr=0.02)
    param.grad = torch.randn(8, 4)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    saved["param_groups"][0]["ns_coefficients"] = "{not json"
    momentum = opt.state[param]["momentum_buffer"]
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.02
    assert opt.state[param]["momentum_buffer"] is momentum
