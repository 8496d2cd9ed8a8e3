"""CPUOffloadOptimizer refuses what it cannot do right, at the earliest point, naming
the param, key or argument and the fix; where the plain optimizer works, so does it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from offload import CPUOffloadOptimizer, subset_step_for


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def _backward(model: torch.nn.Module) -> None:
    model(torch.ones(2, 8)).square().sum().backward()


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after_a_step"])
def test_load_state_dict_with_a_missing_state_key_raises(stepped):
    source = _linear()
    plain = torch.optim.AdamW(source.parameters(), lr=1e-2)
    _backward(source)
    plain.step()
    saved = plain.state_dict()
    del saved["state"][1]["exp_avg_sq"]
    fresh_model = _linear()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    _backward(fresh_model)
    with pytest.raises(KeyError, match="exp_avg_sq"):  # plain AdamW, at its next step
        fresh.step()

    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if stepped:
        _backward(model)
        opt.step()
    saved["param_groups"][0]["lr"] = 0.5
    with pytest.raises(KeyError, match=r"param 1 .*'exp_avg_sq'"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 1e-2  # a refused load changes nothing


_STATE_OPTIONS = {
    "adam_amsgrad": lambda params, on: torch.optim.Adam(params, lr=1e-2, amsgrad=on),
    "rmsprop_centered": lambda params, on: torch.optim.RMSprop(params, lr=1e-2, centered=on),
    "sgd_momentum": lambda params, on: torch.optim.SGD(params, lr=1e-2, momentum=0.9 * on),
}


@pytest.mark.parametrize("make", _STATE_OPTIONS.values(), ids=_STATE_OPTIONS.keys())
@pytest.mark.parametrize("saved_with", [False, True], ids=["saved_without", "saved_with"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "after_a_step"])
def test_a_state_dict_saved_with_other_state_options_loads_as_torch_loads_it(
    make, saved_with, stepped
):
    # The saved groups' options choose the state (amsgrad, centered, momentum): the wrapper
    # checked the state against its own options and refused a checkpoint torch loads.
    source = _linear()
    saving = make(source.parameters(), saved_with)
    _backward(source)
    saving.step()
    saved = saving.state_dict()
    runs = []
    for wrap in (False, True):
        model = _linear(1)
        opt = make(model.parameters(), not saved_with)
        opt = CPUOffloadOptimizer(opt, chunk_bytes=64) if wrap else opt
        if stepped:
            _backward(model)
            opt.step()
        opt.load_state_dict(copy.deepcopy(saved))  # torch's steps update what it loaded
        for _ in range(2):
            opt.zero_grad()
            _backward(model)
            opt.step()
        runs.append((list(model.parameters()), opt.state_dict()))
    (plain_params, plain_state), (params, state) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))
    assert plain_state["param_groups"] == state["param_groups"]
    for index, entries in plain_state["state"].items():
        assert entries.keys() == state["state"][index].keys()
        for key, value in entries.items():
            assert torch.equal(value, state["state"][index][key]), (index, key)


def test_a_staging_ring_that_cannot_fit_fails_at_construction():
    model = torch.nn.Linear(64, 64)  # AdamW: 32 KiB of state for the weight
    with pytest.raises(MemoryError, match=r"staging ring \(1000000000 slots of at least 32768"):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), staging_slots=10**9)


def test_the_staging_ring_check_takes_a_param_the_step_slices_as_a_chunk(monkeypatch):
    """AdamW cuts a param into chunk_bytes slices, so its ring is slots x chunk_bytes;
    the check took slots x the param's whole state, and refused a ring that fit 32 times.
    Muon steps a matrix whole: its whole state is the floor."""
    import types

    from muon import Muon
    from offload import host_memory

    model = torch.nn.Embedding(4096, 256)  # AdamW 8 MiB of state, Muon 4 MiB
    free = types.SimpleNamespace(available=4 * 2**20, total=2**40)
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: free)
    CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=2**18, staging_slots=4
    ).close()
    with pytest.raises(MemoryError, match=r"staging ring \(4 slots of at least 4194304 bytes"):
        CPUOffloadOptimizer(Muon(model.parameters()), chunk_bytes=2**18, staging_slots=4)


def test_an_optimizer_without_params_is_refused():
    with pytest.raises(ValueError, match="AdamW has no params to optimize"):
        CPUOffloadOptimizer(torch.optim.AdamW([{"params": []}]))


def test_what_is_not_an_optimizer_or_not_materialized_is_refused_naming_the_fix():
    model = _linear()
    with pytest.raises(TypeError, match=r"wraps an optimizer, e.g. .* but got: list"):
        CPUOffloadOptimizer(list(model.parameters()))
    meta = torch.nn.Linear(4, 4, device="meta")  # deferred init: to_empty comes later
    with pytest.raises(ValueError, match=r"meta device .* after model.to_empty"):
        CPUOffloadOptimizer(torch.optim.AdamW(meta.parameters()))


def test_params_moved_to_another_device_after_wrapping_are_refused_at_the_step():
    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    _backward(model)
    opt.step()
    # as model.to(device) moves params in place (the only other device here is meta)
    torch.utils.swap_tensors(model.bias, torch.nn.Parameter(torch.empty(4, device="meta")))
    with pytest.raises(RuntimeError, match=r"param 1 is on meta but was on cpu .* move the model"):
        opt.step()


def test_a_group_added_to_the_wrapped_optimizer_fails_at_the_next_step_naming_the_fix():
    model, extra = _linear(), torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters())
    opt = CPUOffloadOptimizer(inner)
    inner.add_param_group({"params": extra.parameters()})
    _backward(model)
    with pytest.raises(RuntimeError, match=r"params changed after wrapping \(2 params then, 4 now"):
        opt.step()


def test_sgd_momentum_on_a_sparse_grad_is_refused_before_the_step():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    before = embedding.weight.detach().clone()
    opt = CPUOffloadOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9))
    embedding(torch.tensor([1, 3])).sum().backward()
    with pytest.raises(ValueError, match=r"param 0 has a sparse grad.*momentum=0.9"):
        opt.step()
    assert torch.equal(embedding.weight, before)


def test_lbfgs_gets_the_closure_and_matches_plain_bitwise():
    def run(wrap: bool) -> tuple[list[float], torch.Tensor]:
        model = _linear()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
        if wrap:
            opt = CPUOffloadOptimizer(opt)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.ones(2, 8)).square().sum()
            loss.backward()
            return loss

        losses = [opt.step(closure).item() for _ in range(3)]
        return losses, model.weight.detach()

    assert run(wrap=True)[0] == run(wrap=False)[0]
    assert torch.equal(run(wrap=True)[1], run(wrap=False)[1])


def test_serial_path_checks_host_memory_before_the_params_change(monkeypatch):
    import types

    from offload import HostMemoryError, host_memory

    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.Rprop(model.parameters()))  # no subset step: serial
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    monkeypatch.setattr(
        host_memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=100)
    )
    with pytest.raises(HostMemoryError, match="needs 288 bytes"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_staging_ring_larger_than_free_gpu_memory_fails_at_construction():
    model = torch.nn.Linear(1024, 1024, device="cuda")  # AdamW: 8 MiB of state for the weight
    with pytest.raises(torch.OutOfMemoryError, match=r"needs \d+ bytes .* on cuda:0, but only"):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), staging_slots=10**6)


@pytest.mark.parametrize("value", [True, "model"])
def test_overlap_forward_that_is_not_a_module_is_refused_naming_what_it_takes(value):
    """`offload_overlap_forward=True` is the config's flag; the constructor takes the model."""
    model = _linear()
    with pytest.raises(TypeError, match=r"overlap_forward should be the model .* but is: "):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=value)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copy_or_a_pickle_of_the_optimizer_is_refused_naming_state_dict(how):
    """A copy would share the host slabs and staging ring, or lose them: it could not step."""
    import copy
    import pickle

    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    _backward(model)
    opt.step()
    duplicate = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict\(\).*new"):
        duplicate(opt)


@pytest.mark.parametrize("where", ["one_group", "two_groups"])
def test_a_param_listed_twice_is_refused_naming_where(where):
    # plain AdamW steps a param listed twice twice a step; the wrapper stepped it once
    model = _linear()
    if where == "one_group":
        with pytest.warns(UserWarning, match="duplicate parameters"):  # torch only warns
            inner = torch.optim.AdamW([model.weight, model.bias, model.weight])
        second, first = r"group 0, position 2 \(shape \(4, 8\)\)", "group 0, position 0"
    else:  # torch's add_param_group refuses this; a hand-edited param_groups does not
        inner = torch.optim.AdamW([model.weight, model.bias])
        inner.param_groups.append({**inner.param_groups[0], "params": [model.bias]})
        second, first = r"group 1, position 0 \(shape \(4,\)\)", "group 0, position 1"
    with pytest.raises(ValueError, match=rf"param at {second} is listed twice.*{first}.*once"):
        CPUOffloadOptimizer(inner)


@pytest.mark.parametrize("which", ["another_model", "a_child_without_params"])
def test_overlap_forward_holding_none_of_the_params_is_refused_naming_what_to_pass(which):
    # accepted, it never overlapped a step: its forward reaches none of the chunks
    model = torch.nn.Sequential(_linear(), torch.nn.Tanh())
    other = {"another_model": _linear(1), "a_child_without_params": model[1]}[which]
    with pytest.raises(
        ValueError, match=r"overlap_forward \((Linear|Tanh)\) holds none of the 2 params.*reads"
    ):
        CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=other)


def test_a_step_patched_on_the_wrapped_optimizer_is_refused_where_chunks_step():
    # A patch clipping by the global grad norm ran once per chunk, on that chunk's params
    def clipping(opt):
        step = opt.step

        def clipped(closure=None):
            params = [p for group in opt.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, 0.01)
            return step(closure)

        opt.step = clipped
        return opt

    model = _linear()
    with pytest.raises(TypeError, match=r"SGD's step is set on the instance .*del opt\.step"):
        CPUOffloadOptimizer(clipping(torch.optim.SGD(model.parameters(), lr=0.1)), chunk_bytes=64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(inner, 1)  # a scheduler's patch is the wrapper's to honour
    opt = CPUOffloadOptimizer(inner, chunk_bytes=64)
    clipping(inner)  # patched after wrapping: refused at the step, before anything changes
    _backward(model)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="step is set on the instance"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # the serial path (no subset step) calls the optimizer's step once a step: patch kept
    calls = []
    lbfgs = torch.optim.LBFGS(model.parameters())
    step = lbfgs.step
    lbfgs.step = lambda closure: calls.append(1) or step(closure)
    opt = CPUOffloadOptimizer(lbfgs)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 8)).square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert calls == [1]


def test_param_groups_set_on_the_wrapper_are_the_wrapped_optimizers():
    # the setter raised AttributeError; torch's optimizers take a set
    model, plain_model = _linear(), _linear()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=1e-2), chunk_bytes=64
    )
    plain = torch.optim.AdamW([{"params": [p]} for p in plain_model.parameters()], lr=1e-2)
    for m, o in ((model, opt), (plain_model, plain)):
        _backward(m)
        o.step()
        # regrouped, two groups into one: each param's group is looked up anew
        o.param_groups = [{**o.param_groups[0], "params": list(m.parameters()), "lr": 0.5}]
        _backward(m)
        o.step()
    pairs = zip(plain_model.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    opt.load_state_dict(opt.state_dict())  # checked against each param's group's layout
    opt.param_groups = [{**opt.param_groups[0], "params": [torch.nn.Parameter(torch.ones(3))]}]
    with pytest.raises(RuntimeError, match="params changed after wrapping"):
        opt.step()


def test_the_adapters_layout_follows_params_traded_between_groups_of_equal_length():
    # its param -> group cache was keyed on the groups' lengths only: traded by hand
    # between two one-param groups, each param kept its old group's state layout
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([{"params": [a], "amsgrad": True}, {"params": [b]}])
    adapter = subset_step_for(opt)
    assert "max_exp_avg_sq" in adapter.state_layout(a)
    first, second = opt.param_groups
    first["params"], second["params"] = second["params"], first["params"]
    assert "max_exp_avg_sq" not in adapter.state_layout(a)
    assert "max_exp_avg_sq" in adapter.state_layout(b)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resident_budget_smaller_than_the_first_unit_warns_that_it_keeps_nothing(overlap):
    # residency takes whole units from the front (overlap) or back: 30 KB of an embedding's
    # 50 KB of AdamW state kept nothing on the GPU, silently
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 64))
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()),
        gpu_resident_bytes=30_000,
        overlap_forward=model if overlap else None,
    )
    model(torch.zeros(2, dtype=torch.long)).sum().backward()
    if overlap:  # the embedding's exp_avg and exp_avg_sq, fp32
        with pytest.warns(UserWarning, match=rf"keeps no state on the GPU.* {2 * 4 * 6400} bytes"):
            opt.step()
    else:  # the last unit (the Linear's bias) fits
        opt.step()
        assert opt.plan.resident_bytes > 0
    opt.close()


def test_the_layout_cache_keys_on_the_options_that_may_choose_state():
    # keyed by the repr of every option, it repr'd a group's param_names (one per param)
    # for every param: loading 12000 params took 11 s; a tensor lr on a GPU would sync
    from offload.subset_step import _state_options

    lr = torch.tensor(0.1)
    group = {
        "params": [torch.ones(1)] * 3,
        "param_names": ["a", "b", "c"],
        "lr": lr,
        "betas": (0.9, 0.99),
        "amsgrad": True,
        "extra": [1, 2],
    }
    options = (("betas", (0.9, 0.99)), ("amsgrad", True), ("extra", "[1, 2]"))
    assert _state_options(group) == (("lr", (id(lr), lr._version)), *options)
    lr.fill_(0.2)  # a scheduler's in-place update: another key, without reading the value
    assert _state_options(group)[0] == ("lr", (id(lr), lr._version))


def test_groups_whose_tensor_options_choose_other_state_get_their_own_layouts():
    # keyed without tensor options, SGD's groups with momentum tensor(0.9) and tensor(0.0)
    # shared whichever layout came first: a momentum buffer never homed, or homes for none
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    groups = [
        {"params": first.parameters(), "momentum": torch.tensor(0.0)},
        {"params": second.parameters(), "momentum": torch.tensor(0.9)},
    ]
    opt = CPUOffloadOptimizer(torch.optim.SGD(groups, lr=0.1), chunk_bytes=64)
    for model in (first, second):
        _backward(model)
    opt.step()
    homed = {key for _, key in opt._executor.homes}
    assert homed == {"momentum_buffer"} and len(opt._executor.homes) == 2  # the second group's


def test_a_load_state_dict_interrupted_while_copying_says_so_at_the_next_step(monkeypatch):
    # the next step said a state tensor "was deleted" and advised `del opt.state[param]`,
    # which would throw state away: the load had stopped half way
    from offload import cpu_offload

    model = _linear()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _backward(model)
    opt.step()
    saved = opt.state_dict()
    target = saved["state"][1]["exp_avg"]
    seen = []
    real = cpu_offload.local_tensor

    def interrupting(t):
        if t is target:
            seen.append(t)
            if len(seen) == 2:  # its shape checked, then its copy home
                raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(cpu_offload, "local_tensor", interrupting)
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(saved)
    monkeypatch.setattr(cpu_offload, "local_tensor", real)
    _backward(model)
    with pytest.raises(RuntimeError, match="load_state_dict was interrupted"):
        opt.step()
    opt.load_state_dict(saved)  # loaded whole: steps again
    opt.step()


def test_an_optimizer_built_before_fully_shard_is_refused_at_its_first_step():
    # fully_shard makes new params: the optimizer stepped the old ones, which got no grad,
    # and nothing trained, silently
    from spawn_ranks import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 8)).sum().backward()
        with pytest.raises(
            ValueError, match=r"replaced since the optimizer was built.*after fully"
        ):
            opt.step()
        opt.close()


def test_params_fully_shard_replaced_in_part_of_the_model_are_warned_of_at_the_first_step():
    # fully_shard on one layer after the optimizer was built: the optimizer steps that
    # layer's old params, which get no grad, and the layer trains nothing, silently
    from spawn_ranks import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
        model(torch.randn(2, 8)).sum().backward()
        with pytest.warns(UserWarning, match=r"params \[0, 1\] of the 4 .*after the optim"):
            opt.step()
        opt.close()


def test_a_param_outside_the_overlap_model_without_a_grad_yet_is_not_warned_of():
    # an auxiliary head trained from a later step on: unused by design, not replaced
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    aux = torch.nn.Linear(8, 3)
    params = [*model.parameters(), *aux.parameters()]
    opt = CPUOffloadOptimizer(torch.optim.AdamW(params), overlap_forward=model)
    model(torch.randn(2, 8)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    opt.close()


def test_a_unit_left_all_gathered_at_step_is_refused_naming_it():
    # an evaluation between backward() and step() leaves FSDP2's root all-gathered: the
    # next forward read its weights from before the step (plain FSDP2 does too), and the
    # overlap blamed an unshard() the trainer never made, or from the first step said nothing
    from spawn_ranks import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
        model(torch.randn(2, 8)).sum().backward()
        with torch.no_grad():
            model(torch.randn(2, 8))  # an evaluation
        with pytest.raises(RuntimeError, match=r"'\(the root\)' .* is all-gathered at step\(\)"):
            opt.step()
        model.reshard()  # the way out
        opt.step()
        opt.close()

        # every unit left gathered by set_reshard_after_backward(False): the model then
        # holds only the unsharded params, and the first step blamed an optimizer built
        # before fully_shard
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
        model.set_reshard_after_backward(False, recurse=True)
        model(torch.randn(2, 8)).sum().backward()
        with pytest.raises(RuntimeError, match=r"is all-gathered at step\(\).*reshard"):
            opt.step()
        model.reshard()
        model[1].reshard()
        opt.step()
        opt.close()

        # a frozen unit kept gathered on purpose (a frozen encoder) steps nothing: not refused
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        model[0].requires_grad_(False)
        fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
        model[0].set_reshard_after_backward(False)
        fully_shard(model, mesh=mesh)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = CPUOffloadOptimizer(torch.optim.AdamW(trained), overlap_forward=model)
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.close()


def test_a_setting_of_the_wrapped_optimizer_set_on_the_wrapper_is_refused_naming_it():
    # `opt.ns_dtype = ...` on the wrapper setup_optimizer returns set an attribute of the
    # wrapper, and Muon went on with its own, silently
    from muon import Muon

    model = torch.nn.Linear(8, 8, bias=False)
    opt = CPUOffloadOptimizer(Muon(model.parameters()))
    for name, value in (("ns_dtype", torch.float32), ("max_inflight", 1)):
        with pytest.raises(
            AttributeError,
            match=rf"{name} is a setting of the wrapped Muon.*"
            rf"opt\.optimizer\.{name}",
        ):
            setattr(opt, name, value)
    opt.optimizer.max_inflight = 1  # the way
    opt.chunk_bytes = 2**20  # the wrapper's own, and new attributes of the user's, are set
    opt.run_name = "a"
    assert (opt.chunk_bytes, opt.run_name, opt.optimizer.max_inflight) == (2**20, "a", 1)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_stepping_the_wrapped_optimizer_directly_is_refused_once_it_has_state(overlap):
    """Its own step() (a GradScaler or trainer handed the wrapped optimizer) stepped the
    state in the wrapper's homes beside the wrapper, silently on the CPU; refused, naming
    the wrapper, before anything changes. Before any state exists it steps as torch's:
    DCP's state dict functions step the wrapped optimizer at lr 0 to create it (found by a
    review), and training on matches plain AdamW."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, plain_model = _linear(), _linear()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.1)
    calls = []
    inner.register_step_pre_hook(lambda *_: calls.append("pre"))  # the user's: once a step
    opt = CPUOffloadOptimizer(inner, chunk_bytes=64, overlap_forward=model if overlap else None)
    get_optimizer_state_dict(model, inner)  # steps `inner` at lr 0: no state yet
    get_optimizer_state_dict(plain_model, plain)
    calls.clear()
    for m, o in ((model, opt), (plain_model, plain)):
        _backward(m)
        o.step()
    assert calls == ["pre"]
    _backward(model)
    opt.wait_for_optimizer_step()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"AdamW is wrapped by a CPUOffloadOptimizer.*new AdamW"):
        inner.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # the way out the message names: the state in a new optimizer, stepped as plain's
    unwrapped = torch.optim.AdamW(model.parameters(), lr=0.1)
    unwrapped.load_state_dict(opt.state_dict())
    unwrapped.step()
    _backward(plain_model)
    plain.step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


class _OwnMomentum(torch.optim.Optimizer):
    """An optimizer of its own (None is not read as absent): a momentum buffer per param."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state.get("buf") is None:
                    state["buf"] = p.grad.clone()
                else:
                    state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


def test_a_none_state_entry_of_an_optimizer_of_its_own_is_refused_naming_the_fix():
    model = _linear()
    opt = CPUOffloadOptimizer(_OwnMomentum(model.parameters()))
    _backward(model)
    opt.step()
    opt.optimizer.state[model.weight]["buf"] = None
    _backward(model)
    with pytest.raises(ValueError, match=r"state 'buf' of param 0 is None .*del opt.state"):
        opt.step()


@pytest.mark.parametrize("option", ["overlap_forward", "gpu_resident_bytes"])
def test_a_subclass_of_a_torch_optimizer_is_refused_where_a_subset_step_is_needed(option):
    # The chunked step adapts torch's classes themselves (a subclass's step() may do more,
    # and the chunks never call it): the refusal said only "MyAdamW has none" (review)
    class MyAdamW(torch.optim.AdamW):
        pass

    model = torch.nn.Linear(4, 4)
    given = {"overlap_forward": model, "gpu_resident_bytes": 1024}[option]
    with pytest.raises(ValueError, match=r"MyAdamW has none: it subclasses torch's AdamW"):
        CPUOffloadOptimizer(MyAdamW(model.parameters()), **{option: given})
    # the protocol as it is: begin_subset_step and state_layout on the optimizer (review)
    protocol = r"Rprop has none \(give it begin_subset_step\(\) .* and state_layout\(\)"
    with pytest.raises(ValueError, match=protocol):
        CPUOffloadOptimizer(torch.optim.Rprop(model.parameters()), **{option: given})
