"""Forward overlap: the step's chunks run as the next forward reaches them, bitwise unchanged."""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import warnings
import weakref

import pytest
import torch

from offload import CPUOffloadOptimizer
from offload.forward_overlap import param_owners
from offload.step_schedule import plan_step


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Embedding(40, 16)]
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(16, 5))
    return torch.nn.Sequential(*layers)


def batches(steps: int):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 40, (3, 4), generator=gen) for _ in range(steps)]


def run(model, optimizer, data, after_step=None):
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for tokens in data:
        optimizer.zero_grad()
        loss = model(tokens).square().mean()
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        optimizer.step()
        sched.step()
        if after_step is not None:
            after_step()
    return losses


def assert_params_and_state_equal(plain_model, plain, model, opt) -> None:
    """Params and optimizer state bitwise equal to the plain optimizer's."""
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    ref, got = plain.state_dict()["state"], opt.state_dict()["state"]
    for index, entries in ref.items():
        for key, value in entries.items():
            assert torch.equal(value, got[index][key]), (index, key)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd"],
)
def test_overlapped_step_is_lazy_and_bitwise_equal(make):
    data = batches(5)
    plain_model, model = make_model(), make_model()
    plain = CPUOffloadOptimizer(make(plain_model.parameters()), chunk_bytes=1, staging_slots=2)
    overlapped = CPUOffloadOptimizer(
        make(model.parameters()), chunk_bytes=1, staging_slots=2, overlap_forward=model
    )
    head = model[-1].weight
    lazy = []

    def check_lazy():
        # the last layer's chunk is not run until the next forward reaches it (a torch
        # call on the head's weight would wait for it: look with torch functions off)
        lazy.append(not overlapped._overlap.step_enqueued)
        with torch._C.DisableTorchFunction():
            lazy.append(not torch.equal(head, plain_model[-1].weight))

    ref_losses = run(plain_model, plain, data)
    losses = run(model, overlapped, data, after_step=check_lazy)
    assert losses == ref_losses
    assert all(lazy)
    overlapped.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    ref, got = plain.state_dict(), overlapped.state_dict()
    for index, entries in ref["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, got["state"][index][key])


def test_chunks_follow_forward_order():
    model = make_model()
    # param_groups list the head first; the forward needs the embedding first
    params = list(model.parameters())
    opt = CPUOffloadOptimizer(torch.optim.AdamW(params[::-1]), chunk_bytes=1, overlap_forward=model)
    model(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    opt.step()
    opt.wait_for_optimizer_step()
    owners = param_owners(model)
    assert [m for m, _ in owners] == [m for m in model if any(True for _ in m.parameters())]
    module_of = {id(p): i for i, (_, ps) in enumerate(owners) for p in ps}
    order = [module_of[id(p)] for chunk in opt._executor.chunks for p in chunk.touched]
    assert order == sorted(order) and set(order) == set(module_of.values())


def test_overlap_needs_a_subset_step():
    class Custom(torch.optim.SGD):
        pass

    model = make_model()
    with pytest.raises(ValueError, match="subset step"):
        CPUOffloadOptimizer(Custom(model.parameters(), lr=0.1), overlap_forward=model)


def test_a_module_that_takes_no_hooks_is_named_and_leaves_none_behind():
    # torch.jit.script-ed: torch's own error named neither the module nor the overlap
    first = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(first, torch.jit.script(torch.nn.Linear(16, 4)))
    with pytest.raises(RuntimeError, match="module '1' .*takes no hooks.* overlap_forward None"):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
    assert not first._forward_pre_hooks


@pytest.mark.parametrize(
    "options",
    [{"gpu_resident_bytes": "auto"}, {"gpu_resident_bytes": 10**9}],
    ids=["auto", "bytes"],
)
def test_residency_needs_a_subset_step(options):
    # the serial path accepted them and kept nothing resident, silently
    class Custom(torch.optim.SGD):
        pass

    model = make_model()
    with pytest.raises(ValueError, match="gpu_resident_bytes .* need an optimizer with a subset"):
        CPUOffloadOptimizer(Custom(model.parameters(), lr=0.1), **options)


def _train_plain_and_overlapped(set_to_none: bool):
    """Two steps of AdamW, plain and offloaded with overlap; the overlapped step is left
    pending. Returns (plain model, plain AdamW, overlapped model, its optimizer)."""
    plain_model, model = make_model(), make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    overlapped = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=1, overlap_forward=model
    )
    for m, opt in ((plain_model, plain), (model, overlapped)):
        for tokens in batches(2):
            opt.zero_grad(set_to_none=set_to_none)
            m(tokens).sum().backward()
            opt.step()
    return plain_model, plain, model, overlapped


def test_zero_grad_in_place_finishes_the_step_first():
    # zeroing in place would zero the grads the pending chunks read
    plain_model, _, model, overlapped = _train_plain_and_overlapped(set_to_none=False)
    overlapped.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_reading_state_finishes_the_overlapped_step_first():
    # `.state` handed out the host slabs with the pending chunks' state not yet written
    plain_model, plain, model, overlapped = _train_plain_and_overlapped(set_to_none=True)
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        for key, value in plain.state[p].items():
            assert torch.equal(value, overlapped.state[q][key]), key


def test_overlapped_chunks_ignore_the_forwards_autocast():
    from muon import Muon, muon_param_groups

    data = batches(3)
    models = [make_model(), make_model()]
    opts = []
    for model, overlap in zip(models, (None, True), strict=True):
        groups = muon_param_groups(model)
        muon = Muon(groups, lr=1e-2, ns_dtype=torch.float32, bucket_cap_bytes=1)
        opts.append(
            CPUOffloadOptimizer(
                muon, chunk_bytes=1, staging_slots=1, overlap_forward=overlap and model
            )
        )
    for model, opt in zip(models, opts, strict=True):
        for tokens in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):  # would turn NS matmuls bf16
                loss = model(tokens).float().square().mean()
            loss.backward()
            opt.step()
        opt.wait_for_optimizer_step()
    assert (
        len(opts[1]._executor.chunks) > 2 * opts[1].staging_slots
    )  # some chunks ran inside forward
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def _encoder(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
        torch.nn.Linear(16, 3),
    )


def _train_encoder(model, opt, steps: int = 4, compiled=None, scheduler=None):
    run = compiled or model
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 5, 8, generator=gen)
        opt.zero_grad()
        loss = run(x).square().mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return losses


@pytest.mark.parametrize("case", ["functional_reads", "tensor_lr"])
def test_overlap_is_bitwise_in_harder_cases(case):
    # functional_reads: nn.MultiheadAttention reads out_proj.weight without out_proj's forward;
    # tensor_lr: a scheduler updates a tensor lr in place while chunks are pending.
    def make(params):
        lr = torch.tensor(1e-2) if case == "tensor_lr" else 1e-2
        return torch.optim.AdamW(params, lr=lr)

    plain_model, model = _encoder(), _encoder()
    plain = CPUOffloadOptimizer(make(plain_model.parameters()), chunk_bytes=1, staging_slots=1)
    overlapped = CPUOffloadOptimizer(
        make(model.parameters()), chunk_bytes=1, staging_slots=1, overlap_forward=model
    )
    results = []
    for m, opt in ((plain_model, plain), (model, overlapped)):
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
        results.append(_train_encoder(m, opt, scheduler=sched))
        opt.wait_for_optimizer_step()
    assert results[0] == results[1]
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_overlap_under_torch_compile_is_bitwise():
    plain_model, model = _encoder(), _encoder()
    plain = CPUOffloadOptimizer(torch.optim.AdamW(plain_model.parameters()), chunk_bytes=1)
    overlapped = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=1, staging_slots=1, overlap_forward=model
    )
    ref = _train_encoder(plain_model, plain)
    got = _train_encoder(model, overlapped, compiled=torch.compile(model, backend="eager"))
    overlapped.wait_for_optimizer_step()
    assert ref == got
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_full_graph_around_the_overlap_hooks_says_what_to_do():
    # fullgraph=True over a module holding params: Dynamo's error said "reason: None" and
    # hinted to remove the hook's torch.compiler.disable
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="compile FSDP2 units before"):
        compiled(torch.randn(3, 8))
    opt.close()


def test_chunks_enqueued_by_an_inference_forward_make_normal_state():
    def run(overlap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        opt = CPUOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            chunk_bytes=1,
            staging_slots=2,
            overlap_forward=model if overlap else None,
        )
        x = torch.randn(4, 8)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.inference_mode():  # validation right after the step
                model(x)
        opt.wait_for_optimizer_step()
        assert not any(t.is_inference() for s in opt.state.values() for t in s.values())
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_dropped_optimizer_is_collected_with_its_slabs(overlap, close):
    plain_model, model = make_model(), make_model()
    run(
        plain_model,
        CPUOffloadOptimizer(torch.optim.AdamW(plain_model.parameters(), lr=1e-2)),
        batches(3),
    )
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=1,
        staging_slots=2,
        overlap_forward=model if overlap else None,
        load_in_backward=overlap,
    )
    run(model, opt, batches(3))  # with overlap, the last step is still pending
    if close:
        opt.close()
        assert _hooks(model) == 0
    collected = [weakref.ref(opt), weakref.ref(opt._executor.host_slabs[torch.float32])]
    lost = overlap and not close  # dropped with its last step pending: said loudly
    gc.disable()  # freed when the last reference goes: no cycle keeps it (and its mode) alive
    try:
        with (
            pytest.warns(RuntimeWarning, match="collected with a step pending")
            if lost
            else (contextlib.nullcontext())
        ):
            del opt
        assert all(ref() is None for ref in collected)
    finally:
        gc.enable()
    assert _hooks(model) == 0  # a collected optimizer's hooks are removed
    assert torch._C._len_torch_function_stack() == 0  # nor is its pending-read mode left
    model(batches(1)[0])
    pairs = zip(plain_model.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs) != lost


@pytest.mark.parametrize("how", ["close", "collect"])
def test_a_wrapper_closed_or_collected_on_another_thread_leaves_no_mode_on_the_trainers(how):
    # A watchdog's close(), or a gc.collect() on another thread freeing a wrapper held in a
    # cycle: the pending-read mode, on the trainer thread's stack, was left there for good
    # (its own hooks, which would have taken it off, went with it), and every torch call
    # paid for it (nn.MultiheadAttention lost its fast path).
    import threading

    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=1, overlap_forward=model
    )
    run(model, opt, batches(2))  # the last step still pending: the mode is on this stack
    assert torch._C._len_torch_function_stack() == 1
    if how == "close":
        worker = threading.Thread(target=opt.close)
    else:
        opt.cycle = opt  # only the cycle collector frees it
        del opt
        worker = threading.Thread(target=gc.collect)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # collected with a step pending
        worker.start()
        worker.join()
    model(batches(1)[0])  # the next module call on this thread takes it off
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks  # and the drain goes too


def test_a_mode_orphaned_on_a_thread_that_ended_lets_the_drain_hook_go():
    # A training thread returned with a step pending, and the main thread closed the
    # optimizer: the orphan was kept under the ended thread's id, so the global hook that
    # drains orphans stayed for the process (and a new thread given that id re-orphaned it).
    import threading

    from offload import forward_overlap

    box = {}

    def train():
        model = make_model()
        box["opt"] = CPUOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=1, overlap_forward=model
        )
        run(model, box["opt"], batches(2))

    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    box.pop("opt").close()
    torch.nn.Linear(2, 2)(torch.ones(1, 2))  # any module call
    assert not forward_overlap._ORPHANS
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_an_optimizer_whose_wrapper_was_dropped_with_a_step_pending_refuses_to_step():
    # The chunks that had run left their params updated and their state in staging slots
    # (never home), the others nothing: a new wrapper on the same optimizer, or the optimizer
    # itself, went on stepping from params and state one step apart.
    import copy

    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=1, overlap_forward=model)
    run(model, opt, batches(1))
    opt.wait_for_optimizer_step()
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    run(model, opt, batches(2))  # its last step pending, its first chunks run in step()
    with pytest.warns(RuntimeWarning, match="collected with a step pending.*params and state"):
        del opt
        gc.collect()
    model(batches(1)[0]).sum().backward()
    with pytest.raises(RuntimeError, match=r"AdamW's CPUOffloadOptimizer was collected with"):
        inner.step()
    again = CPUOffloadOptimizer(inner, chunk_bytes=1, overlap_forward=model)
    with pytest.raises(RuntimeError, match=r"load_state_dict clears this"):
        again.step()
    seen = []  # a load hook registered after the refusal's runs too
    inner.register_load_state_dict_post_hook(lambda _: seen.append(1))
    model.load_state_dict(checkpoint[0])
    inner.load_state_dict(checkpoint[1])  # through the optimizer itself: it steps again
    assert seen == [1]
    again.load_state_dict(checkpoint[1])
    plain_model = make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    run(plain_model, plain, batches(3))
    run(model, again, batches(3)[1:])
    again.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_refusals_of_wrappers_dropped_pending_again_and_again_do_not_pile_up():
    # each wrapper dropped with a step pending, then a load, left one load hook behind on
    # the optimizer: 20 cycles, 20 hooks (found by a lifecycle audit)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = inner.state_dict()
    for _ in range(3):
        opt = CPUOffloadOptimizer(inner, chunk_bytes=1, overlap_forward=model)
        run(model, opt, batches(1))  # pending
        with pytest.warns(RuntimeWarning, match="collected with a step pending"):
            del opt
            gc.collect()
        inner.load_state_dict(saved)
    assert len(inner._optimizer_load_state_dict_post_hooks) <= 1
    assert not inner._optimizer_step_pre_hooks


def test_a_dropped_wrapper_leaves_no_hooks_on_the_optimizer_it_wrapped():
    # the optimizer outlives its wrapper (wrapped anew): each wrapper left two hooks on it
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt = CPUOffloadOptimizer(inner, chunk_bytes=1, overlap_forward=model)
        run(model, opt, batches(1))
        opt.wait_for_optimizer_step()
        del opt
        gc.collect()
        assert not inner._optimizer_state_dict_pre_hooks
        assert not inner._optimizer_load_state_dict_pre_hooks


def test_after_close_the_forward_no_longer_calls_the_optimizer(monkeypatch):
    from offload.forward_overlap import ForwardOverlap

    calls = []
    for name in ("_before_module", "_after_forward"):
        original = getattr(ForwardOverlap, name)
        monkeypatch.setattr(
            ForwardOverlap, name, lambda self, *a, _f=original: calls.append(1) or _f(self, *a)
        )
    plain_model, model = make_model(), make_model()
    plain = CPUOffloadOptimizer(torch.optim.AdamW(plain_model.parameters(), lr=1e-2))
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=1, overlap_forward=model
    )
    data = batches(3)
    run(plain_model, plain, data)
    run(model, opt, data)
    assert calls
    opt.close()  # finishes the pending step: params are final
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    calls.clear()
    model(data[0])
    assert not calls
    assert opt.state_dict()["state"]  # state stays readable
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


class _Checkpointed(torch.nn.Module):
    """Reruns its layers' forward (and their forward pre-hooks) in the backward."""

    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(*layers)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _checkpointed_model() -> torch.nn.Module:
    model = make_model()
    layers = list(model)
    pairs = [_Checkpointed(layers[i], layers[i + 1]) for i in range(1, 9, 2)]
    return torch.nn.Sequential(layers[0], *pairs, layers[-1])


@pytest.mark.parametrize("budget", [None, 5 * 2048 + 100, 2**40], ids=["ring", "5", "all"])
@pytest.mark.parametrize("case", ["plain", "checkpointed", "accumulated", "reloaded", "evaluated"])
def test_loads_in_the_backward_are_what_the_step_would_load_and_bitwise(case, budget):
    """The backward after a step's forward loads the next step's first chunks (one per
    slot, or as many as `load_in_backward`'s bytes hold, in extra slots); the step skips those
    loads; params and state match the plain optimizer."""
    build = _checkpointed_model if case == "checkpointed" else make_model
    plain_model, model = build(), build()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    slots = 3
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        chunk_bytes=2048,
        staging_slots=slots,
        overlap_forward=model,
        load_in_backward=True if budget is None else budget,
    )
    micro = 2 if case == "accumulated" else 1
    data = batches(5 * micro)
    for m, o in ((plain_model, plain), (model, opt)):
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)
        for step in range(5):
            o.zero_grad()
            for tokens in data[step * micro : (step + 1) * micro]:
                m(tokens).square().mean().backward()
                if o is opt and step > 0:
                    # loaded in the first backward after a step (state exists from step 1 on)
                    staged = [c for c in opt._executor.chunks if c.slot >= 0]
                    sizes = itertools.accumulate(c.invariant_bytes for c in opt.plan.chunks)
                    fits = sum(size <= (budget or 0) for size in sizes)
                    loads = slots if budget is None else fits
                    assert budget != 5 * 2048 + 100 or slots < loads < len(staged)
                    assert len(opt._executor.loaded_ahead) == loads
                    assert len(opt._executor.extra_slots) == loads
                    for index in opt._executor.loaded_ahead:
                        for home, staging in staged[index].copies:
                            # bits: a copy spans alignment padding (uninitialized, maybe NaN)
                            assert torch.equal(home.view(torch.uint8), staging.view(torch.uint8))
            if o is opt and case == "reloaded" and step == 3:
                opt.load_state_dict(opt.state_dict())  # the homes change: loaded again
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3)
            o.step()
            sched.step()
            if case == "evaluated":  # a forward without grads first: the next one watches
                with torch.no_grad():
                    m(data[0])
            if o is opt:
                dropped = case == "reloaded" and step == 3
                assert opt.chunks_loaded_in_backward == (0 if step == 0 or dropped else loads)
    opt.wait_for_optimizer_step()
    # the chunks loaded in the backward are full (no ramp up: nothing waits for their loads)
    assert [c.invariant_bytes for c in opt.plan.chunks[:2]] == [2048, 2048]
    assert_params_and_state_equal(plain_model, plain, model, opt)


@pytest.mark.parametrize("load_in_backward", [None, False], ids=["default", "off"])
def test_by_default_the_backward_loads_what_the_forward_first_waits_for(load_in_backward):
    """The embedding, read first, spans 3 chunks, more than the ring's 2: by default the
    backward loads all 3 (in extra slots), so the next forward starts without waiting
    for copies; False loads none. Bitwise equal to the plain optimizer either way."""
    plain_model = make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    model, opt = _loading_in_the_backward(load_in_backward, chunk_bytes=2048)
    run(plain_model, plain, batches(4))
    run(model, opt, batches(4))
    embedding = model[0].weight
    first = [
        c
        for c, chunk in enumerate(opt._executor.chunks)
        if any(p is embedding for p in chunk.touched)
    ]
    if load_in_backward is None:  # full chunks (the ring's ramp is for loads in the step)
        assert first == [0, 1, 2] and opt.chunks_loaded_in_backward == 3
        assert len(opt._executor.extra_slots) == 3
        assert opt.backward_load_bytes == sum(c.invariant_bytes for c in opt.plan.chunks[:3])
    else:
        assert opt.chunks_loaded_in_backward == 0 and not opt._executor.extra_slots
    opt.wait_for_optimizer_step()
    assert_params_and_state_equal(plain_model, plain, model, opt)


@pytest.mark.parametrize("regroup", ["merged", "split"])
def test_groups_regrouped_while_a_step_is_pending_leave_it_as_it_began(regroup):
    # the pending chunks stepped the live groups by the old group numbers: merged into
    # fewer groups, IndexError inside the next forward, and the step left interrupted
    def build(model):
        params = list(model.parameters())
        groups = [{"params": params[:5]}, {"params": params[5:], "lr": 1e-3}]
        return torch.optim.AdamW(groups, lr=1e-2)

    def regrouped(opt, model):
        params = list(model.parameters())
        first = opt.param_groups[0]
        if regroup == "merged":
            return [{**first, "params": params, "lr": 5e-3}]
        return [{**first, "params": params[:2]}, {**first, "params": params[2:], "lr": 5e-3}]

    plain_model, model = make_model(), make_model()
    plain = build(plain_model)
    opt = CPUOffloadOptimizer(build(model), chunk_bytes=128, staging_slots=2, overlap_forward=model)
    data = batches(4)
    for m, o in ((plain_model, plain), (model, opt)):
        for step, tokens in enumerate(data):
            o.zero_grad()
            m(tokens).square().mean().backward()
            o.step()
            if step == 1:
                o.param_groups = regrouped(o, m)
    opt.wait_for_optimizer_step()
    assert_params_and_state_equal(plain_model, plain, model, opt)


def test_the_room_under_the_peak_is_measured_before_the_plan_holds_resident_state(monkeypatch):
    """The plan's held bytes count its resident state; measured after the resident slabs
    were allocated, the room lacked them too, and the backward loaded fewer chunks than
    fit (resident state counted twice)."""
    from offload import cpu_offload

    events = []
    zeros = torch.zeros

    def allocating(*args, **kwargs):  # the resident slabs are the device's zeros
        if "device" in kwargs:
            events.append("resident state allocated")
        return zeros(*args, **kwargs)

    def room(device):
        events.append("room measured")
        return 2**30

    monkeypatch.setattr(torch, "zeros", allocating)
    monkeypatch.setattr(cpu_offload, "room_under_peak_bytes", room)
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=2048,
        staging_slots=2,
        overlap_forward=model,
        gpu_resident_bytes=6000,  # the embedding's 5120 bytes of state
    )
    run(model, opt, batches(1))
    assert opt.plan.resident_bytes > 0
    assert events.index("room measured") < events.index("resident state allocated")


@pytest.mark.parametrize("extra_chunks", [0, 2, 100], ids=["none", "two", "all"])
def test_by_default_the_backward_also_loads_what_fits_under_the_devices_peak(
    extra_chunks, monkeypatch
):
    """With a room under the device's peak (CUDA's allocator: its peak less what it holds
    at the first step), the default loads more chunks in the backward while the plan's
    state on the device fits in BACKWARD_ROOM_SHARE of it; bitwise equal either way."""
    from offload import cpu_offload

    _, sized = _loading_in_the_backward(None, chunk_bytes=2048)
    run(make_model(), sized, batches(1))
    chunks, slots = sized.plan.chunks, sized.staging_slots
    sized.close()
    mask = [not c.resident for c in chunks]
    first_wait = 3  # the embedding's chunks (the test above)

    def held(loads):
        return sized.plan.held_bytes(plan_step(mask, slots, loads, overlap=True).slots, slots)

    wanted = min(first_wait + extra_chunks, len(chunks))
    room = held(wanted) / cpu_offload.BACKWARD_ROOM_SHARE + 1
    monkeypatch.setattr(cpu_offload, "room_under_peak_bytes", lambda device: int(room))
    plain_model = make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    model, opt = _loading_in_the_backward(None, chunk_bytes=2048)
    run(plain_model, plain, batches(4))
    run(model, opt, batches(4))
    assert opt.chunks_loaded_in_backward == opt.schedule.backward_loads == wanted
    assert len(opt._executor.extra_slots) == wanted
    assert opt.backward_load_bytes == sum(c.invariant_bytes for c in opt.plan.chunks[:wanted])
    opt.wait_for_optimizer_step()
    assert_params_and_state_equal(plain_model, plain, model, opt)


def test_the_backwards_watch_keeps_no_activation_a_checkpointed_forward_frees():
    """The backward's loads are paced by hooks on owner modules' inputs: inside a
    checkpointed block those inputs are freed as the forward goes on, and the overlap
    must not hold them until its end (on the H200 a plain Llama's overlapped forward
    then held every checkpointed layer's activations: 4.9 GiB more at batch 4)."""
    torch.manual_seed(0)
    blocks = [
        _Checkpointed(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        for _ in range(3)
    ]
    model = torch.nn.Sequential(torch.nn.Embedding(40, 16), *blocks, torch.nn.Linear(16, 5))
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=2048, overlap_forward=model
    )
    inner_inputs: list[weakref.ref] = []  # each block's second Linear's input: not saved
    alive_at_the_head: list[int] = []
    for block in blocks:
        block.inner[2].register_forward_pre_hook(
            lambda _, args: inner_inputs.append(weakref.ref(args[0]))
        )
    model[-1].register_forward_pre_hook(
        lambda *_: alive_at_the_head.append(sum(r() is not None for r in inner_inputs))
    )
    data = batches(3)
    run(model, opt, data[:2])  # the forward after a step watches its owners' inputs
    assert opt.chunks_loaded_in_backward > 0
    inner_inputs.clear()
    alive_at_the_head.clear()
    model(data[2]).square().mean().backward()
    assert len(inner_inputs) == 6  # the forward's 3, and the backward's reruns
    assert alive_at_the_head == [0]
    assert opt.chunks_loaded_in_backward > 0  # and the watch still paced the loads


def test_the_backwards_watch_hooks_no_param_passed_as_an_input():
    """A param given to an owner module as its input (not read as its own weight) is a
    leaf: a hook on it stays after the backward, and the watch would add one a step."""

    class TableThroughLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))
            self.linear, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.linear(self.table))[ids]

    torch.manual_seed(0)
    model = TableThroughLinear()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=64, overlap_forward=model
    )
    ids = torch.tensor([1, 4, 7])
    for _ in range(4):
        model(ids).sum().backward()
        opt.step()
        opt.zero_grad()
    assert not model.table._backward_hooks
    assert opt.chunks_loaded_in_backward > 0  # the head's input still paces the loads


class _CountedState(collections.defaultdict):
    """An optimizer's state (a defaultdict of dicts) that counts its `get` calls."""

    gets = 0

    def get(self, *args):
        type(self).gets += 1
        return super().get(*args)


def test_the_backwards_loads_look_up_state_once_per_param_not_per_module():
    """`load_ahead` runs as the backward passes each module: looking up every param's
    state there made the backward's host time grow with params x modules."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(32)))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=1, staging_slots=2, overlap_forward=model)
    x = torch.ones(1, 4)
    model(x).sum().backward()
    opt.step()
    inner.state = _CountedState(dict, inner.state)
    opt.zero_grad()
    loss = model(x).sum()
    _CountedState.gets = 0
    loss.backward()
    assert len(opt._executor.loaded_ahead) == opt.schedule.backward_loads > 0
    assert _CountedState.gets <= 2 * len(list(model.parameters()))


def test_load_in_backward_needs_forward_overlap():
    model = make_model()
    with pytest.raises(ValueError, match="load_in_backward=True needs overlap_forward=model"):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), load_in_backward=True)


def _loading_in_the_backward(
    budget: int | bool | None, chunk_bytes: int = 512
) -> tuple[torch.nn.Module, CPUOffloadOptimizer]:
    """A model and an overlapped AdamW with `load_in_backward=budget`, 2 ring slots."""
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=chunk_bytes,
        staging_slots=2,
        overlap_forward=model,
        load_in_backward=budget,
    )
    return model, opt


def test_the_backward_spreads_its_loads_over_the_modules_it_passes():
    """Loads enqueued at once stalled the trainer's own copies in the backward (H200): each
    owner module the backward passes enqueues its share, the last one's nothing more."""
    model, opt = _loading_in_the_backward(2**40)
    calls = []
    load_ahead = opt._executor.load_ahead

    def recording(passed, watched):
        load_ahead(passed, watched)
        calls.append((passed, watched, len(opt._executor.loaded_ahead)))

    opt._overlap.backward_reached = recording
    data = batches(2)
    run(model, opt, data[:1])
    model(data[1]).square().mean().backward()
    staged = len([c for c in opt._executor.chunks if c.slot >= 0])
    assert staged >= 8
    # five Linear layers take inputs that need grads (the Embedding's are token ids)
    shares = [min(staged, -(-staged * passed // 4)) for passed in range(1, 6)]
    assert calls == [(passed, 5, shares[passed - 1]) for passed in range(1, 6)]
    assert shares[0] < staged and shares[3] == staged


def test_write_backs_of_the_backwards_chunks_go_after_the_rings():
    """Copies queue in the copy engine in the order they are enqueued: the forward waits
    for ring loads behind ring write-backs, and nothing waits for a backward-loaded chunk's
    write-back, so those go last."""
    model, opt = _loading_in_the_backward(8 * 512)
    events = []
    executor = opt._executor
    write_back = executor._write_back
    executor._write_back = lambda chunk, *a: (
        events.append(("back", chunk.slot)) or write_back(chunk, *a)
    )
    for index, module in enumerate(model):
        module.register_forward_pre_hook(lambda *_, i=index: events.append(("module", i)))
    data = batches(3)
    run(model, opt, data[:2])
    events.clear()
    model(data[2])
    backs = [slot for kind, slot in events if kind == "back"]
    extra_slots = sum(c.slot >= 2 for c in executor.chunks)  # (a chunk's repr reads freed slots)
    ring_slots = sum(0 <= c.slot < 2 for c in executor.chunks)
    assert extra_slots > 0 and ring_slots > 0
    assert backs == [s for s in backs if s < 2] + [s for s in backs if s >= 2]
    assert len(backs) == extra_slots + ring_slots


def test_the_backward_takes_each_chunks_slot_as_its_share_comes_and_not_the_ring():
    """The backward's loads go to slots of their own, each taken when its share is
    enqueued: the ring is taken by `step()`, and memory the backward's loads do not use
    is not held at its peak (the ring, taken there, raised the H200's batch-4 peak)."""
    model, opt = _loading_in_the_backward(8 * 512)
    data = batches(3)
    run(model, opt, data[:2])
    held = []
    load_ahead = opt._executor.load_ahead

    def recording(passed, watched):
        load_ahead(passed, watched)
        slots = [opt._executor.ring, *opt._executor.extra_slots]
        held.append([any(b.untyped_storage().nbytes() for b in s.buffers.values()) for s in slots])

    opt._executor.load_ahead = recording
    model(data[2]).square().mean().backward()
    loads = opt.schedule.backward_loads
    assert loads == len(opt._executor.extra_slots) > 2
    assert not any(ring for ring, *_ in held)  # the ring: never in the backward
    # each extra slot from its share on: more held as the backward passes its modules
    taken = [sum(extra) for _, *extra in held]
    assert taken == sorted(taken) and taken[0] < loads == taken[-1]
    opt.step()
    opt.wait_for_optimizer_step()


def test_the_ring_is_sized_for_the_chunks_it_takes_not_the_backwards():
    """A large embedding read first: the backward loads its chunks into slots of their own,
    and the ring, holding only the small chunks after them, is sized for those."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(20000, 16), *[torch.nn.Linear(16, 16) for _ in range(4)]
    )
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()),
        chunk_bytes=1 << 20,
        staging_slots=2,
        overlap_forward=model,
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 20000, (3, 4))).sum().backward()
        opt.step()
    opt.wait_for_optimizer_step()
    schedule, plan = opt.schedule, opt.plan
    sizes = [c.staging_bytes for c in plan.chunks]
    ring_sizes = [n for n, slot in zip(sizes, schedule.slots, strict=True) if 0 <= slot < 2]
    extra_sizes = [n for n, slot in zip(sizes, schedule.slots, strict=True) if slot >= 2]
    assert extra_sizes and ring_sizes
    assert max(ring_sizes) < min(extra_sizes)
    ring = sum(opt._executor.ring._nbytes.values())
    assert ring == schedule.ring_slots_taken * max(ring_sizes)
    extra = sum(sum(slot._nbytes.values()) for slot in opt._executor.extra_slots)
    assert (
        plan.held_bytes(schedule.slots, 2)
        == ring + extra
        == plan.ring_bytes(schedule.slots, 2) + extra
    )


def test_close_after_a_backward_that_loaded_gives_the_slots_back():
    """The backward's loads hold their slots until the step; close() in between gives that
    memory back (the chunks' views kept it while the wrapper lived)."""
    model, opt = _loading_in_the_backward(8 * 512)
    data = batches(3)
    run(model, opt, data[:2])
    model(data[2]).square().mean().backward()
    assert opt._executor.loaded_ahead
    chunks = opt._executor.chunks
    opt.close()
    staging = [b for c in chunks for _, b in c.copies]
    assert staging and all(b.untyped_storage().nbytes() == 0 for b in staging)


def test_an_overlapped_step_lets_go_of_each_chunks_grads_as_the_forward_passes():
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=1,
        staging_slots=2,
        overlap_forward=model,
    )
    first, last = model[0].weight, model[-1].weight
    seen = []

    def check(module, args):
        seen.append((grads[first]() is None, grads[last]() is None))

    data = batches(3)
    for tokens in data:
        model(tokens).square().mean().backward()
        grads = {p: weakref.ref(p.grad) for p in (first, last)}
        opt.step()
        opt.zero_grad()  # the trainer lets go: only the pending step holds the grads
        gc.collect()
    handle = model[1].register_forward_pre_hook(check)  # after the embedding's chunks ran
    model(data[0])
    handle.remove()
    # the embedding's chunks ran and gave its grad back; the head's had not yet
    assert seen == [(True, False)]
    opt.wait_for_optimizer_step()
    gc.collect()
    assert grads[last]() is None


def test_an_extra_staging_slot_is_sized_for_its_chunk():
    """The backward's extra slots each hold one chunk. Sized for the largest chunk, 30 small
    chunks (3.3 GiB) loaded in the backward took the H200's peak to 17.80 GiB."""
    model, opt = _loading_in_the_backward(2**40)
    run(model, opt, batches(1))
    layouts = [c for c in opt.plan.chunks if not c.resident]
    staged = [c for c in opt._executor.chunks if c.slot >= 0]
    extra = [layout for layout, c in zip(layouts, staged, strict=True) if c.slot >= 2]
    assert len(extra) == len(opt._executor.extra_slots) > 0
    sizes = {tuple(sorted(layout.staging_numel.values())) for layout in extra}
    assert len(sizes) > 1  # chunks of several sizes (the ramp, the layers' shapes)
    for layout, slot in zip(extra, opt._executor.extra_slots, strict=True):
        assert layout.staging_numel == {d: b.numel() for d, b in slot.buffers.items()}


def test_the_step_is_all_enqueued_and_its_slots_given_back_before_the_forwards_last_module():
    """The forward enqueues the step's chunks `staging_slots` ahead of the one it needs: near
    the end that is past the last chunk, so the extra slots' write-backs follow and the ring
    goes back to the allocator there, not once the whole forward has run (its last modules'
    activations would sit on top of the ring)."""
    model, opt = _loading_in_the_backward(8 * 512)
    data = batches(3)
    run(model, opt, data[:2])
    assert opt._executor.extra_slots and opt._executor.ring is not None
    seen = []

    def check(module, args):
        buffers = [
            b for s in (opt._executor.ring, *opt._executor.extra_slots) for b in s.buffers.values()
        ]
        seen.append(all(b.untyped_storage().nbytes() == 0 for b in buffers))

    handle = model[-1].register_forward_pre_hook(check)  # after the overlap's own hook
    model(data[2])
    handle.remove()
    assert seen == [True]
    opt.wait_for_optimizer_step()


class _EncoderDecoder(torch.nn.Module):
    """A model the trainer drives through methods (`decode(encode(x))`), not its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = make_model()
        self.decoder = torch.nn.Linear(5, 3)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)

    def decode(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(tokens))


def test_a_model_driven_through_its_methods_warns_once_that_no_backward_load_ran():
    """The backward loads start where the model's own forward ends; a trainer calling its
    methods never ends one: nothing loaded in the backward, silently, and each step's
    watch of the owners' inputs counted on from the last."""
    torch.manual_seed(0)
    plain_model = _EncoderDecoder()
    model = _EncoderDecoder()
    model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=2048,
        overlap_forward=model,
        load_in_backward=True,
    )
    for m, o in ((plain_model, plain), (model, opt)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for tokens in batches(5):
                o.zero_grad()
                m.decode(m.encode(tokens)).square().mean().backward()
                o.step()
        said = [w for w in caught if "its own forward" in str(w.message)]
        assert len(said) == (1 if o is opt else 0)
        if o is opt:
            assert said[0].filename == __file__  # the user's step() call
    assert opt._overlap._watch.hooked <= len(opt._overlap.owners)
    opt.wait_for_optimizer_step()
    assert_params_and_state_equal(plain_model, plain, model, opt)


def test_a_compiled_transformers_llama_with_a_pending_step_runs_and_is_bitwise():
    """Dynamo traced the waiting mode's `__torch_function__` into a transformers Llama's
    resumed frame and handed `inputs_embeds.device` back as a `torch.Size`: the first
    forward with a step pending raised in `torch.arange`. Metadata reads now return
    before the mode's look-up; exact against the eager run (Dynamo's eager backend: the
    same kernels)."""
    transformers = pytest.importorskip("transformers")

    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, attn_implementation="eager",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    tokens = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for overlap in (False, True):
        model = llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = model
        if overlap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=4096, overlap_forward=model)
            forward = torch.compile(model, backend="eager")
        losses = []
        for _ in range(3):
            loss = forward(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if overlap:
            opt.wait_for_optimizer_step()
        runs.append((losses, list(model.parameters())))
    (plain_losses, plain_params), (losses, params) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))


def test_a_wait_interrupted_midway_is_made_again_by_the_next_forward(monkeypatch):
    """Ctrl-C inside a module's wait for its chunk (the step stays pending: no after-hook
    runs for a KeyboardInterrupt): the forward run again waits for that chunk, rather than
    taking the interrupted wait as made (a plain model's later modules skip a wait their
    stream made already)."""
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=600, overlap_forward=model
    )
    tokens = batches(1)[0]
    model(tokens).square().mean().backward()
    opt.step()
    overlap = opt._overlap
    first = overlap._module_chunk[0]  # the embedding's chunk, waited for first
    streams_type = type(opt._streams)
    real_wait, real_wait_for_chunk = streams_type.wait, type(overlap)._wait_for_chunk
    waited, waiting = [], []

    def wait_for_chunk(self, chunk, *args, **kwargs):
        waiting.append(chunk)
        try:
            real_wait_for_chunk(self, chunk, *args, **kwargs)
        finally:
            waiting.pop()

    def interrupted(self, stream, event):
        if waiting and waiting[-1] == first:
            raise KeyboardInterrupt
        real_wait(self, stream, event)

    def recorded(self, stream, event):
        waited.extend(waiting[-1:])
        real_wait(self, stream, event)

    monkeypatch.setattr(type(overlap), "_wait_for_chunk", wait_for_chunk)
    monkeypatch.setattr(streams_type, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(tokens)
    monkeypatch.setattr(streams_type, "wait", recorded)
    model(tokens)
    assert first in waited
    opt.close()
