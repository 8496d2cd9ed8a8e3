"""What a hostile user does to CPUOffloadOptimizer (issue 25): each case is exact, bit
for bit against the plain optimizer, or refused with an error that names the param,
key or argument and the way out."""

from __future__ import annotations

import copy
import functools
import gc
import warnings

import pytest
import torch
from test_offload_audit import assert_equal
from torch import nn

from muon import Muon, muon_param_groups
from offload import CPUOffloadOptimizer
from offload.chunk_plan import SLICE_ELEMENTS

LAYOUTS = {
    "transposed": lambda: torch.randn(8, 6).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "permuted_3d": lambda: torch.randn(3, 4, 5).permute(2, 0, 1),
    "strided_slice": lambda: torch.randn(6, 10)[:, ::2],  # not dense: state is contiguous
}


def _param_like(make, seed: int) -> torch.nn.Parameter:
    torch.manual_seed(seed)
    return torch.nn.Parameter(make())


def _grad_like(param: torch.Tensor, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    grad = torch.empty_like(param, memory_format=torch.preserve_format)  # laid out as the param
    return grad.copy_(torch.randn(param.shape, generator=gen))


def _assert_same_adamw(plain, offloaded, a, b) -> None:
    assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(plain.state[a][key], offloaded.state[b][key]), key
        assert plain.state[a][key].stride() == offloaded.state[b][key].stride(), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", [{"fused": True}, {"foreach": True}, {"foreach": False}])
@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_bytes": 64}, {"gpu_resident_bytes": 2**30}],
    ids=["one_chunk", "sliced_neighbour", "resident"],
)
def test_adamw_on_any_param_layout_is_bitwise_equal(layout, implementation, options):
    # A contiguous neighbour that small chunks slice, next to the strided param.
    a, b = _param_like(LAYOUTS[layout], 0), _param_like(LAYOUTS[layout], 0)
    a_bias, b_bias = (
        _param_like(lambda: torch.randn(40), 1),
        _param_like(lambda: torch.randn(40), 1),
    )
    plain = torch.optim.AdamW([a, a_bias], lr=0.1, **implementation)
    offloaded = CPUOffloadOptimizer(
        torch.optim.AdamW([b, b_bias], lr=0.1, **implementation), **options
    )
    for step in range(3):
        a.grad, b.grad = _grad_like(a, step), _grad_like(b, step)
        a_bias.grad, b_bias.grad = _grad_like(a_bias, step), _grad_like(b_bias, step)
        plain.step()
        offloaded.step()
    _assert_same_adamw(plain, offloaded, a, b)
    _assert_same_adamw(plain, offloaded, a_bias, b_bias)


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(32, 8)  # the weight is cut into slices by chunks of 64 bytes


def _backward(model: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(2, 32)).square().sum().backward()


def test_a_second_wrapper_over_one_optimizer_is_refused_until_the_first_is_closed():
    inner = torch.optim.AdamW(_linear().parameters())
    first = CPUOffloadOptimizer(inner)
    with pytest.raises(ValueError, match=r"AdamW is already wrapped.*close\(\) that one first"):
        CPUOffloadOptimizer(inner)
    first.close()
    CPUOffloadOptimizer(inner)  # a closed wrapper lets go of it


def test_a_dropped_wrapper_lets_go_of_its_optimizer():
    inner = torch.optim.AdamW(_linear().parameters())
    CPUOffloadOptimizer(inner)
    gc.collect()
    CPUOffloadOptimizer(inner)


def test_state_dict_hooks_on_the_wrapper_are_called_as_torch_calls_them():
    calls = []
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _backward(model)
    opt.step()

    def state_dict_post(optimizer, state_dict):
        calls.append(("save_post", optimizer))
        return {**state_dict, "extra": 1}

    def load_pre(optimizer, state_dict):
        calls.append(("load_pre", optimizer, state_dict.get("extra")))
        state_dict = dict(state_dict)
        del state_dict["extra"]
        return state_dict

    opt.register_state_dict_pre_hook(lambda optimizer: calls.append(("save_pre", optimizer)))
    opt.register_state_dict_post_hook(state_dict_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    handle = opt.register_load_state_dict_post_hook(
        lambda optimizer: calls.append(("load_post", optimizer))
    )
    saved = opt.state_dict()
    assert saved["extra"] == 1
    opt.load_state_dict(saved)
    assert saved["extra"] == 1  # torch hands the hooks a shallow copy
    assert calls == [
        ("save_pre", opt),
        ("save_post", opt),
        ("load_pre", opt, 1),
        ("load_post", opt),
    ]
    handle.remove()
    opt.load_state_dict(saved)
    assert [c[0] for c in calls[4:]] == ["load_pre"]


def _two_linears(seed: int = 0) -> torch.nn.Sequential:
    # Two modules: the backward (`load_in_backward`) loads in the first one's.
    return torch.nn.Sequential(_linear(seed), torch.nn.Linear(8, 8))


class _Twin:
    """A plain optimizer and an offloaded one over two copies of one model."""

    def __init__(self, make, seed: int = 0, overlap: bool = False, **options) -> None:
        self.plain_model, self.model = _two_linears(seed), _two_linears(seed)
        self.plain = make(self.plain_model.parameters())
        if overlap:
            options["overlap_forward"] = self.model
            # one slot: step() enqueues two chunks, so the rest run lazily in the forward
            options.setdefault("staging_slots", 1)
        self.opt = CPUOffloadOptimizer(make(self.model.parameters()), **options)

    def step(self, seed: int) -> None:
        for model, opt in ((self.plain_model, self.plain), (self.model, self.opt)):
            opt.zero_grad()
            _backward(model, seed)
            opt.step()

    def assert_equal(self) -> None:
        self.opt.wait_for_optimizer_step()
        for a, b in zip(self.plain_model.parameters(), self.model.parameters(), strict=True):
            assert torch.equal(a, b)
            for key, value in self.plain.state[a].items():
                assert torch.equal(value, self.opt.state[b][key]), key


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _rprop(params):  # no subset step: the serial path
    return torch.optim.Rprop(params, lr=1e-2)


def _muon(params):  # a subset step that never calls step()
    params = list(params)
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    return Muon([{"params": matrices}, {"params": others, "algorithm": "adamw"}], lr=1e-2)


@pytest.mark.parametrize(
    ("make", "options"),
    [
        (_adamw, {}),
        (_adamw, {"chunk_bytes": 64}),
        (_adamw, {"gpu_resident_bytes": 2**30}),
        (_adamw, {"chunk_bytes": 64, "overlap": True, "load_in_backward": True}),
        (_rprop, {}),
    ],
    ids=["adamw", "adamw_sliced", "adamw_resident", "adamw_loaded_in_backward", "serial"],
)
def test_state_replaced_by_hand_is_taken_at_the_next_step(make, options):
    twin = _Twin(make, **options)
    twin.step(0)
    twin.step(1)
    if options.get("load_in_backward"):  # the next backward loads state the hand replaces
        assert twin.opt.chunks_loaded_in_backward > 0
    for opt, model in ((twin.plain, twin.plain_model), (twin.opt, twin.model)):
        for param in model.parameters():  # every param: an index found with == raised past the 1st
            state = opt.state[param]
            key = next(k for k, v in state.items() if v.ndim)
            state[key] = torch.full_like(state[key], 90.0)
    twin.step(2)
    twin.assert_equal()


def test_state_replaced_by_hand_with_the_wrong_shape_is_refused_naming_it():
    twin = _Twin(_adamw)
    twin.step(0)
    twin.opt.state[twin.model[0].weight]["exp_avg"] = torch.zeros(32)
    _backward(twin.model)
    with pytest.raises(
        ValueError, match=r"state 'exp_avg' of param 0 has shape \(32,\), expected \(8, 32\)"
    ):
        twin.opt.step()


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after_a_step"])
@pytest.mark.parametrize("shape", [(32,), (3, 32)], ids=["broadcastable", "not_broadcastable"])
def test_loaded_state_of_the_wrong_shape_is_refused_naming_param_and_key(stepped, shape):
    source = _linear()
    plain = torch.optim.AdamW(source.parameters())
    _backward(source)
    plain.step()
    saved = plain.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(shape)
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    if stepped:
        _backward(model)
        opt.step()
    with pytest.raises(
        ValueError, match=rf"state 'exp_avg' of param 0 has shape \({shape[0]},.*expected \(8, 32\)"
    ):
        opt.load_state_dict(saved)


def _adamw_pair(make_model, chunk_bytes: int, overlap: bool, **options):
    """Two copies of `make_model()`: plain AdamW on one, offloaded AdamW (with `options`)
    on the other."""
    plain_model, model = make_model(), make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    if overlap:  # one slot: step() enqueues two chunks, so the rest run lazily in the forward
        options.setdefault("staging_slots", 1)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=chunk_bytes,
        overlap_forward=model if overlap else None,
        **options,
    )
    return plain_model, plain, model, opt


def _odd_grad(param: torch.Tensor, kind: str, step: int) -> torch.Tensor:
    torch.manual_seed(200 + step)
    if kind == "transposed":
        return torch.randn(param.shape[::-1]).t()
    return torch.randn(param.shape[-1]).expand(param.shape)  # stride 0


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap_forward"])
@pytest.mark.parametrize("kind", ["transposed", "expanded"])
def test_non_contiguous_grads_on_a_sliced_param_step_exactly(kind, overlap):
    plain_model, plain, model, opt = _adamw_pair(_linear, 64, overlap)
    for step in range(3):
        for m, o in ((plain_model, plain), (model, opt)):
            m(torch.ones(1, 32))  # the overlapped step runs its chunks in the forward
            for p in m.parameters():
                p.grad = _odd_grad(p, kind, step)
            o.step()
    assert any(chunk.slices for chunk in opt._executor.chunks)
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[a][key], opt.state[b][key]), key


@pytest.mark.parametrize("first_sparse_step", [0, 1], ids=["from_the_first_step", "later"])
def test_sparse_grads_on_a_param_larger_than_a_chunk_step_it_whole(first_sparse_step):
    def run(wrap: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(20, 8, sparse=True), torch.nn.Linear(8, 16))
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        if wrap:  # the embedding's state is 640 bytes: more than a chunk
            opt = CPUOffloadOptimizer(opt, chunk_bytes=64)
        for step in range(3):
            opt.zero_grad()
            if step < first_sparse_step:  # the embedding gets no grad: sliced at first
                model[1](torch.ones(2, 8)).square().sum().backward()
            else:
                model(torch.tensor([[1, 3, 3], [step, 7, 1]])).square().sum().backward()
            opt.step()
        return model, opt

    (plain_model, plain), (model, opt) = run(False), run(True)
    sliced = [s.param for chunk in opt._executor.chunks for s in chunk.slices]
    assert all(p is not model[0].weight for p in sliced)
    assert any(p is model[1].weight for p in sliced)  # the dense Linear's still is
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(plain.state[a]["sum"], opt.state[b]["sum"])


def _interrupt_call(optimizer: torch.optim.Optimizer, call: int) -> None:
    """The optimizer's `call`-th step (one per chunk, but one for the chunks ready at the step's
    start) raises KeyboardInterrupt after updating."""
    calls, step = [0], optimizer.step

    def interrupted_step(*args, **kwargs):
        calls[0] += 1
        result = step(*args, **kwargs)
        if calls[0] == call:
            raise KeyboardInterrupt
        return result

    optimizer.step = interrupted_step


def _interrupt_chunk_call(monkeypatch, optimizer: torch.optim.Optimizer, call: int) -> None:
    """`_interrupt_call` where the wrapper steps a chunk at a time, through the subset step's
    calls of the optimizer's step (a patch of its `step` is refused there)."""
    from offload import subset_step

    calls, step = [0], subset_step.step_without_hooks

    def interrupted_step(stepped, *args, **kwargs):
        result = step(stepped, *args, **kwargs)
        if stepped is optimizer:
            calls[0] += 1
            if calls[0] == call:
                raise KeyboardInterrupt
        return result

    monkeypatch.setattr(subset_step, "step_without_hooks", interrupted_step)


def _three_linears(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))


@pytest.mark.parametrize(
    ("overlap", "load_in_backward", "chunk_bytes"),
    [(False, False, 600), (True, False, 600), (True, None, 300)],
    ids=["plain", "overlap_forward", "overlap_forward_backward_loads"],
)
def test_a_step_interrupted_mid_chunk_leaves_state_home_and_the_next_step_refuses(
    overlap, load_in_backward, chunk_bytes, monkeypatch
):
    model = _three_linears()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(
        inner,
        chunk_bytes=chunk_bytes,
        staging_slots=2,
        overlap_forward=model if overlap else None,
        load_in_backward=load_in_backward,  # None: the backward loads the first 2 chunks
    )
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    opt.wait_for_optimizer_step()  # model.state_dict() reads params outside a forward
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert len(opt._executor.chunks) == 6  # one weight or bias a chunk (the ring's ramp included)
    # With overlap, the 5th chunk runs in the next forward: the interrupt comes out of it.
    interrupted_chunk = 5 if overlap else 2
    # The 2 chunks loaded in the backward update in one call: the 5th chunk is the 4th call.
    _interrupt_chunk_call(monkeypatch, inner, interrupted_chunk - (load_in_backward is None))
    model(torch.ones(1, 8)).sum().backward()
    if load_in_backward is None:
        assert len(opt._executor.loaded_ahead) == 2
    with pytest.raises(KeyboardInterrupt):
        opt.step()
        model(torch.ones(1, 8))
    monkeypatch.undo()

    # The state is whole and at home: every state tensor in a host slab, no stray entries.
    slabs = {slab.untyped_storage().data_ptr() for slab in opt._executor.host_slabs.values()}
    state = opt.state
    assert len(state) == len(list(model.parameters()))
    for entries in state.values():
        for key, value in entries.items():
            if value.ndim:
                assert value.untyped_storage().data_ptr() in slabs, key
    with pytest.raises(
        RuntimeError,
        match=r"interrupted by KeyboardInterrupt while its chunks were stepping"
        r".*load_state_dict",
    ):
        opt.step()
    # A "checkpoint on Ctrl-C" handler is told that what it saves is part of a step.
    with pytest.warns(UserWarning, match=r"not whole: the last step\(\) was interrupted"):
        opt.state_dict()
    if overlap:  # and so is one saving the model's (its hooks are the overlap's), once
        for prefix in ("", "wrapped."):  # a wrapper above the model gives one (DDP's)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                model.state_dict(prefix=prefix)
            assert ["not a whole step" in str(w.message) for w in said] == [True], prefix

    # The way out: restore both from the checkpoint, then the run is plain AdamW's.
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    plain_model = _three_linears()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain_model(torch.ones(1, 8)).sum().backward()
    plain.step()
    for m, o in ((plain_model, plain), (model, opt)):
        o.zero_grad()
        m(torch.ones(1, 8)).sum().backward()
        o.step()
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(plain.state[a][key], opt.state[b][key]), key


def test_after_an_interrupted_step_a_new_wrapper_goes_on_from_the_state_at_home(monkeypatch):
    model = _three_linears()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=600)
    _interrupt_chunk_call(monkeypatch, inner, 2)
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    at_home = copy.deepcopy(opt.state_dict())
    opt.close()
    again = CPUOffloadOptimizer(inner, chunk_bytes=600)
    assert all(
        torch.equal(value, again.state_dict()["state"][index][key])
        for index, entries in at_home["state"].items()
        for key, value in entries.items()
    )
    again.step()


def test_an_interrupted_serial_step_leaves_the_state_at_home_as_plain_torch_leaves_it():
    """The serial path steps all at once, as the plain optimizer: interrupted, its state
    is the plain one's, at home, and the run goes on as the plain one does."""
    twin = _Twin(_rprop)
    twin.step(0)
    for model, opt in ((twin.plain_model, twin.plain), (twin.model, twin.opt)):
        inner = opt.optimizer if isinstance(opt, CPUOffloadOptimizer) else opt
        _interrupt_call(inner, 1)
        _backward(model, 1)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        del inner.step
    homes = {id(home.home_state) for home in twin.opt._executor.homes.values()}
    assert all(id(v) in homes for e in twin.opt.state.values() for v in e.values() if v.ndim)
    twin.step(2)
    twin.assert_equal()


def _counting_hooks(optimizer: torch.optim.Optimizer, calls: list[str], name: str) -> None:
    def pre(opt, args, kwargs):
        calls.append(f"{name} pre")
        assert opt is optimizer and args[0] is optimizer
        for group in opt.param_groups:  # what a logging hook reads: the real params
            assert all(p.device.type != "meta" for p in group["params"])

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(f"{name} post"))


def _muon_model_and_optimizer():
    from muon import Muon

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(4)))
    return model, Muon(model.parameters(), lr=0.02)


@pytest.mark.parametrize(
    "inner, options",
    [
        ("adamw", {"chunk_bytes": 2000}),  # several chunks, the last one sliced
        ("adamw", {"chunk_bytes": 2000, "overlap": True}),
        ("muon", {"chunk_bytes": 2000}),
        ("rprop", {}),  # no subset step: the serial path steps it whole
    ],
)
def test_step_hooks_run_once_a_step_whatever_the_chunks(inner, options):
    """Step hooks on the wrapped optimizer run once a step (as without the wrapper), not
    once per chunk or never; torch's global step hooks run once a step, for the wrapper,
    and never see the meta-device dry runs that size the state."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    if inner == "muon":
        model, optimizer = _muon_model_and_optimizer()
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
        make = torch.optim.AdamW if inner == "adamw" else torch.optim.Rprop
        optimizer = make(model.parameters(), lr=1e-2)
    calls: list[str] = []
    _counting_hooks(optimizer, calls, "inner")
    options = dict(options)
    overlap = model if options.pop("overlap", False) else None
    opt = CPUOffloadOptimizer(optimizer, overlap_forward=overlap, staging_slots=2, **options)
    seen_by_global: list[torch.optim.Optimizer] = []

    def global_pre(o, args, kwargs):
        seen_by_global.append(o)
        assert all(p.device.type != "meta" for g in o.param_groups for p in g["params"])

    handles = [
        register_optimizer_step_pre_hook(global_pre),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append("global post")),
    ]
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
        opt.wait_for_optimizer_step()
    finally:
        for handle in handles:
            handle.remove()
    assert opt.plan is not None and (inner == "rprop" or len(opt.plan.chunks) > 1)
    assert calls == ["inner pre", "inner post", "global post"] * 3
    assert seen_by_global == [opt] * 3


def test_a_wrapped_pre_hook_that_replaces_the_arguments_is_refused_naming_the_way_out():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters())
    inner.register_step_pre_hook(lambda opt, args, kwargs: (args, {"closure": None}))
    opt = CPUOffloadOptimizer(inner)
    model(torch.ones(1, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"pre-hook of the wrapped AdamW .*register_step_pre_hook"
    ):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_compiled_step_runs_eagerly_and_bitwise(overlap):
    """torch.compile(opt.step), as torch's recipe compiles an optimizer's step: the wrapper's
    step runs eagerly (traced, it failed with a KeyError in the first plan's build)."""
    plain_model, plain, model, opt = _adamw_pair(_three_linears, 300, overlap)
    compiled = torch.compile(opt.step)
    for _ in range(3):
        for m, step in ((plain_model, plain.step), (model, compiled)):
            m.zero_grad()
            m(torch.ones(2, 8)).square().sum().backward()
            step()
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("options", [{}, {"chunk_bytes": 64}], ids=["one_chunk", "sliced"])
def test_sgd_state_dict_is_torchs_with_or_without_momentum(momentum, options):
    # SGD without momentum keeps no state; the wrapper's state_dict had an empty entry
    # per param
    a, b = _linear(), _linear()
    plain = torch.optim.SGD(a.parameters(), lr=0.1, momentum=momentum)
    offloaded = CPUOffloadOptimizer(
        torch.optim.SGD(b.parameters(), lr=0.1, momentum=momentum), **options
    )
    for step in range(2):
        _backward(a, step)
        _backward(b, step)
        plain.step()
        offloaded.step()
    ref, got = plain.state_dict(), offloaded.state_dict()
    assert ref["param_groups"] == got["param_groups"]
    assert ref["state"].keys() == got["state"].keys()
    for index, entries in ref["state"].items():
        assert entries.keys() == got["state"][index].keys(), index
        for key, value in entries.items():
            assert torch.equal(value, got["state"][index][key]), (index, key)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _halving_pre_hook(optimizer: torch.optim.Optimizer, seen: list[int]) -> None:
    """A step pre-hook that scales the grads of what it steps (as a clipping hook does)."""

    def pre(opt, args, kwargs):
        seen.append(sum(len(group["params"]) for group in opt.param_groups))
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)

    optimizer.register_step_pre_hook(pre)


def _train_with_scheduler_built_first(make, wrap: bool, **options):
    """Three steps of `make` on `_two_linears()` with a halving pre-hook, an LR scheduler
    built on it before it is wrapped (when `wrap`), and torch's global step hooks counted;
    warnings are errors."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = _two_linears()
    inner = make(model.parameters())
    seen: list[int] = []
    _halving_pre_hook(inner, seen)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.9**step)
    opt = inner
    if wrap:
        overlap = model if options.pop("overlap", False) else None
        opt = CPUOffloadOptimizer(inner, overlap_forward=overlap, **options)
    stepped: list[torch.optim.Optimizer] = []
    handle = register_optimizer_step_post_hook(lambda o, args, kwargs: stepped.append(o))
    try:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("error")
            for seed in range(3):
                opt.zero_grad()
                _backward(model, seed)
                opt.step()
                scheduler.step()
    finally:
        handle.remove()
    if wrap:
        opt.wait_for_optimizer_step()
    assert seen == [4, 4, 4]  # once a step, seeing every param
    assert stepped == [opt] * 3
    return model, inner


@pytest.mark.parametrize(
    ("make", "options"),
    [
        (_adamw, {"chunk_bytes": 64}),
        (_adamw, {"chunk_bytes": 64, "overlap": True}),
        (_rprop, {}),
        (_muon, {"chunk_bytes": 64}),
    ],
    ids=["adamw_sliced", "adamw_overlapped", "serial", "muon"],
)
def test_a_scheduler_built_before_wrapping_leaves_step_hooks_once_a_step(make, options):
    """An LR scheduler built on the optimizer before it is wrapped patches its `step` on
    the instance; the wrapper ran that patch, and with it the step hooks, per chunk."""
    plain_model, plain = _train_with_scheduler_built_first(make, wrap=False)
    model, inner = _train_with_scheduler_built_first(make, wrap=True, **options)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert torch.equal(value, inner.state[b][key]), key


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True),
    ],
    ids=["adamw", "sgd_momentum"],
)
def test_fused_cpu_steps_on_params_cut_into_slices_are_bitwise_equal(make):
    """torch's CPU fused kernels round a vectorized body and a scalar tail differently: a
    slice must split there as the whole param does. 407 elements is not a whole number of
    vectors, and 1000-byte chunks cut both params, the second from its end."""
    plain_params = [_param_like(lambda: torch.randn(407), seed) for seed in (0, 1)]
    params = [_param_like(lambda: torch.randn(407), seed) for seed in (0, 1)]
    plain, offloaded = make(plain_params), CPUOffloadOptimizer(make(params), chunk_bytes=1000)
    for step in range(4):
        for a, b in zip(plain_params, params, strict=True):
            a.grad, b.grad = _grad_like(a, step), _grad_like(b, step)
        plain.step()
        offloaded.step()
    slices = [piece for chunk in offloaded.plan.chunks for piece in chunk.slices]
    assert len(slices) > 2
    for a, b in zip(plain_params, params, strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert torch.equal(value, offloaded.state[b][key]), key
    # and the cuts themselves, which a machine without vectors would not show
    assert all(piece.start % SLICE_ELEMENTS == 0 for piece in slices)


def test_lazy_params_are_refused_at_construction_naming_the_param_and_the_way_out():
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LazyLinear(2))
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError, match=r"param 2 is uninitialized .*Run the model's forward once first"
    ):
        CPUOffloadOptimizer(inner)
    model(torch.ones(1, 5)).sum().backward()  # the lazy params take their shape
    CPUOffloadOptimizer(inner).step()


@pytest.mark.parametrize(
    ("make", "options"),
    [
        (_adamw, {}),
        (_adamw, {"chunk_bytes": 64}),
        (_adamw, {"chunk_bytes": 64, "overlap": True}),
        (_rprop, {}),
    ],
    ids=["adamw", "adamw_sliced", "adamw_overlapped", "serial"],
)
def test_a_deleted_state_tensor_is_refused_naming_param_and_key(make, options):
    """Plain torch raises KeyError at the next step; the wrapper staged the deleted state
    tensor from its home and stepped with its old values."""
    twin = _Twin(make, **options)
    twin.step(0)
    twin.step(1)
    twin.opt.wait_for_optimizer_step()
    weight = twin.model[1].weight  # param 2
    key = next(k for k, v in twin.opt.state[weight].items() if v.ndim)
    deleted = twin.opt.state[weight][key].clone()
    del twin.opt.state[weight][key]
    before = [p.detach().clone() for p in twin.model.parameters()]
    twin.opt.zero_grad()
    _backward(twin.model, 2)
    with pytest.raises(KeyError, match=rf"state '{key}' of param 2 was deleted"):
        twin.opt.step()
    assert all(torch.equal(p, b) for p, b in zip(twin.model.parameters(), before, strict=True))
    twin.opt.state[weight][key] = deleted  # the way out the error names
    twin.step(2)
    twin.assert_equal()


@pytest.mark.parametrize("reset", ["del_param", "assign_empty", "clear"])
@pytest.mark.parametrize(
    ("make", "overlap"),
    [(_adamw, False), (_adamw, True), (_rprop, False)],
    ids=["adamw", "adamw_overlapped", "serial"],
)
def test_a_params_whole_state_reset_steps_as_torch(reset, make, overlap):
    # the serial path staged the old state into the fresh dict: Rprop then found no
    # `step` (a KeyError), and an optimizer filling in only missing keys kept old values
    twin = _Twin(make, chunk_bytes=64, overlap=overlap)
    twin.step(0)
    twin.step(1)
    for opt, model in ((twin.plain, twin.plain_model), (twin.opt, twin.model)):
        if reset == "clear":
            opt.state.clear()
        elif reset == "del_param":
            del opt.state[model[0].weight]
        else:
            opt.state[model[0].weight] = {}
    twin.step(2)
    twin.assert_equal()


class _SubclassedSGD(torch.optim.SGD):  # not a class with a subset step: the serial path
    pass


def test_state_of_another_dtype_loaded_before_the_first_step_takes_the_params_dtype():
    # torch's load casts floating state to the param's dtype; loaded before the first step,
    # the serial path kept a bf16 checkpoint's momentum in bf16 (other bits from then on)
    def run(wrap: bool) -> torch.nn.Linear:
        model = _linear()
        opt = _SubclassedSGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = CPUOffloadOptimizer(opt) if wrap else opt
        opt.load_state_dict(copy.deepcopy(saved))
        for seed in range(3):
            _backward(model, seed)
            opt.step()
            opt.zero_grad()
        assert all(v.dtype == torch.float32 for e in opt.state.values() for v in e.values())
        return model

    source = _linear()
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    _backward(source, 9)
    optimizer.step()
    saved = optimizer.state_dict()
    for entries in saved["state"].values():
        entries["momentum_buffer"] = entries["momentum_buffer"].to(torch.bfloat16)
    for a, b in zip(run(False).parameters(), run(True).parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("key", ["step", "exp_avg"])
def test_loaded_state_lacking_a_key_the_step_reads_is_refused_at_the_load(key):
    # a state_dict without `step` loaded; the first step raised a bare KeyError from
    # torch's Adam and refused every step after it (torch's own load raises)
    source = _linear()
    optimizer = torch.optim.AdamW(source.parameters(), lr=0.1)
    _backward(source, 9)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    for entries in saved["state"].values():
        del entries[key]
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    with pytest.raises(KeyError, match=rf"state of param 0 lacks '{key}'"):
        opt.load_state_dict(saved)
    # refused whole: the optimizer steps on, as plain AdamW with no state loaded
    plain_model = _linear()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.1)
    for m, o in ((plain_model, plain), (model, opt)):
        _backward(m, 0)
        o.step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_loaded_state_that_requires_grad_steps_as_torch_steps_it(overlap):
    # a checkpoint whose state tensors require grad: torch's optimizer steps them (under
    # no_grad); the wrapper copied them into its homes with the autograd graph, and its
    # next step raised "a leaf Variable that requires grad is being used in an in-place
    # operation"
    source = _linear()
    optimizer = torch.optim.AdamW(source.parameters(), lr=0.1)
    _backward(source, 9)
    optimizer.step()
    saved = optimizer.state_dict()
    for entries in saved["state"].values():
        entries["exp_avg"].requires_grad_(True)

    def run(wrap: bool) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
        model = _linear()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        if wrap:
            opt = CPUOffloadOptimizer(opt, overlap_forward=model if overlap else None)
        opt.load_state_dict(copy.deepcopy(saved))
        for seed in range(3):
            _backward(model, seed)
            opt.step()
            opt.zero_grad()
        if wrap:
            opt.wait_for_optimizer_step()
        return model, opt

    (plain_model, plain), (model, opt) = run(False), run(True)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(plain.state[a]["exp_avg"], opt.state[b]["exp_avg"].detach())
    opt.close()


def test_muons_fp32_momentum_of_bf16_params_loaded_before_the_first_step_stays_fp32():
    # Loaded before the first step (no slab yet), the held copy took the param's dtype:
    # bf16 params' fp32 momentum was rounded to bf16, and the resumed run went elsewhere
    from muon import Muon

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        linears = (torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
        return torch.nn.Sequential(*linears).bfloat16()

    def train(m, opt, seeds) -> None:
        for seed in seeds:
            opt.zero_grad()
            gen = torch.Generator().manual_seed(seed)
            m(torch.randn(4, 8, generator=gen).bfloat16()).float().square().sum().backward()
            opt.step()

    source = model()
    source_opt = CPUOffloadOptimizer(Muon(source.parameters(), lr=0.02), chunk_bytes=64)
    train(source, source_opt, range(2))
    saved = copy.deepcopy((source.state_dict(), source_opt.state_dict()))
    train(source, source_opt, range(2, 4))  # uninterrupted
    resumed = model()
    resumed.load_state_dict(saved[0])
    resumed_opt = CPUOffloadOptimizer(Muon(resumed.parameters(), lr=0.02), chunk_bytes=64)
    resumed_opt.load_state_dict(saved[1])
    for p in resumed.parameters():
        assert resumed_opt.state[p]["momentum_buffer"].dtype == torch.float32
    train(resumed, resumed_opt, range(2, 4))
    for a, b in zip(source.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class _GlobalStepSGD(torch.optim.Optimizer):
    """SGD whose lr falls with a step count kept in `state["global"]`, a key no group lists."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        count = self.state["global"]
        count["t"] = count.get("t", 0) + 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / count["t"])


def test_saved_state_under_a_key_no_group_lists_loads_as_torch_loads_it():
    # the wrapper refused every checkpoint of an optimizer keeping such state, its own too,
    # advising to drop the entry (which resets that state; found by a hostile audit);
    # before that, a bare KeyError
    runs = []
    for wrap in (False, True):
        p = nn.Parameter(torch.ones(4))
        opt = _GlobalStepSGD([p])
        opt = CPUOffloadOptimizer(opt) if wrap else opt
        for _ in range(2):
            p.grad = torch.ones(4)
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        saved["state"][99] = {"exp_avg": torch.zeros(3)}  # a stray entry: kept as it is
        opt.load_state_dict(saved)
        p.grad = torch.ones(4)
        opt.step()
        runs.append((p.detach().clone(), opt.state_dict()["state"]))
    (plain, plain_state), (wrapped, wrapped_state) = runs
    assert torch.equal(plain, wrapped)
    assert wrapped_state["global"] == plain_state["global"] == {"t": 3}
    assert torch.equal(wrapped_state[99]["exp_avg"], plain_state[99]["exp_avg"])


def test_the_staging_views_an_error_leaves_in_its_traceback_stay_readable():
    # What a debugger or pytest's report reads in the frames of an error raised inside the
    # wrapped step: its staging views pointed at the ring's memory, given back at once
    # (reading them crashed the process)
    model = _three_linears()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=600, staging_slots=2
    )
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    opt.state[list(model.parameters())[3]]["step"] = 3  # a number where torch keeps a tensor
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="state_steps") as caught:
        opt.step()
    read, tb = 0, caught.tb
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.Tensor):
                    item.sum()
                    read += 1
        tb = tb.tb_next
    assert read > 0


def _set_algorithm(twin: _Twin, algorithm: str) -> None:
    for opt in (twin.plain, twin.opt):
        opt.param_groups[0]["algorithm"] = algorithm


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap_forward"])
@pytest.mark.parametrize("loaded", [False, True], ids=["stepped", "loaded"])
def test_a_muon_group_switched_to_adamw_and_back_steps_as_plain_muon(loaded, overlap):
    """Muon's matrices moved to AdamW (and back) between steps, as plain Muon allows. After
    a load, the moments the first AdamW step created were dropped (its staging slot, never
    written, went home: zeros, silently); without one, the step refused ("units changed;
    re-wrap it")."""
    twin = _Twin(_muon, overlap=overlap, chunk_bytes=64)
    twin.step(0)
    if loaded:
        saved = copy.deepcopy(twin.opt.state_dict())
        twin.opt.close()
        twin.opt = CPUOffloadOptimizer(
            _muon(twin.model.parameters()),
            chunk_bytes=64,
            staging_slots=1,
            overlap_forward=twin.model if overlap else None,
        )
        twin.opt.load_state_dict(saved)
    _set_algorithm(twin, "adamw")
    twin.step(1)
    twin.step(2)
    twin.assert_equal()
    _set_algorithm(twin, "muon")
    twin.step(3)
    twin.assert_equal()


def test_units_changed_while_auto_is_choosing_are_refused_saying_when_to_change_them():
    twin = _Twin(_muon, gpu_resident_bytes="auto")
    twin.step(0)
    _set_algorithm(twin, "adamw")
    _backward(twin.model, 1)
    with pytest.raises(RuntimeError, match=r"units .* changed between steps while .*'auto'"):
        twin.opt.step()


def test_state_of_the_wrong_shape_assigned_before_the_first_step_is_refused_naming_it():
    # adopted into the new plan's homes by a copy that broadcast it (plain torch raises)
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    opt.state[model.weight] = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros(1, 32),
        "exp_avg_sq": torch.zeros(8, 32),
    }
    _backward(model)
    with pytest.raises(
        ValueError, match=r"state 'exp_avg' of param 0 has shape \(1, 32\), expected \(8, 32\)"
    ):
        opt.step()


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after_a_step"])
def test_a_loaded_state_tensor_with_no_dims_where_the_step_keeps_one_is_refused(stepped):
    # a 0-dim `exp_avg` went to the optimizer's own load and was broadcast into the slab
    source = _linear()
    plain = torch.optim.AdamW(source.parameters())
    _backward(source)
    plain.step()
    saved = plain.state_dict()
    saved["state"][0]["exp_avg"] = torch.tensor(0.5)
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    if stepped:
        _backward(model)
        opt.step()
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param 0 has shape \(\), expected"):
        opt.load_state_dict(saved)


def test_step_counters_saved_with_one_dim_count_once_a_step_on_sliced_params():
    # each slice of a sliced param stepped the one (1,)-shaped counter: 3 -> 9 in one step
    twin = _Twin(_adamw, chunk_bytes=64)
    twin.step(0)
    saved = copy.deepcopy(twin.plain.state_dict())
    for entries in saved["state"].values():
        entries["step"] = entries["step"].reshape(1)
    twin.opt.load_state_dict(copy.deepcopy(saved))
    twin.plain.load_state_dict(saved)
    twin.step(1)
    for a, b in zip(twin.plain_model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert twin.opt.state[b]["step"].item() == twin.plain.state[a]["step"].item() == 2


_ONE_ELEMENT_SCALARS = [
    (_adamw, "step"),
    (lambda ps: torch.optim.NAdam(ps, lr=1e-2), "mu_product"),
    (lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1), "eta"),
]


@pytest.mark.parametrize("door", ["wrapper", "inner", "assigned"])
@pytest.mark.parametrize(("make", "key"), _ONE_ELEMENT_SCALARS)
def test_one_element_scalars_step_once_and_keep_their_shape_on_sliced_params(make, key, door):
    # a per-param scalar of shape (1,) is no state the step homes: given to every slice of
    # a sliced param, each stepped it (Adam's step 3 -> 13); loaded through the inner
    # optimizer, assigned, or loaded through the wrapper (a KeyError in torch's load for
    # NAdam's mu_product, ASGD's eta; Adam's step came back 0-dim)
    twin = _Twin(make, chunk_bytes=64)
    twin.step(0)
    saved = copy.deepcopy(twin.plain.state_dict())
    for entries in saved["state"].values():
        entries[key] = entries[key].reshape(1)
    twin.plain.load_state_dict(copy.deepcopy(saved))
    if door == "wrapper":
        twin.opt.load_state_dict(saved)
    elif door == "inner":
        twin.opt.optimizer.load_state_dict(saved)
    else:
        for param, entries in zip(twin.model.parameters(), saved["state"].values(), strict=True):
            twin.opt.state[param][key] = entries[key]
    for seed in (1, 2):
        twin.step(seed)
    twin.assert_equal()
    for a, b in zip(twin.plain_model.parameters(), twin.model.parameters(), strict=True):
        assert twin.opt.state[b][key].shape == twin.plain.state[a][key].shape == (1,)


def test_a_counter_the_step_does_not_home_is_not_laid_out_again_every_step(monkeypatch):
    # a (1,)-shaped step counter has no home: every step asked for every param's state
    # layout again, to find the plan unchanged (3 ms a step for 200 params on a CPU)
    twin = _Twin(_adamw, chunk_bytes=64)
    twin.step(0)
    for plain, param in zip(twin.plain_model.parameters(), twin.model.parameters(), strict=True):
        for opt, p in ((twin.plain, plain), (twin.opt, param)):
            opt.state[p]["step"] = opt.state[p]["step"].reshape(1).clone()
    twin.step(1)
    subset = twin.opt._subset
    asked = []
    layout = subset.state_layout
    monkeypatch.setattr(subset, "state_layout", lambda p: asked.append(p) or layout(p))
    twin.step(2)
    assert asked == []
    twin.assert_equal()


@pytest.mark.parametrize("chunk_bytes", [64, 2**20])
@pytest.mark.parametrize("optimizer", ["amsgrad", "sgd"])
def test_state_the_step_did_not_keep_is_homed_once_options_keep_it(optimizer, chunk_bytes):
    # left without a home while the options did not keep it (amsgrad off after a load, a
    # momentum buffer assigned with momentum 0), it was not asked for again once they did
    # (found by a review): sliced params' slices got the whole tensor
    if optimizer == "amsgrad":
        twin = _Twin(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True), chunk_bytes=chunk_bytes
        )
        twin.step(0)
        for opt in (twin.plain, twin.opt):
            opt.param_groups[0]["amsgrad"] = False
        twin.step(1)
        for opt in (twin.plain, twin.opt):
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        key, option, value = "max_exp_avg_sq", "amsgrad", True
    else:
        twin = _Twin(lambda ps: torch.optim.SGD(ps, lr=1e-2), chunk_bytes=chunk_bytes)
        twin.step(0)
        for opt, model in ((twin.plain, twin.plain_model), (twin.opt, twin.model)):
            for p in model.parameters():
                opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
        key, option, value = "momentum_buffer", "momentum", 0.9
    twin.step(2)
    twin.step(3)  # the plan unchanged: the state is not kept
    for opt in (twin.plain, twin.opt):
        opt.param_groups[0][option] = value
    twin.step(4)
    twin.step(5)
    twin.assert_equal()
    assert key in {k for _, k in twin.opt._executor.homes}


def test_state_the_options_no_longer_keep_round_trips_as_torch_keeps_it():
    # amsgrad turned off after a step: torch keeps `max_exp_avg_sq` and saves it; a load
    # that refused tensors the step does not keep refused the wrapper's own checkpoint
    twin = _Twin(lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True), chunk_bytes=64)
    twin.step(0)
    for opt in (twin.plain, twin.opt):
        opt.param_groups[0]["amsgrad"] = False
    twin.step(1)
    saved, plain_saved = copy.deepcopy(twin.opt.state_dict()), twin.plain.state_dict()
    assert "max_exp_avg_sq" in saved["state"][0]
    twin.opt.load_state_dict(saved)
    twin.plain.load_state_dict(copy.deepcopy(plain_saved))
    twin.step(2)
    twin.assert_equal()


def test_a_muon_group_switched_to_adamw_with_a_param_left_without_a_grad():
    # the re-plan homes the moments it has not created yet: they read as "deleted"
    twin = _Twin(_muon, chunk_bytes=64)
    twin.step(0)
    _set_algorithm(twin, "adamw")
    for model, opt in ((twin.plain_model, twin.plain), (twin.model, twin.opt)):
        opt.zero_grad()
        _backward(model, 1)
        model[0].weight.grad = None
        opt.step()
    twin.step(2)
    twin.step(3)
    twin.assert_equal()


def test_units_reordered_after_auto_settled_move_each_state_tensor_to_its_new_home():
    # with one host layout kept for every plan, a re-plan of reordered units copied one
    # momentum buffer into another's old home before that one was read: swapped, silently
    from muon import Muon

    def make(params):
        w0, b0, w1, b1 = params
        groups = [{"params": [w0]}, {"params": [w1]}, {"params": [b0, b1], "algorithm": "adamw"}]
        return Muon(groups, lr=1e-2)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))

    plain_model, offloaded_model = model(), model()
    plain = make(list(plain_model.parameters()))
    opt = CPUOffloadOptimizer(make(list(offloaded_model.parameters())), gpu_resident_bytes="auto")

    def step(seed: int) -> None:
        for m, o in ((plain_model, plain), (offloaded_model, opt)):
            o.zero_grad()
            torch.manual_seed(100 + seed)
            m(torch.randn(2, 16)).square().sum().backward()
            o.step()

    seed = 0
    while opt.residency is None:
        step(seed)
        seed += 1
    units = opt._units_key
    for o in (plain, opt):
        o.param_groups[1]["row_blocks"] = [8, 8]
    step(seed)
    step(seed + 1)
    assert opt._units_key != units
    assert_equal(plain_model, plain, offloaded_model, opt)


def test_a_re_plan_refused_for_a_state_shape_changes_nothing():
    # refused after the old plan gave its GPU state back ("auto"): the next steps, once
    # mended, found a plan of no chunks and updated nothing
    twin = _Twin(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.0), gpu_resident_bytes="auto")
    seed = 0
    while twin.opt.residency is None:
        twin.step(seed)
        seed += 1
    for model, opt in ((twin.plain_model, twin.plain), (twin.model, twin.opt)):
        for group in opt.param_groups:
            group["momentum"] = 0.9
        opt.state[model[0].weight]["momentum_buffer"] = torch.zeros(1)
        opt.zero_grad()
        _backward(model, seed)
        with pytest.raises((RuntimeError, ValueError), match=r"shape"):
            opt.step()
        del opt.state[model[0].weight]["momentum_buffer"]
    twin.step(seed + 1)
    twin.step(seed + 2)
    twin.assert_equal()


@pytest.mark.parametrize("resident", [2**20, "auto"])
def test_state_a_re_plan_no_longer_homes_lets_go_of_the_old_slab(resident):
    # a Muon group switched to AdamW keeps its momentum buffer (as plain Muon does): as a
    # view of the old plan's slab (resident, or pinned on the host) it kept that whole slab
    twin = _Twin(_muon, gpu_resident_bytes=resident)
    seed = 1
    twin.step(0)
    while resident == "auto" and twin.opt.residency is None:
        twin.step(seed)
        seed += 1
    _set_algorithm(twin, "adamw")
    twin.step(seed)
    twin.step(seed + 1)
    twin.assert_equal()
    buffer = twin.opt.state[twin.model[0].weight]["momentum_buffer"]
    assert buffer.untyped_storage().nbytes() == buffer.nbytes


class _SharedScale(torch.optim.Optimizer):
    """A custom optimizer (the serial path) whose params share one state tensor, or keep
    the param itself as state."""

    def __init__(self, params, share: str):
        super().__init__(params, {"lr": 0.1})
        self.share = share

    @torch.no_grad()
    def step(self, closure=None):
        shared = None
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    if self.share == "param":
                        state["fast"] = p
                        continue
                    shared = torch.ones(1) if shared is None else shared
                    state["scale"] = shared
                if "scale" in state:
                    state["scale"].mul_(2.0)
                    p.add_(p.grad * state["scale"], alpha=-group["lr"])


@pytest.mark.parametrize(
    "share, message",
    [
        ("state", "state 'scale' of param 1 shares memory with state 'scale' of param 0"),
        ("param", r"state 'fast' of param (\d) shares memory with param \1\b"),
    ],
)
def test_state_shared_between_params_or_with_a_param_is_refused_naming_both(share, message):
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = CPUOffloadOptimizer(_SharedScale([a, b], share))
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match=message):
        opt.step()
    with pytest.raises(ValueError, match=message):  # every step, until it is not offloaded
        opt.step()


@pytest.mark.parametrize(
    "make, closure, message",
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-2), False, "which Adam does not"),
        (lambda ps: torch.optim.Adam(ps, lr=1e-2), True, "which Adam does not"),
        (
            lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
            False,
            "which fused Adagrad does not",
        ),
    ],
    ids=["adam", "adam_closure", "fused_adagrad"],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_sparse_grad_the_optimizer_refuses_is_refused_before_any_chunk_steps(
    make, closure, message, overlap
):
    model = torch.nn.ModuleDict(
        {"linears": _three_linears(), "table": torch.nn.Embedding(10, 8, sparse=True)}
    )
    opt = CPUOffloadOptimizer(
        make(model.parameters()), chunk_bytes=64, overlap_forward=model if overlap else None
    )

    def backward():
        x = torch.randn(2, 8)
        (model["linears"](x) + model["table"](torch.zeros(2, dtype=torch.long))).sum().backward()

    if not closure:
        backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"param 6 has a sparse grad, {message}"):
        opt.step(backward if closure else None)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    if closure:
        return
    model["table"].weight.grad = None  # as with plain torch, the user drops it and goes on
    opt.step()
    assert not torch.equal(next(model.parameters()), before[0])


def test_params_that_are_disjoint_views_of_one_buffer_step_as_torch():
    def params() -> list[torch.nn.Parameter]:
        buf = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
        # W[:, :4] and W[:, 4:]: their spans overlap, no byte does
        return [torch.nn.Parameter(buf[:, :4]), torch.nn.Parameter(buf[:, 4:])]

    ours, theirs = params(), params()
    opt = CPUOffloadOptimizer(torch.optim.Adam(ours, lr=0.1))
    plain = torch.optim.Adam(theirs, lr=0.1)
    for step in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad, q.grad = _grad_like(p, step), _grad_like(q, step)
        opt.step()
        plain.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
    # one tensor given as two params (W and W.t()) is refused at construction
    # (`test_two_params_over_the_same_elements_are_refused_at_construction`)


def _lbfgs_on_a_sparse_table(wrap: bool) -> torch.Tensor:
    table = torch.nn.Embedding(6, 3, sparse=True)
    table.weight.data = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    inner = torch.optim.LBFGS(table.parameters(), lr=0.5, max_iter=3)
    opt = CPUOffloadOptimizer(inner) if wrap else inner

    def closure():
        opt.zero_grad()
        loss = table(torch.tensor([0, 2, 2])).square().sum()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    return table.weight.detach().clone()


def test_lbfgs_takes_sparse_grads_offloaded_as_plain():
    assert torch.equal(_lbfgs_on_a_sparse_table(False), _lbfgs_on_a_sparse_table(True))


def _zeroed_first_moment(optimizer, state_dict):
    first = ("momentum_buffer", "exp_avg")
    state = {k: {n: torch.zeros_like(t) if n in first else t for n, t in v.items()}
             for k, v in state_dict["state"].items()}  # fmt: skip
    return {**state_dict, "state": state}


def _halved_second_moment(optimizer):
    for entries in optimizer.state.values():
        for key in {"momentum_buffer", "exp_avg_sq"} & set(entries):
            entries[key] = entries[key] / 2  # replaced, not edited in place


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
@pytest.mark.parametrize("overlap", [False, True])
def test_load_hooks_on_the_wrapped_optimizer_shape_what_loads_once(algorithm, overlap):
    calls: list[str] = []
    runs = []
    for wrap in (False, True):
        model = _three_linears()
        inner = (
            Muon(muon_param_groups(model), lr=0.02)
            if algorithm == "muon"
            else torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        opt = (
            CPUOffloadOptimizer(inner, chunk_bytes=300, overlap_forward=model if overlap else None)
            if wrap
            else inner
        )
        for step in range(2):
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
            opt.zero_grad()
        saved = copy.deepcopy(opt.state_dict())
        inner.register_load_state_dict_pre_hook(
            lambda o, sd: calls.append("pre") or _zeroed_first_moment(o, sd)
        )
        inner.register_load_state_dict_post_hook(
            lambda o: calls.append("post") or _halved_second_moment(o)
        )
        opt.load_state_dict(saved)
        for step in range(2, 4):
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
            opt.zero_grad()
        if wrap:
            opt.wait_for_optimizer_step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert calls == ["pre", "post"] * 2
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_state_aliased_through_another_storage_object_is_refused():
    import numpy as np

    buffer = np.zeros(12, dtype=np.float32)
    a, b = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
    inner = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    opt = CPUOffloadOptimizer(inner)
    inner.state[a]["momentum_buffer"] = torch.from_numpy(buffer[:8])  # two storage objects,
    inner.state[b]["momentum_buffer"] = torch.from_numpy(buffer[4:])  # four shared floats
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    with pytest.raises(ValueError, match="shares memory with"):
        opt.step()


def test_two_params_over_the_same_elements_are_refused_at_construction():
    # `head.weight = nn.Parameter(embed.weight)` makes a second param over the embedding's
    # memory: the chunks updated the shared elements in another order than torch's step,
    # silently (found by a hostile audit); params that are apart views of one buffer pass
    embed = nn.Embedding(40, 16)
    head = nn.Linear(16, 40, bias=False)
    head.weight = nn.Parameter(embed.weight)
    with pytest.raises(ValueError, match=r"param 1 \(shape \(40, 16\)\) shares memory with"):
        CPUOffloadOptimizer(torch.optim.AdamW([*embed.parameters(), *head.parameters()]))
    buffer = torch.zeros(24)
    apart = [nn.Parameter(buffer[:8]), nn.Parameter(buffer[8:].view(4, 4))]
    CPUOffloadOptimizer(torch.optim.AdamW(apart)).close()


def test_the_construction_check_indexes_no_byte_of_strided_params(monkeypatch):
    # column halves of one matrix: the check built an int64 per byte of both (1 GiB of
    # host memory for a 16 MiB matrix; found by review)
    import offload.cpu_offload as cpu_offload

    monkeypatch.setattr(cpu_offload, "_bytes_of", lambda t: pytest.fail("indexed bytes"))
    buffer = torch.zeros(64, 64)
    halves = [nn.Parameter(buffer[:, :32]), nn.Parameter(buffer[:, 32:])]
    CPUOffloadOptimizer(torch.optim.AdamW(halves)).close()


def test_a_self_overlapping_view_shares_no_byte_with_what_sits_in_its_gaps():
    from offload.cpu_offload import _check_cluster_apart, _overlapping_spans

    base = torch.zeros(16)
    gappy = base.as_strided((2, 2, 2), (1, 1, 5))  # elements 0, 1, 2, 5, 6, 7
    between = base.as_strided((2,), (1,), 3)  # elements 3, 4
    shared: list[tuple[str, str]] = []
    for cluster in _overlapping_spans([("a", gappy), ("b", between)]):
        _check_cluster_apart(cluster, lambda x, y: shared.append((x, y)))
    assert shared == []


def test_a_post_hook_a_load_pre_hook_registers_runs_in_that_load_as_torch_runs_it():
    seen = []
    for wrap in (False, True):
        model = _three_linears()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = CPUOffloadOptimizer(inner) if wrap else inner
        _backward_three(model)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        calls: list[str] = []

        def pre(optimizer, state_dict, calls=calls):
            optimizer.register_load_state_dict_post_hook(lambda o: calls.append("late post"))

        inner.register_load_state_dict_pre_hook(pre)
        opt.load_state_dict(saved)
        seen.append(calls)
    assert seen == [["late post"], ["late post"]]


def _backward_three(model: torch.nn.Module) -> None:
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0))).sum().backward()


def test_a_differentiable_optimizer_is_refused_at_wrapping_and_at_a_step():
    # differentiable=True records the step in autograd: non-leaf params failed deep in a
    # dry run ("grad_dtype can only be accessed on leaf tensors"), leaf params stepped
    # where torch refuses, and the chunked step's detached stand-ins cut the graph.
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"group 0 of the wrapped Adam has differentiable=True"):
        CPUOffloadOptimizer(torch.optim.Adam(model.parameters(), differentiable=True))
    opt = CPUOffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt.param_groups[0]["differentiable"] = True
    model(torch.ones(1, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"group 0 of the wrapped SGD has differentiable=True"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("case", ["sgd_momentum_made_late", "adagrad_sparse_grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_group_torch_steps_per_tensor_is_stepped_so_in_every_chunk(case, dtype):
    # torch's foreach SGD makes a group's momentum per tensor while one param in it has no
    # buffer yet, and foreach Adagrad steps a group per tensor where one grad is sparse;
    # the chunks without that param took the foreach ops, which round otherwise in half
    # precision on the CPU.
    def build():
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.ModuleDict(
            {"embed": torch.nn.Embedding(16, 8, sparse=case == "adagrad_sparse_grad")}
            | {f"lin{i}": torch.nn.Linear(8, 8) for i in range(3)}
        ).to(dtype)
        for p in model.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen))
        if case == "sgd_momentum_made_late":
            sgd = torch.optim.SGD(
                model.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True
            )  # nesterov: torch's foreach step adds the momentum into the grads in place
            return model, sgd
        return model, torch.optim.Adagrad(model.parameters(), lr=0.1, foreach=True)

    (plain_model, plain), (model, inner) = build(), build()
    opt = CPUOffloadOptimizer(inner, chunk_bytes=64)
    for step in range(3):
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            tokens = torch.arange(4) + step
            h = m["embed"](tokens).float()  # fp32 math: the CPU's half matmul rounds by address
            for i in range(3):
                if not (i == 0 and step == 0):  # lin0 gets its first grad at step 1
                    lin = m[f"lin{i}"]
                    h = torch.nn.functional.linear(h, lin.weight.float(), lin.bias.float())
            h.square().mean().backward()
            o.step()
        opt.wait_for_optimizer_step()
        for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
            if a.grad is None:
                assert b.grad is None
                continue
            assert torch.equal(a.grad.to_dense(), b.grad.to_dense()), (step, a.shape)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        for key, value in plain.state[a].items():
            assert torch.equal(opt.state[b][key], value), key


def test_muons_adamw_betas_list_edited_in_place_after_step_takes_effect_next_step():
    # betas as a list (a TOML / YAML / JSON config gives one), raised in place after each
    # step (a beta2 warmup): the pending chunks of an overlapped step read the list as it
    # was when step() ran, as a plain step does (they read the edited one: every param
    # differed from plain Muon)
    from muon import Muon, muon_param_groups

    def train(overlap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Module()  # embed and head go to AdamW, the head read last
        model.embed = torch.nn.Embedding(50, 32)
        model.mid = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(6)])
        model.head = torch.nn.Linear(32, 50, bias=False)
        model.forward = lambda tokens: model.head(model.mid(model.embed(tokens)))
        groups = muon_param_groups(model, adamw_options={"lr": 1e-2, "betas": [0.9, 0.95]})
        assert [len(g["params"]) for g in groups] == [6, 2]
        opt = Muon(groups, lr=0.02)
        if overlap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=4096, staging_slots=2, overlap_forward=model)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(50, (4, 8), generator=gen)
            model(tokens).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            for group in opt.param_groups:
                if group["algorithm"] == "adamw":
                    group["betas"][1] = min(0.999, group["betas"][1] + 0.01)
        model(tokens).sum()  # the last step's chunks land
        return [p.detach().clone() for p in model.parameters()]

    assert all(map(torch.equal, train(False), train(True)))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sliced_params_column_major_grad_holds_what_foreach_nesterov_adds(overlap):
    # torch's foreach SGD with nesterov adds the momentum into each grad in place; a param
    # cut into slices whose grad has no flat view (column-major) stepped a flat copy, and
    # p.grad after step() (a grad-norm log) was not what torch's step leaves there
    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True)
        if offload:
            opt = CPUOffloadOptimizer(
                opt, chunk_bytes=4096, overlap_forward=model if overlap else None
            )
        gen, seen = torch.Generator().manual_seed(1), []
        for _ in range(3):
            loss = model(torch.randn(8, 64, generator=gen)).square().mean()
            (grad,) = torch.autograd.grad(loss, [model.weight])
            model.weight.grad = grad.t().contiguous().t()  # the same values, column-major
            opt.step()
            seen.append(model.weight.grad.clone())  # waits for a pending step's chunks
        if offload:
            opt.close()
        return [*seen, model.weight.detach().clone()]

    assert all(map(torch.equal, run(False), run(True)))


def test_a_load_after_the_groups_params_were_reordered_is_refused_before_anything_loads():
    # the load paired saved tensor state with the params' order at wrapping and the inner
    # optimizer's `step` with the groups' order now: each param got one saved entry's
    # moments and another's step, silently (the next step refused)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(2)))
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=4096)
    model(torch.randn(2, 8)).square().mean().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["params"].reverse()
    with pytest.raises(RuntimeError, match="params changed after wrapping .* or reordered"):
        opt.load_state_dict(saved)
    opt.param_groups[0]["params"].reverse()
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), (index, key)


def _assert_same_in_dtypes(plain_model, plain, model, opt) -> None:
    """Params, and every state tensor in its dtype, bitwise equal."""
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain.state[a].items():
            assert opt.state[b][key].dtype == value.dtype, key
            assert torch.equal(opt.state[b][key], value), key


def _adagrad_then_cast(dtype: torch.dtype):
    def make(model: torch.nn.Module, wrap) -> torch.optim.Optimizer:
        opt = wrap(torch.optim.Adagrad(model.parameters(), lr=0.1))  # makes `sum` now, fp32
        model.to(dtype)
        return opt

    return make


def _sgd_with_fp64_momentum_by_hand(model: torch.nn.Module, wrap) -> torch.optim.Optimizer:
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.full(p.shape, 1 / 3, dtype=torch.float64)
    return opt


@pytest.mark.parametrize(
    "make",
    [
        _adagrad_then_cast(torch.bfloat16),
        _adagrad_then_cast(torch.float64),
        _sgd_with_fp64_momentum_by_hand,
    ],
    ids=["adagrad_then_bf16", "adagrad_then_fp64", "sgd_fp64_momentum_by_hand"],
)
@pytest.mark.parametrize("options", [{}, {"chunk_bytes": 64}], ids=["one_chunk", "sliced"])
def test_state_made_before_the_first_step_keeps_its_dtype_as_torch_keeps_it(make, options):
    # The first plan laid state out by a dry run in the param's dtype: the state torch
    # made at construction (Adagrad's `sum`, before `model.to(torch.bfloat16)`) or one
    # assigned by hand was cast to it, and every step from the first went elsewhere.
    def run(wrap):
        model = _linear()
        opt = make(model, wrap)
        dtype = model.weight.dtype
        for seed in range(3):
            torch.manual_seed(100 + seed)
            model(torch.randn(2, 32, dtype=dtype)).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    _assert_same_in_dtypes(*run(lambda o: o), *run(lambda o: CPUOffloadOptimizer(o, **options)))


@pytest.mark.parametrize("make", [torch.optim.Rprop, torch.optim.ASGD])
def test_the_serial_path_steps_a_dtype_whose_params_are_all_empty(make):
    # Its state has no elements, so the plan stages none of that dtype: staging the state
    # for the serial step raised a bare KeyError (torch.float64)
    def run(wrap):
        params = [
            torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))),
            torch.nn.Parameter(torch.zeros(0, dtype=torch.float64)),
        ]
        opt = wrap(make(params))
        for step in range(2):
            for p in params:
                p.grad = torch.full_like(p, 0.5 + step)
            opt.step()
        return params, opt

    (plain_params, plain), (params, opt) = run(lambda o: o), run(CPUOffloadOptimizer)
    assert_equal(torch.nn.ParameterList(plain_params), plain, torch.nn.ParameterList(params), opt)


def _reload(model: torch.nn.Module, opt, step: int) -> None:
    """A checkpoint round trip after the step: torch's load casts floating state to the
    param's dtype."""
    if step == 1:
        opt.load_state_dict(opt.state_dict())


def _fp64_momentum(model: torch.nn.Module, opt, step: int) -> None:
    """fp64 momentum assigned by hand after the first step: torch goes on with it."""
    if step == 0:
        for p in model.parameters():
            opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].double()


def _momentum_sgd_of(params) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(
    ("make", "edit"),
    [
        (_momentum_sgd_of, _reload),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), _reload),
        (torch.optim.Rprop, _reload),  # the serial path
        (_momentum_sgd_of, _fp64_momentum),
    ],
    ids=["sgd_reloaded", "adagrad_reloaded", "serial_rprop_reloaded", "sgd_fp64_by_hand"],
)
@pytest.mark.parametrize("options", [{}, {"chunk_bytes": 64}], ids=["one_chunk", "sliced"])
def test_state_given_another_dtype_after_steps_goes_on_in_it_as_torch(make, edit, options):
    # After `model.to(torch.bfloat16)` the state stays fp32, in torch and in its homes; a
    # load then casts it to bf16, which the homes took back in fp32. State assigned by
    # hand in another dtype after the first step was refused where torch goes on with it.
    def run(wrap):
        model = _linear()
        opt = wrap(make(model.parameters()))
        for step in range(4):
            if step == 1 and edit is _reload:
                model.to(torch.bfloat16)
            dtype = model.weight.dtype
            torch.manual_seed(100 + step)
            model(torch.randn(2, 32, dtype=dtype)).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
            edit(model, opt, step)
        return model, opt

    _assert_same_in_dtypes(*run(lambda o: o), *run(lambda o: CPUOffloadOptimizer(o, **options)))


def test_muons_momentum_replaced_by_hand_in_another_dtype_is_refused_naming_it():
    # Muon's own step casts such a momentum to fp32 (and an AdamW group's moments of
    # another dtype make it raise): the wrapper, planning anew, kept the old home's values
    model = _linear()
    opt = CPUOffloadOptimizer(Muon(muon_param_groups(model), lr=0.02))
    _backward(model)
    opt.step()
    opt.state[model.weight]["momentum_buffer"] = torch.ones(8, 32, dtype=torch.float64)
    _backward(model, 1)
    with pytest.raises(
        ValueError, match=r"'momentum_buffer' of param 0 was replaced by a torch.float64 tensor"
    ):
        opt.step()


def test_state_the_options_no_longer_read_replaced_in_another_dtype_steps_as_torch():
    # amsgrad turned off: max_exp_avg_sq is still homed but no longer in the layout, and
    # its replacement raised a bare KeyError looking up its dtype there
    def run(wrap):
        model = _linear()
        opt = wrap(torch.optim.AdamW(model.parameters(), lr=0.1, amsgrad=True))
        for step in range(3):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
            if step == 0:
                opt.param_groups[0]["amsgrad"] = False
                opt.state[model.weight]["max_exp_avg_sq"] = torch.ones(8, 32, dtype=torch.float64)
        return model, opt

    plain_model, plain, model, opt = *run(lambda o: o), *run(CPUOffloadOptimizer)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[a][key], opt.state[b][key]), key


def test_a_checkpoint_of_the_model_from_inside_a_chunk_lets_the_step_go_on(monkeypatch):
    # a signal handler saving the model while a chunk updates (on the trainer's thread):
    # the state-dict hook landed the step from inside it ("generator already executing"),
    # which interrupted the step for good
    from offload import subset_step

    def train(model, opt, checkpoint_in_call=None):
        calls, step = [0], subset_step.step_without_hooks

        def step_and_checkpoint(stepped, *args, **kwargs):
            result = step(stepped, *args, **kwargs)
            calls[0] += 1
            if calls[0] == checkpoint_in_call:
                model.state_dict()
            return result

        monkeypatch.setattr(subset_step, "step_without_hooks", step_and_checkpoint)
        for seed in range(3):
            opt.zero_grad()
            model(torch.ones(1, 8) * seed).sum().backward()
            opt.step()
        monkeypatch.undo()

    plain_model, plain, model, opt = _adamw_pair(_three_linears, 64, True, staging_slots=2)
    train(plain_model, plain)
    train(model, opt, checkpoint_in_call=9)  # a chunk the second step's forward runs
    opt.wait_for_optimizer_step()
    _assert_same_in_dtypes(plain_model, plain, model, opt)


@pytest.mark.parametrize("source", [[1, 0, 2], [0, 0, 1]], ids=["swapped", "shifted"])
def test_its_own_state_dict_loaded_with_entries_moved_loads_as_given(source):
    # state_dict() hands out views of the homes: copied home by home, a home written
    # first was read later as another param's source
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(3)))
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for seed in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
        opt.step()
    saved = opt.state_dict()
    given = copy.deepcopy(saved["state"])
    moved = {new: saved["state"][old] for new, old in enumerate(source)}
    opt.load_state_dict({"state": moved, "param_groups": saved["param_groups"]})
    loaded = opt.state_dict()["state"]
    for new, old in enumerate(source):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded[new][key], given[old][key]), (new, key)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 4, bias=False))


def _train(model: nn.Module, opt, steps: int = 3, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().mul(100).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _clamp_grads(optimizer, *_) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.clamp_(-0.01, 0.01)


class _ClippedMuon(Muon):
    """Muon clipping each grad before its step, in an override of `step`."""

    @torch.no_grad()
    def step(self, closure=None):
        _clamp_grads(self)
        return super().step(closure)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_muon_subclass_overriding_step_is_refused_and_a_step_pre_hook_is_exact(overlap):
    """The wrapper steps Muon through its subset step and never calls `step`: the
    override ran silently nowhere (the wrapped run equalled plain Muon's, not the
    subclass's). Refused at wrapping; the pre-hook it points to is bit-equal."""
    model = _tiny()
    with pytest.raises(TypeError, match=r"_ClippedMuon overrides step\(\).*register_step_pre_hook"):
        CPUOffloadOptimizer(
            _ClippedMuon(model.parameters(), lr=0.1), overlap_forward=model if overlap else None
        )
    model = _tiny()
    expected = _train(model, _ClippedMuon(model.parameters(), lr=0.1))
    model = _tiny()
    inner = Muon(model.parameters(), lr=0.1)
    inner.register_step_pre_hook(_clamp_grads)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=256, overlap_forward=model if overlap else None)
    got = _train(model, opt)
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_subclasses_that_keep_step_and_load_state_dict_are_taken():
    """No false refusals: a subclass adding nothing, and torch's `_patch_step_function`'s
    wrapper of the inherited `step` set on a subclass (unwrapped, the inherited one)."""
    import functools

    from offload.cpu_offload import _own_definitions

    class Plain(Muon):
        pass

    class Base:
        def step(self):
            pass

    class Patched(Base):
        pass

    Patched.step = functools.wraps(Base.step)(lambda self: Base.step(self))
    assert _own_definitions(Patched, "step", Base) == [Patched]  # a decorator of its own
    Patched.step.hooked = True  # as torch's `_patch_step_function` marks its wrapper
    assert _own_definitions(Patched, "step", Base) == []

    class Overriding(Patched):
        def step(self):
            pass

    assert _own_definitions(Overriding, "step", Base) == [Overriding]
    for cls in (Plain, type("PlainAdamW", (torch.optim.AdamW,), {})):
        model = _tiny()
        opt = CPUOffloadOptimizer(cls(model.parameters(), lr=0.1), chunk_bytes=256)
        _train(model, opt, steps=1)
        opt.load_state_dict(opt.state_dict())
        opt.close()


class _ResetOnLoad(torch.optim.AdamW):
    """On resume, keep the first moments and restart the second ones, in an override."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        _zero_second_moments(self)


def _zero_second_moments(optimizer) -> None:
    for entries in optimizer.state.values():
        if "exp_avg_sq" in entries:
            entries["exp_avg_sq"].zero_()


def test_a_load_state_dict_override_is_refused_before_loading_and_a_post_hook_is_exact():
    """The wrapper loads in parts (the groups, then the state it does not offload) and
    copies the rest into its homes itself: an override's edit of the offloaded state was
    silently lost, and one reading its own key of the state_dict raised a KeyError.
    Refused before anything loads; the load post-hook it points to is bit-equal, and so
    is a load into the optimizer before wrapping it."""
    model = _tiny()
    source = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, source, steps=2)
    weights, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(source.state_dict())

    def resume(make_opt):
        model = _tiny()
        model.load_state_dict(weights)
        opt = make_opt(model)
        params = _train(model, opt, seed=2)
        if isinstance(opt, CPUOffloadOptimizer):
            opt.close()
        return params

    def plain(model):
        opt = _ResetOnLoad(model.parameters(), lr=1e-2)
        opt.load_state_dict(copy.deepcopy(saved))  # torch's load keeps its `step` tensors
        return opt

    expected = resume(plain)

    def refused(model):
        opt = CPUOffloadOptimizer(_ResetOnLoad(model.parameters(), lr=1e-2), chunk_bytes=256)
        _train(model, opt, steps=1)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(TypeError, match="_ResetOnLoad overrides load_state_dict.*post_hook"):
            opt.load_state_dict(copy.deepcopy(saved))
        after = opt.state_dict()  # nothing loaded
        assert after["param_groups"] == before["param_groups"]
        for index, entries in before["state"].items():
            assert all(torch.equal(v, after["state"][index][k]) for k, v in entries.items())
        opt.close()

    refused(_tiny())

    def hooked(model):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        inner.register_load_state_dict_post_hook(_zero_second_moments)
        opt = CPUOffloadOptimizer(inner, chunk_bytes=256)
        opt.load_state_dict(copy.deepcopy(saved))
        return opt

    def loaded_before_wrapping(model):
        return CPUOffloadOptimizer(plain(model), chunk_bytes=256)

    for make in (hooked, loaded_before_wrapping):
        got = resume(make)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), make.__name__


def test_an_optimizer_not_set_up_by_torchs_init_is_refused_by_name():
    """A wrapper of another optimizer that skips `Optimizer.__init__` (as a lookahead
    wrapper does) failed with an AttributeError on a private attribute of torch's."""

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, base):  # noqa: D107 -- skips Optimizer.__init__ on purpose
            self.base_optimizer = base
            self.param_groups = base.param_groups
            self.defaults = base.defaults
            self.state = {}

        def step(self, closure=None):
            return self.base_optimizer.step(closure)

    model = _tiny()
    with pytest.raises(TypeError, match=r"Lookahead was not set up by torch.*Lookahead\(CPUOff"):
        CPUOffloadOptimizer(Lookahead(torch.optim.AdamW(model.parameters())))


def _clipping(step):
    @functools.wraps(step)
    def clipped(self, closure=None):
        _clamp_grads(self)
        return step(self, closure)

    return clipped


class _DecoratedClippedMuon(Muon):
    step = _clipping(Muon.step)  # functools.wraps: `__wrapped__` is Muon's step


class _ClipMixin:
    def step(self, closure=None):
        _clamp_grads(self)
        return super().step(closure)


class _MixedMuon(_ClipMixin, Muon):
    pass


def test_step_overrides_through_a_decorator_or_a_mixin_are_refused_naming_their_class():
    """Seen through with `inspect.unwrap`, a `functools.wraps` decorator of Muon's step
    looked inherited, and the wrapped run silently skipped its clipping; a mixin's step
    was named by the subclass torch patched (a review of the first cut)."""
    for cls, named in (
        (_DecoratedClippedMuon, "_DecoratedClippedMuon"),
        (_MixedMuon, "_ClipMixin"),
    ):
        model = _tiny()
        cls(model.parameters(), lr=0.1)  # made once: torch patches the class's step
        with pytest.raises(TypeError, match=rf"^{named} overrides step\(\)"):
            CPUOffloadOptimizer(cls(model.parameters(), lr=0.1))


def test_a_load_state_dict_set_on_the_instance_is_refused_and_an_override_warned_at_wrapping():
    """A patch on the instance was called in parts as an override was (its edit of the
    offloaded state lost); an override is said at wrapping, not first at a resume."""
    import types

    model = _tiny()
    inner = torch.optim.AdamW(model.parameters())
    plain_load = inner.load_state_dict
    inner.load_state_dict = types.MethodType(lambda self, sd: plain_load(sd), inner)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=256)
    _train(model, opt, steps=1)
    with pytest.raises(TypeError, match="the AdamW's load_state_dict is set on the instance"):
        opt.load_state_dict(opt.state_dict())
    opt.close()
    model = _tiny()
    with pytest.warns(UserWarning, match="_ResetOnLoad overrides load_state_dict: .* will refuse"):
        CPUOffloadOptimizer(_ResetOnLoad(model.parameters()), chunk_bytes=256).close()


def test_a_subset_step_served_by_getattr_is_wrapped_not_a_stop_iteration():
    """No class defines `begin_subset_step` (an attribute `__getattr__` serves): the class
    look-up raised a bare StopIteration (a review of the first cut)."""

    class Delegating(torch.optim.SGD):
        def __init__(self, params, inner):
            super().__init__(params, lr=0.1)
            self._inner = inner

        def __getattr__(self, name):
            if name in ("begin_subset_step", "state_layout"):
                return getattr(self.__dict__["_inner"], name)
            raise AttributeError(name)

    model = _tiny()
    opt = CPUOffloadOptimizer(Delegating(model.parameters(), Muon(model.parameters())))
    opt.close()


@pytest.mark.parametrize("closed", [False, True])
@pytest.mark.parametrize("make", ["adamw", "muon"])
def test_a_wrapped_optimizer_built_before_fully_shard_is_warned_about_at_its_second_step(
    make, closed
):
    # fully_shard replaces the params: the wrapped optimizer's old ones never get a grad,
    # and its steps updated nothing, silently (the loss never moved)
    from spawn_ranks import one_rank_group
    from torch.distributed.fsdp import fully_shard

    def no_grad_warnings(step) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        found = [w for w in caught if "no grad on any" in str(w.message)]
        assert all(w.filename == __file__ for w in found)  # the user's line
        return [str(w.message) for w in found]

    with one_rank_group():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        inner = (
            torch.optim.AdamW(model.parameters(), lr=0.1)
            if make == "adamw"
            else Muon(model.parameters(), lr=0.1)
        )
        opt = CPUOffloadOptimizer(inner)
        fully_shard(model)

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            return loss

        def train():
            if closed:  # the grads come from the closure (Lightning passes one)
                opt.step(closure)
            else:
                closure()
                opt.step()

        assert no_grad_warnings(train) == []  # one such step may be a step before training
        (message,) = no_grad_warnings(train)
        assert (
            f"no grad on any of the wrapped {type(inner).__name__}'s 2 params two steps" in message
        )
        assert "build and wrap it after fully_shard" in message
        assert no_grad_warnings(train) == []  # once a run of them
        opt.close()

        opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
        before = [p.to_local().clone() for p in model.parameters()]
        assert no_grad_warnings(train) == no_grad_warnings(train) == []
        # a step with grads ends a run: one step without, one with, one without
        opt.zero_grad()
        assert no_grad_warnings(opt.step) == no_grad_warnings(train) == []
        opt.zero_grad()
        assert no_grad_warnings(opt.step) == []
        assert not any(
            torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True)
        )
        opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_momentum_buffer_set_to_none_starts_anew_as_torchs_sgd_does(overlap):
    # torch's SGD reads state.get("momentum_buffer"): None is a buffer not made yet, and
    # torch <= 2.2 saved None for every param at momentum 0; the wrapper crashed on it
    # ("'NoneType' object has no attribute 'shape'"), set by hand or loaded
    torch.manual_seed(0)
    model, plain_model = nn.Linear(64, 64), nn.Linear(64, 64)
    plain_model.load_state_dict(model.state_dict())
    opt = CPUOffloadOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        chunk_bytes=4096,
        overlap_forward=model if overlap else None,
    )
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)

    def train(steps: int, edit=None) -> None:
        for step in range(steps):
            for m, o in ((model, opt), (plain_model, plain)):
                o.zero_grad()
                m(torch.full((2, 64), step + 1.0)).square().sum().backward()
                o.step()
                if edit is not None and step == 0:
                    edit(m, o)

    train(2, lambda m, o: o.state[m.weight].__setitem__("momentum_buffer", None))
    saved = plain.state_dict()
    for entries in saved["state"].values():
        entries["momentum_buffer"] = None  # as a checkpoint of momentum 0 was saved
    opt.load_state_dict(saved)
    plain.load_state_dict(saved)
    train(2)
    opt.wait_for_optimizer_step()
    assert_equal(plain_model, plain, model, opt)


class _OwnSGD(torch.optim.SGD):
    """A subclass of torch's SGD (the wrapper steps it whole, not by its subset step)."""


def _stepped_beside_a_plain_one(make, after_first_step, bias: bool = True):
    """An offloaded and a plain optimizer `make(params)` over equal Linears, three steps
    each, `after_first_step(model, opt, plain_model, plain)` run after the first."""
    torch.manual_seed(0)
    model, plain_model = nn.Linear(16, 16, bias=bias), nn.Linear(16, 16, bias=bias)
    plain_model.load_state_dict(model.state_dict())
    opt = CPUOffloadOptimizer(make(model.parameters()), chunk_bytes=256)
    plain = make(plain_model.parameters())
    for step in range(3):
        for m, o in ((model, opt), (plain_model, plain)):
            o.zero_grad()
            m(torch.full((2, 16), step + 1.0)).square().sum().backward()
            o.step()
        if step == 0:
            after_first_step(model, opt, plain_model, plain)
    opt.wait_for_optimizer_step()
    return model, opt, plain_model, plain


@pytest.mark.parametrize(
    ("make", "momentum"), [(torch.optim.SGD, 0.0), (_OwnSGD, 0.9), (_OwnSGD, 0.0)]
)
def test_a_loaded_momentum_buffer_of_none_starts_anew_at_any_momentum_and_in_subclasses(
    make, momentum
):
    # torch <= 2.2 saved momentum_buffer=None at momentum 0: loaded with momentum 0 the
    # step keeps no buffer, and a subclass steps whole; both crashed on the None
    def load_nones(model, opt, plain_model, plain):
        saved = plain.state_dict()
        for group in saved["param_groups"]:
            group["momentum"] = momentum
        for entries in saved["state"].values():
            entries["momentum_buffer"] = None
        opt.load_state_dict(saved)
        plain.load_state_dict(saved)

    model, opt, plain_model, plain = _stepped_beside_a_plain_one(
        lambda params: make(params, lr=0.1, momentum=0.9), load_nones
    )
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        # at momentum 0 torch keeps the None it loaded; the wrapper dropped it (the same)
        ref = {k: v for k, v in plain.state[a].items() if v is not None}
        assert sorted(ref) == sorted(opt.state[b])
        assert all(torch.equal(v, opt.state[b][k]) for k, v in ref.items())


def test_a_none_momentum_buffer_in_torchs_muon_starts_anew():
    # torch.optim.Muon is defined in the module `torch.optim` itself: not taken as
    # torch's, its None entry crashed the wrapper
    def set_none(model, opt, plain_model, plain):
        opt.state[model.weight]["momentum_buffer"] = None
        del plain.state[plain_model.weight]["momentum_buffer"]  # torch's own: no None

    model, opt, plain_model, plain = _stepped_beside_a_plain_one(
        lambda params: torch.optim.Muon(params, lr=0.1), set_none, bias=False
    )
    assert_equal(plain_model, plain, model, opt)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize(
    ("make", "option", "on"),
    [
        (lambda params: torch.optim.AdamW(params, lr=0.1), "amsgrad", True),
        (lambda params: torch.optim.RMSprop(params, lr=0.01), "momentum", 0.5),
        (lambda params: torch.optim.RMSprop(params, lr=0.01), "centered", True),
    ],
    ids=["adamw-amsgrad", "rmsprop-momentum", "rmsprop-centered"],
)
def test_an_option_set_after_the_state_was_made_is_refused_before_any_chunk_steps(
    make, option, on, overlap
):
    # torch raises KeyError at step() with nothing changed, and goes on once the option is
    # undone; a chunk raised it after the earlier chunks had stepped (with overlap, in the
    # next forward), and every later step was refused as interrupted (hostile review)
    def run(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        opt = make(model.parameters())
        if wrap:
            opt = CPUOffloadOptimizer(
                opt, chunk_bytes=1, staging_slots=2, overlap_forward=model if overlap else None
            )
        x = torch.ones(2, 8)
        for step in range(3):
            model(x * (step + 1)).sum().backward()
            if step == 1:
                before = [p.detach().clone() for p in model.parameters()]
                opt.param_groups[0][option] = on
                refused = ValueError if wrap else KeyError
                # naming the option that changed (review: it named amsgrad for RMSprop)
                named = f"has no '.*Set '{option}' when" if wrap else None
                with pytest.raises(refused, match=named):
                    opt.step()
                for a, p in zip(before, model.parameters(), strict=True):
                    assert torch.equal(a, p.detach())
                opt.param_groups[0][option] = type(on)(0)
            opt.step()
            opt.zero_grad()
        if wrap:
            opt.wait_for_optimizer_step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_param_without_grad_when_amsgrad_was_turned_on_is_refused_once_it_has_one(overlap):
    # the options were marked checked at a step where the params with state had no grad
    # (frozen, an expert unused): at the step they had one, a chunk raised the KeyError
    # after the earlier chunks had stepped (review)
    def run(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        if wrap:
            opt = CPUOffloadOptimizer(
                opt, chunk_bytes=1, staging_slots=2, overlap_forward=model if overlap else None
            )
        x = torch.ones(2, 8)
        for step, trained in enumerate([(1, 2), (0,), (0, 1, 2), (0, 1, 2)]):
            model(x * (step + 1)).sum().backward()
            for i, layer in enumerate(model):
                if i not in trained:
                    layer.weight.grad = layer.bias.grad = None
            if step == 1:
                opt.param_groups[0]["amsgrad"] = True
            if step == 2:
                before = [p.detach().clone() for p in model.parameters()]
                # naming amsgrad, changed a step before these params were looked at (review)
                named = "has no 'max_exp_avg_sq'.*Set 'amsgrad' when" if wrap else None
                with pytest.raises(ValueError if wrap else KeyError, match=named):
                    opt.step()
                for a, p in zip(before, model.parameters(), strict=True):
                    assert torch.equal(a, p.detach())
                opt.param_groups[0]["amsgrad"] = False
            opt.step()
            opt.zero_grad()
        if wrap:
            opt.wait_for_optimizer_step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_sgd_momentum_turned_on_over_state_of_other_entries_steps_as_torchs():
    # torch's SGD makes the momentum buffer where the state lacks it (`state.get`): refused
    # as missing, every later step failed (review)
    def run(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if wrap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=1, staging_slots=2)
        for step in range(3):
            model(torch.ones(2, 8) * (step + 1)).sum().backward()
            if step == 1:
                opt.state[model[0].weight]["note"] = 1.0
                opt.param_groups[0]["momentum"] = 0.9
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_an_lr_schedule_of_numpy_scalars_dry_runs_no_step_after_the_first(monkeypatch):
    # a NumPy float lr counted as an option changed each step: every step dry-ran the
    # optimizer once per param shape (500 shapes: 27 -> 598 ms a step; review)
    import numpy as np

    from offload import subset_step

    model = nn.Sequential(*[nn.Linear(8, 8 + i) for i in range(4)])
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), chunk_bytes=1)
    dry_runs = []
    real = subset_step._meta_dry_run
    monkeypatch.setattr(
        subset_step, "_meta_dry_run", lambda *a, **k: dry_runs.append(1) or real(*a, **k)
    )
    for step, lr in enumerate(np.linspace(0.1, 0.01, 4, dtype=np.float32)):
        opt.param_groups[0]["lr"] = lr
        sum(layer(torch.ones(2, layer.in_features)).sum() for layer in model).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            dry_runs.clear()
    assert not dry_runs
