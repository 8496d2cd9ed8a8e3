"""What an audit of the offloaded step found: each case bit-equal to the same unwrapped
optimizer (or refused by name where torch's own step would not go on)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import CPUOffloadOptimizer

CHUNK_BYTES = 4096  # small: several chunks stream, and the larger params are sliced


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(50, 32)]
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    layers.append(nn.Linear(32, 50))
    return nn.Sequential(*layers)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).square().mean()


def wrapped(optimizer: torch.optim.Optimizer, model: nn.Module, overlap: bool):
    return CPUOffloadOptimizer(
        optimizer, chunk_bytes=CHUNK_BYTES, overlap_forward=model if overlap else None
    )


def assert_equal(plain_model, plain, model, opt) -> None:
    """Params, and every state entry of every param, bitwise equal."""
    if isinstance(opt, CPUOffloadOptimizer):
        opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        ref, got = plain.state.get(a, {}), opt.state.get(b, {})
        assert sorted(ref) == sorted(got)
        for key, value in ref.items():
            assert torch.equal(value, got[key]), key


def assert_state_homed(opt: CPUOffloadOptimizer, model: nn.Module) -> None:
    """Every state tensor (ndim >= 1) has a home in the plan (the host slabs)."""
    kept = {
        (i, key)
        for i, p in enumerate(model.parameters())
        for key, value in opt.state.get(p, {}).items()
        if value.ndim >= 1
    }
    planned = {(v.param, v.spec.key) for chunk in opt.plan.chunks for v in chunk.views}
    assert kept and kept == planned


# -- GradScaler with an optimizer that unscales in its kernel --------------------------


class SerialAdamW(torch.optim.AdamW):
    """A subclass: no subset step is known for it, so it takes the serial path."""


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _fused_sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)


# Steps whose grads hold an inf (GradScaler skips them). Not SGD's first: its fused step
# leaves a new momentum_buffer uninitialized when it skips (`torch.empty_like` in torch
# 2.13's `_fused_sgd`), so the runs would differ by that garbage.
INF_STEPS = {_fused_sgd: (3,)}


def _serial_fused_adamw(params):
    return SerialAdamW(params, lr=1e-2, fused=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize(
    "make", [_fused_adamw, _fused_sgd, _serial_fused_adamw], ids=["adamw", "sgd", "serial"]
)
def test_grad_scaler_with_a_fused_optimizer_is_bitwise_equal(make, overlap):
    """GradScaler hands a fused optimizer its scale and inf flag (it unscales in its kernel
    and, on inf, still creates state but skips the update): a scale that is not a power
    of two, a skipped first step and a skipped later one, as unwrapped."""
    if make is _serial_fused_adamw and overlap:
        pytest.skip("the serial path takes no forward overlap")
    runs = []
    for wrap in (False, True):
        model = make_model()
        inner = make(model.parameters())
        opt = wrapped(inner, model, overlap) if wrap else inner
        assert opt._step_supports_amp_scaling
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1)
        hooks = []
        inner.register_step_post_hook(lambda *_, hooks=hooks: hooks.append(1))
        for step in range(5):
            scaler.scale(loss_of(model, step)).backward()
            if step in INF_STEPS.get(make, (0, 3)):  # skipped (state created all the same)
                model[3].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 0:
                assert len(opt.state) == len(list(model.parameters()))
        runs.append((model, inner if not wrap else opt, scaler.get_scale(), len(hooks)))
        assert not hasattr(opt, "grad_scale") and not hasattr(inner, "grad_scale")
    (plain_model, plain, plain_scale, plain_hooks), (model, opt, scale, hooks) = runs
    assert_equal(plain_model, plain, model, opt)
    skipped = len(INF_STEPS.get(make, (0, 3)))
    assert (scale, hooks) == (plain_scale, plain_hooks) == (1000.0 * 2 ** (5 - 2 * skipped), 5)


# -- tensor hyperparameters inside a tuple ------------------------------------------------


def test_tensor_betas_filled_in_place_after_step_leave_the_pending_step_alone():
    """`betas=(tensor, tensor)` filled in place after `step()` (a beta schedule): the
    overlapped step's pending chunks read the betas the step began with."""
    runs = []
    for wrap in (False, True):
        model = make_model()
        betas = (torch.tensor(0.9), torch.tensor(0.999))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=betas)
        opt = wrapped(inner, model, overlap=True) if wrap else inner
        for step in range(3):
            loss_of(model, step).backward()
            opt.step()
            opt.param_groups[0]["betas"][0].fill_(0.9 - 0.2 * (step + 1))
            opt.zero_grad()
        runs.append((model, opt))
    assert_equal(*runs[0], *runs[1])


# -- a param group added while an overlapped step is pending -----------------------------


def test_an_empty_group_added_while_a_step_is_pending_takes_no_part_in_it():
    runs = []
    for wrap in (False, True):
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = wrapped(inner, model, overlap=True) if wrap else inner
        for step in range(4):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
            if step == 1:  # the forward that runs the pending chunks comes next
                inner.add_param_group({"params": [], "lr": 0.5})
        runs.append((model, opt))
    assert_equal(*runs[0], *runs[1])


def test_a_group_with_params_added_while_a_step_is_pending_is_refused_at_the_next_step():
    plain_model, model = make_model(), make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = wrapped(torch.optim.AdamW(model.parameters(), lr=1e-2), model, overlap=True)
    for m, o in ((plain_model, plain), (model, opt)):
        loss_of(m, 0).backward()
        o.step()
        o.zero_grad()
    opt.optimizer.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    loss = loss_of(model, 1)  # runs the pending step, which the new group takes no part in
    assert_equal(plain_model, plain, model, opt)
    loss.backward()
    with pytest.raises(RuntimeError, match="params changed after wrapping"):
        opt.step()


# -- options that choose the state, set after wrapping -----------------------------------


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda group: group.__setitem__(key, value)


STATE_OPTIONS = {
    "adamw-amsgrad-on": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), _set("amsgrad", True)),
    "adamw-amsgrad-off": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
        _set("amsgrad", False),
    ),
    "rmsprop-centered": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2), _set("centered", True)),
    "rmsprop-momentum": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2), _set("momentum", 0.9)),
    "sgd-momentum-on": (lambda ps: torch.optim.SGD(ps, lr=1e-2), _set("momentum", 0.9)),
}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("case", list(STATE_OPTIONS))
def test_options_that_choose_the_state_set_before_the_first_step_step_as_torch(case, overlap):
    """torch takes them while no state exists: the plan is of the state the first step
    creates, and all of it lives in the host slabs."""
    make, change = STATE_OPTIONS[case]

    def change_first(opt, step):
        if step == 0:
            for group in opt.param_groups:
                change(group)

    runs = _plain_and_wrapped(make, overlap, steps=3, before_step=change_first)
    assert_equal(*runs[0], *runs[1])
    assert_state_homed(runs[1][1], runs[1][0])


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_sgd_momentum_turned_on_after_the_first_step_is_homed_at_the_next(overlap):
    """SGD keeps no state without momentum, so torch takes it at any step: the
    momentum_buffer it creates then moves to the host slabs at the next step."""

    def momentum_at_step_2(opt, step):
        if step == 2:
            opt.param_groups[0]["momentum"] = 0.9

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2)

    runs = _plain_and_wrapped(sgd, overlap, steps=4, before_step=momentum_at_step_2)
    assert_equal(*runs[0], *runs[1])
    assert_state_homed(runs[1][1], runs[1][0])


def _plain_and_wrapped(make, overlap, steps, before_step):
    """(model, optimizer) trained `steps` steps unwrapped, then wrapped; `before_step(opt,
    step)` runs before each step's forward."""
    runs = []
    for wrap in (False, True):
        model = make_model()
        inner = make(model.parameters())
        opt = wrapped(inner, model, overlap) if wrap else inner
        for step in range(steps):
            before_step(opt, step)
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    return runs


@pytest.mark.parametrize("overlap", [False, True])
def test_host_slabs_are_allocated_on_the_cpu_whatever_the_default_device(overlap):
    """A default device set after the optimizer was built (`torch.set_default_device`, a GPU
    in many scripts; meta here): the first offloaded step allocated its host slabs there,
    so on meta the state was lost and the next step raised."""
    batches = [batch(step) for step in range(4)]
    runs = []
    for wrap in (False, True):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(batches[0]).square().mean().backward()
        opt.step()  # the state exists, so the unwrapped AdamW creates none under meta
        opt.zero_grad()
        if wrap:
            opt = wrapped(opt, model, overlap)
        with torch.device("meta"):
            for x in batches[1:]:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        runs.append((model, opt))
    assert_equal(*runs[0], *runs[1])
    assert all(slab.device.type == "cpu" for slab in runs[1][1]._executor.host_slabs.values())


def _column_major(model: nn.Module) -> None:
    """Every 2-D param laid out column-major, values unchanged (as `model.to(memory_format=
    torch.channels_last)` relays 4-D ones)."""
    for p in model.parameters():
        if p.ndim == 2:
            p.data = p.data.t().contiguous().t()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sliced_param_relaid_between_steps_is_planned_anew_and_bitwise(overlap):
    """Slices are runs of a param's memory: a sliced param relaid after the plan was built
    failed in its stand-in's `view(-1)` (naming nothing) and locked the wrapper."""

    def relay_at_step_2(opt, step):
        if step == 2:
            _column_major(models[len(models) - 1])

    models: list[nn.Module] = []

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    runs = []
    for wrap in (False, True):
        model = make_model()
        models.append(model)
        inner = adamw(model.parameters())
        opt = wrapped(inner, model, overlap) if wrap else inner
        for step in range(4):
            relay_at_step_2(opt, step)
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    sliced = runs[1][1]._executor.chunks
    assert not any(piece.param.ndim == 2 for chunk in sliced for piece in chunk.slices)
    assert_equal(*runs[0], *runs[1])


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="torch >= 2.13")
@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adagrad], ids=["sgd", "adagrad"])
def test_a_grad_of_another_dtype_the_param_allows_steps_as_torch(make):
    """`p.grad_dtype = None` lets a bf16 param take an fp32 grad, which torch's SGD and
    Adagrad step; the wrapper's stand-in refused it (torch's generic grad_dtype error,
    naming no param) and locked the wrapper. A param without a grad when the plan is made
    is planned anew once its grad shows another dtype; state made in one dtype stays in it
    (a plan made later followed the grads' dtype) until a load casts it."""
    runs = []
    for wrap in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 48).to(torch.bfloat16)) for _ in range(3)]
        for p in params:
            p.grad_dtype = None
        options = {"lr": 0.1, "momentum": 0.9} if make is torch.optim.SGD else {"lr": 0.1}
        opt = make(params, **options)
        if wrap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=CHUNK_BYTES)
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, generator=generator)  # fp32
                if step == 0 and i == 1:
                    grad = None  # planned before its first grad
                elif step == 0 and i == 2:
                    grad = grad.to(torch.bfloat16)  # its state made bf16, then fp32 grads
                p.grad = grad
            if step == 2:  # a load casts the state to the param's dtype, as torch's does
                opt.load_state_dict(opt.state_dict())
            opt.step()
        runs.append((params, opt))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        assert torch.equal(a, b)
        for key, value in runs[0][1].state[a].items():
            got = runs[1][1].state[b][key]
            assert got.dtype == value.dtype and torch.equal(value, got), key


@pytest.mark.parametrize("overlap", [False, True])
def test_state_assigned_whole_resets_as_torch(overlap):
    """`opt.state = defaultdict(dict)` (torch's reset of every param's state) raised "no
    setter" on the wrapper."""
    from collections import defaultdict

    def reset_at_step_2(opt, step):
        if step == 2:
            opt.state = defaultdict(dict)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    runs = _plain_and_wrapped(adamw, overlap, steps=4, before_step=reset_at_step_2)
    assert_equal(*runs[0], *runs[1])


def test_state_dict_lists_state_in_the_order_the_wrapped_optimizer_made_it():
    """Without overlap the chunks run in the wrapped optimizer's order, so its state_dict
    lists the state as torch's does: by when a param first had a grad (here the embedding
    last), not by param index (an earlier fix sorted it by index)."""

    def embedding_grads_from_step_1(opt, step):
        opt.param_groups[0]["params"][0].requires_grad_(step > 0)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    runs = _plain_and_wrapped(adamw, False, steps=3, before_step=embedding_grads_from_step_1)
    assert_equal(*runs[0], *runs[1])
    plain, got = runs[0][1].state_dict()["state"], runs[1][1].state_dict()["state"]
    assert list(plain) == list(got) and list(plain)[-1] == 0
