"""The Muon step on one process: what it keeps between steps, what it allocates, and that a
matrix's update does not depend on how the step is cut (bucket cap, max_inflight, offload)."""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import torch

from muon import Muon, optimizer
from offload import CPUOffloadOptimizer

# Odd shapes: a 2-row matrix, one row, tall and wide, a fused param, expert stacks.
SHAPES = [(37, 53), (2, 9), (70, 33), (1, 9), (16, 12), (3, 7, 10), (64, 64), (2, 5, 6)]
FUSED = {4: (8, 4, 4)}  # param index -> row_blocks


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES + [(6,)]]


def _groups(params) -> list[dict]:
    muon = [p for i, p in enumerate(params[:-1]) if i not in FUSED]
    return (
        [{"params": muon}]
        + [{"params": [params[i]], "row_blocks": blocks} for i, blocks in FUSED.items()]
        + [{"params": params[-1:], "algorithm": "adamw"}]
    )


def _train(opt, params, steps: int = 3) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _total_bf16_bytes() -> int:
    return sum(torch.Size(s).numel() * 2 for s in SHAPES)


def _held_tensors(opt) -> list[torch.Tensor]:
    """Tensors reachable from the optimizer's attributes other than its params and state."""
    params = {id(p) for group in opt.param_groups for p in group["params"]}
    found, seen = [], set(params)
    todo = [v for k, v in vars(opt).items() if k not in ("state", "param_groups")]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and not callable(obj):
            todo += list(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            todo += [getattr(obj, name, None) for name in obj.__slots__]
    return found


@pytest.fixture
def transients(monkeypatch) -> list[tuple[int, weakref.ref]]:
    """Every buffer the Muon step allocates: (numel, weak reference)."""
    made: list[tuple[int, weakref.ref]] = []
    allocate = optimizer._transient

    def record(numel, dtype, device):
        buffer = allocate(numel, dtype, device)
        made.append((numel, weakref.ref(buffer)))
        return buffer

    monkeypatch.setattr(optimizer, "_transient", record)
    return made


def test_nothing_but_state_is_kept_between_steps_and_buffers_are_the_plan(transients):
    params = _params()
    opt = Muon(_groups(params), lr=0.02, bucket_cap_bytes=_total_bf16_bytes() // 4)
    _train(opt, params, steps=2)
    gc.collect()
    assert transients and all(ref() is None for _, ref in transients)
    assert _held_tensors(opt) == []
    # local buckets (one process): the Newton-Schulz input only, at the plan's size
    plan = opt._muon_plan()
    assert all(b.axis is None for b in plan.buckets) and len(plan.buckets) > 2
    full = [plan.exchange(b.index, frozenset(b.params)).full_numel for b in plan.buckets]
    assert [numel for numel, _ in transients] == full * 2


def _caps() -> list[int]:
    """Bucket caps at the whole set, a quarter and a sixteenth (512 / 128 / 32 MiB, scaled)."""
    total = _total_bf16_bytes()
    return [total, total // 4, total // 16]


def test_the_update_does_not_depend_on_bucket_cap_or_max_inflight():
    results = []
    for cap in _caps():
        for inflight in (1, 2, 3):
            params = _params()
            opt = Muon(_groups(params), lr=0.02, bucket_cap_bytes=cap, max_inflight=inflight)
            _train(opt, params)
            results.append((params, opt.state_dict()["state"], len(opt._muon_plan().buckets)))
    assert len({buckets for _, _, buckets in results}) == 3  # the caps cut differently
    params0, state0, _ = results[0]
    for params, state, _ in results[1:]:
        for p, q in zip(params0, params, strict=True):
            assert torch.equal(p, q)
        for index, entries in state0.items():
            for key, value in entries.items():
                assert torch.equal(state[index][key], value), (index, key)


@pytest.fixture
def launches(monkeypatch) -> list[tuple[int, int, int]]:
    """(matrices, rows, cols) of every `zeropower` call the Muon step makes."""
    calls: list[tuple[int, int, int]] = []
    zeropower = optimizer.zeropower

    def record(x, *args, **kwargs):
        calls.append((x.shape[0], x.shape[1], x.shape[2]))
        algorithms.append(kwargs["algorithm"])
        return zeropower(x, *args, **kwargs)

    algorithms = LAUNCH_ALGORITHMS
    algorithms.clear()

    monkeypatch.setattr(optimizer, "zeropower", record)
    return calls


LAYER = [(24, 16), (16, 16), (40, 16), (16, 40)]
LAUNCH_ALGORITHMS: list[str] = []  # the `algorithm` each `zeropower` call got


def test_ns_algorithm_is_a_validated_group_default_passed_to_zeropower(launches):
    params = _layers(2)
    groups = [{"params": params[:4]}, {"params": params[4:], "ns_algorithm": "standard"}]
    opt = Muon(groups, ns_algorithm="gram")
    _train(opt, params, steps=1)
    assert [g["ns_algorithm"] for g in opt.param_groups] == ["gram", "standard"]
    assert sorted(set(LAUNCH_ALGORITHMS)) == ["gram", "standard"]
    with pytest.raises(ValueError, match="ns_algorithm should be one of"):
        Muon(params, ns_algorithm="svd")


def _layers(count: int = 8) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in LAYER * count]


def test_offloaded_muon_is_bitwise_equal_and_keeps_its_launches(launches):
    layer_bf16 = sum(r * c for r, c in LAYER) * 2
    cap = 2 * layer_bf16  # two layers per bucket
    runs = {}
    # chunk sizes in fp32 state bytes: 4 layers per middle chunk (ramped ends), and all
    for name, chunk_bytes in (("plain", None), ("4 layers", 8 * layer_bf16), ("all", 2**40)):
        params = _layers()
        opt = Muon(params, lr=0.02, bucket_cap_bytes=cap)
        if chunk_bytes is not None:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=chunk_bytes)
        launches.clear()
        _train(opt, params, steps=2)
        runs[name] = (params, opt.state_dict()["state"], list(launches))
    plain, plain_state, plain_launches = runs["plain"]
    for name, (params, state, _) in runs.items():
        for p, q in zip(plain, params, strict=True):
            assert torch.equal(p, q), name
        for index, entries in plain_state.items():
            assert torch.equal(state[index]["momentum_buffer"], entries["momentum_buffer"]), name
    # one chunk: the same launches; 4-layer chunks: each shape's largest launch
    # at least as large as without offload (units come by shape), none over the cap
    assert Counter(runs["all"][2]) == Counter(plain_launches)
    largest = {name: Counter() for name in runs}
    for name, (_, _, launched) in runs.items():
        for count, rows, cols in launched:
            largest[name][rows, cols] = max(largest[name][rows, cols], count)
    assert largest["plain"] == {(r, c): 2 for r, c in LAYER}
    for shape, count in largest["plain"].items():
        assert largest["4 layers"][shape] >= count and largest["all"][shape] >= count
    for count, rows, cols in runs["4 layers"][2] + runs["all"][2]:
        assert count * rows * cols * 2 <= cap


def test_a_refused_step_params_call_steps_and_marks_nothing():
    """A call with a param outside the units is refused before anything steps: the units it
    named step later as usual (once, bit for bit as a whole step)."""
    params, reference = _params(), _params()
    opt = Muon(_groups(params), lr=0.02)
    ref = Muon(_groups(reference), lr=0.02)
    for p, q in zip(params, reference, strict=True):
        p.grad = torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel()))
        q.grad = p.grad.clone()
    step = opt.begin_subset_step()
    stranger = torch.nn.Parameter(torch.zeros(3, 3))
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="not in this optimizer's units"):
        step.step_params([*step.units[0], stranger])
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    for unit in step.units:  # unit 0 too: the refused call did not mark it stepped
        step.step_params(unit)
    with pytest.raises(ValueError, match="already stepped"):
        step.step_params(step.units[0])
    ref.step()
    assert all(torch.equal(p, q) for p, q in zip(params, reference, strict=True))


def test_a_unit_lets_go_of_its_grads_once_it_has_stepped():
    params = _params()
    opt = Muon(_groups(params), lr=0.02, adjust_lr_fn="match_rms_adamw")
    for p in params:
        p.grad = torch.randn_like(p)
    step = opt.begin_subset_step()
    grads = [weakref.ref(p.grad) for p in params]
    for p in params:
        p.grad = None  # the trainer's zero_grad: only the step holds them now
    first, *rest = step.units
    step.step_params(first)
    gc.collect()
    stepped = {id(p) for p in first}
    for p, grad in zip(params, grads, strict=True):
        assert (grad() is None) == (id(p) in stepped)
    with pytest.raises(ValueError, match="already stepped"):
        step.step_params(first)
    step.step_params([p for unit in rest for p in unit])
    gc.collect()
    assert all(grad() is None for grad in grads)
