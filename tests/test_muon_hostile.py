"""What a hostile user hands `muon.Muon`, `muon_param_groups` and the config: exact, or
refused by name before anything steps."""

from __future__ import annotations

import ast
import copy
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import one_rank_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from muon import Muon, muon_param_groups
from muon_offload import OptimizerConfig, model_row_blocks, setup_optimizer


@contextmanager
def _fake_world(size: int) -> Iterator[None]:
    """A process group of `size` ranks in this process: shapes and placements only, no
    collective computes anything."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _snapshot(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params]


def _assert_nothing_stepped(opt: Muon, params: list[nn.Parameter], before: list[torch.Tensor]):
    assert not opt.state
    for p, old in zip(params, before, strict=True):
        assert torch.equal(p.to_local() if isinstance(p, DTensor) else p, old)


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_a_grad_placed_unlike_its_param_is_refused_before_anything_steps(algorithm):
    # A Partial grad (tensor parallelism leaves them on replicated params) was stepped
    # unreduced, each rank its own; a Shard(1) grad on a Shard(0) param failed to broadcast
    with _fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        plain = nn.Parameter(_randn(4, 4))
        replicated = nn.Parameter(DTensor.from_local(_randn(8, 6), mesh, [Replicate()]))
        sharded = nn.Parameter(DTensor.from_local(_randn(2, 4), mesh, [Shard(0)]))
        params = [plain, replicated, sharded]
        opt = Muon([{"params": [plain]}, {"params": params[1:], "algorithm": algorithm}])
        plain.grad = _randn(4, 4, seed=1)
        replicated.grad = DTensor.from_local(_randn(8, 6, seed=2), mesh, [Partial()])
        sharded.grad = DTensor.from_local(_randn(4, 2, seed=3), mesh, [Shard(1)])
        before = _snapshot(params)
        with pytest.raises(
            ValueError,
            match=r"param group 1: param 0 \(shape \(8, 6\)\) has a grad with placements "
            r"\(Partial\(sum\),\) but the param has \(Replicate\(\),\); reduce or "
            r"redistribute the grad to the param's placements first",
        ):
            opt.step()
        _assert_nothing_stepped(opt, params, before)
        replicated.grad = DTensor.from_local(_randn(8, 6, seed=2), mesh, [Replicate()])
        with pytest.raises(
            ValueError,
            match=r"param group 1: param 1 \(shape \(4, 4\)\) has a grad with placements "
            r"\(Shard\(dim=1\),\) but the param has \(Shard\(dim=0\),\)",
        ):
            opt.step()
        _assert_nothing_stepped(opt, params, before)


def test_a_plain_grad_on_a_sharded_param_is_told_how_to_place_it():
    # it said "a grad with placements a plain tensor" and advised p.grad.redistribute,
    # which a plain tensor lacks (hostile review)
    with _fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        sharded = nn.Parameter(DTensor.from_local(_randn(2, 4), mesh, [Shard(0)]))
        opt = Muon([sharded])
        sharded.grad = _randn(4, 4, seed=1)  # the whole grad, where this rank's shard is read
        with pytest.raises(
            ValueError,
            match=r"has a plain-tensor grad but the param has \(Shard\(dim=0\),\); give it a "
            r"DTensor grad .*DTensor\.from_local\(shard, p\.device_mesh, p\.placements\)",
        ):
            opt.step()


def test_sparse_grads_are_refused_before_anything_steps():
    # An nn.Embedding(sparse=True), which muon_param_groups sends to AdamW, failed deep in
    # torch's dispatcher after the Muon params had stepped and the embedding had decayed
    model = nn.ModuleDict({"emb": nn.Embedding(10, 8, sparse=True), "proj": nn.Linear(8, 8)})
    opt = Muon(muon_param_groups(model), lr=0.02)
    model["proj"](model["emb"](torch.tensor([1, 2, 3]))).square().sum().backward()
    params = list(model.parameters())
    before = _snapshot(params)
    with pytest.raises(
        RuntimeError,
        match=r"param group 1: param 0 \(shape \(10, 8\)\) has a torch.sparse_coo grad, but "
        "AdamW does not support sparse gradients",
    ):
        opt.step()
    _assert_nothing_stepped(opt, params, before)
    matrix = nn.Parameter(_randn(4, 4))
    muon = Muon([matrix])
    matrix.grad = _randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="Muon does not support sparse gradients"):
        muon.step()
    _assert_nothing_stepped(muon, [matrix], [_randn(4, 4)])


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_a_grad_of_another_shape_set_through_data_is_refused_naming_the_param(algorithm):
    # torch's grad setter checks the shape, `.data` does not: the step failed 12 frames
    # deep ("The size of tensor a (3) must match ..."), naming no param (a hostile review)
    matrix, other = nn.Parameter(_randn(4, 3)), nn.Parameter(_randn(5, 5))
    opt = Muon([{"params": [other]}, {"params": [matrix], "algorithm": algorithm}], lr=0.02)
    other.grad, matrix.grad = _randn(5, 5), torch.zeros(4, 3)
    matrix.grad.data = _randn(3, 4)
    before = _snapshot([other, matrix])
    with pytest.raises(
        ValueError,
        match=r"param group 1: param 0 \(shape \(4, 3\)\) has a grad of shape \(3, 4\); a "
        "grad must have its param's shape",
    ):
        opt.step()
    _assert_nothing_stepped(opt, [other, matrix], before)


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="torch >= 2.13")
def test_an_adamw_grad_of_another_dtype_is_refused_before_anything_steps():
    # bf16 params taking fp32 grads (p.grad_dtype = None): the Muon group stepped, then
    # torch's AdamW raised "expected dtype c10::BFloat16 for `end`", naming no param
    matrix = nn.Parameter(_randn(8, 6).bfloat16())
    bias = nn.Parameter(_randn(6).bfloat16())
    for p in (matrix, bias):
        p.grad_dtype = None
    opt = Muon([{"params": [matrix]}, {"params": [bias], "algorithm": "adamw"}], lr=0.02)
    matrix.grad, bias.grad = _randn(8, 6), _randn(6)
    before = _snapshot([matrix, bias])
    with pytest.raises(
        ValueError,
        match=r"param group 1: param 0 \(shape \(6,\)\) has a torch.float32 grad for a "
        "torch.bfloat16 param",
    ):
        opt.step()
    _assert_nothing_stepped(opt, [matrix, bias], before)


def test_fsdp_over_tensor_parallel_is_refused_naming_the_param():
    # The error named no param: "Muon supports Shard and Replicate placements but got: _S(0, 2)"
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with _fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(8, 12, bias=False))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        with pytest.raises(
            ValueError,
            match=r"param group 0: param 0 \(shape \(12, 8\)\) has placements \(_StridedShard.*"
            r"strided sharding \(FSDP2 over tensor parallelism, .*\) is supported only on a "
            r"3-D expert stack sharded on its expert dim alone",
        ):
            Muon(model.parameters())


def test_a_matrix_sharded_by_two_mesh_axes_is_refused_at_construction_naming_the_param():
    # refused only at the first step, naming neither the param nor its group
    with _fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2))
        plain = nn.Parameter(DTensor.from_local(_randn(4, 4), mesh, [Shard(0), Replicate()]))
        both = nn.Parameter(DTensor.from_local(_randn(4, 4), mesh, [Shard(0), Shard(1)]))
        with pytest.raises(
            ValueError,
            match=r"param group 0: param 1 \(shape \(8, 8\)\): matrix dims of shape \(8, 8\) "
            r"sharded by more than one mesh axis",
        ):
            Muon([plain, both])


def _adamw_names(model: nn.Module) -> list[str]:
    *_, adamw = muon_param_groups(model)
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in adamw["params"]]


def test_log_decay_rates_of_state_space_models_go_to_adamw():
    # Mamba's A_log (channels x states) is no linear map, but went to Muon as a 2-D param
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Linear(8, 16, bias=False)
            self.A_log = nn.Parameter(torch.zeros(16, 4))
            self.D = nn.Parameter(torch.ones(16))

    assert _adamw_names(nn.ModuleDict({"mixer": Mixer()})) == ["mixer.A_log", "mixer.D"]
    transformers = pytest.importorskip("transformers")
    config = {"vocab_size": 32, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1}
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(**config))
    assert "backbone.layers.0.mixer.A_log" in _adamw_names(mamba)


def test_params_whose_matrices_are_vectors_go_to_adamw():
    # A ViT's class token (1, 1, d) and RWKV's time-mix (1, 1, d) went to Muon as stacks of
    # 1 x d matrices, whose orthogonalization only normalizes them
    model = nn.Module()
    model.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
    model.time_mix_k = nn.Parameter(torch.zeros(1, 1, 8))
    model.column = nn.Parameter(torch.zeros(8, 1))
    model.proj = nn.Linear(8, 8, bias=False)
    assert _adamw_names(model) == ["cls_token", "time_mix_k", "column"]


class _Block(nn.Module):
    def __init__(self, row_blocks: object) -> None:
        super().__init__()
        self.gate_up = nn.Linear(8, 12, bias=False)
        self.row_blocks = row_blocks


def test_row_blocks_attribute_of_the_wrong_type_is_refused_naming_the_module():
    # A tuple or None gave "AttributeError: 'tuple' object has no attribute 'items'"
    for wrong in [(6, 6), {"gate_up.weight": 6}, {0: (6, 6)}]:
        with pytest.raises(
            TypeError,
            match=re.escape(f"module 'layer' (_Block) has row_blocks = {wrong!r}; it should be ")
            + r"a dict of param name -> row counts",
        ):
            model_row_blocks(nn.ModuleDict({"layer": _Block(wrong)}))
    # None declares nothing, as a module without the attribute
    assert model_row_blocks(nn.ModuleDict({"layer": _Block(None)})) == {}
    setup_optimizer(_Block(None), OptimizerConfig(type="muon"))


def test_config_refuses_ns_steps_its_schedule_does_not_have():
    # Refused only in setup_optimizer, as "param group 0: ns_steps should be None or 5 for
    # this schedule", naming neither muon_options nor ns_schedule
    with pytest.raises(
        ValueError,
        match=r"muon_options\['ns_steps'\] should be None or 5 for ns_schedule='keller_jordan' "
        r"\(a schedule sets its own iterations\) but is: 3",
    ):
        OptimizerConfig(type="muon", muon_options={"ns_steps": 3})
    model = nn.Linear(8, 8, bias=False)
    setup_optimizer(model, OptimizerConfig(type="muon", muon_options={"ns_steps": 5}))


def test_a_value_of_the_wrong_type_is_refused_with_an_example_of_the_right_type(tmp_path):
    # "set it like None" for a field whose default is None
    path = tmp_path / "train.toml"
    path.write_text('[optimizer]\noffload = "optimizer"\noffload_gpu_budget_bytes = 4e9\n')
    with pytest.raises(
        ValueError,
        match=r"offload_gpu_budget_bytes should be of type int \| None but is: 4000000000.0 "
        r"\(float\); set it like 4000000000$",
    ):
        OptimizerConfig.from_toml(str(path))
    with pytest.raises(
        ValueError, match=r"fused should be .* but is: 'yes' \(str\); set it like True"
    ):
        OptimizerConfig(fused="yes")
    with pytest.raises(ValueError, match=r"muon_options\['ns_steps'\] .*; set it like 1$"):
        OptimizerConfig(type="muon", muon_options={"ns_steps": "five"})


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(8, 24, bias=False)
        self.attn = nn.MultiheadAttention(8, 2, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(2, 12, 8))
        self.mlp = nn.Linear(8, 8, bias=False)


def test_fused_params_without_row_blocks_are_warned_about_once_per_call():
    # Phi3's qkv_proj, transformers' expert stacks and nn.MultiheadAttention's in_proj
    # were orthogonalized as one matrix without a word
    model = _Fused()
    with pytest.warns(UserWarning) as record:
        muon_param_groups(model)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        "muon_param_groups: ['qkv_proj.weight', 'attn.in_proj_weight', "
        "'experts.gate_up_proj'] look fused"
    )
    assert "orthogonalizes each as one matrix" in message and "row_blocks=" in message
    with pytest.warns(UserWarning, match="look fused") as record:  # at the caller's line,
        setup_optimizer(model, OptimizerConfig(type="muon"))  # not inside setup_optimizer
    assert [w.filename for w in record if "look fused" in str(w.message)] == [__file__]
    declared = {r"qkv_proj\.weight$": (8, 8, 8), r"in_proj_weight$": (24,)}
    with pytest.warns(UserWarning, match=r"\['experts.gate_up_proj'\] look fused"):
        muon_param_groups(model, row_blocks=declared)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        muon_param_groups(model, row_blocks={**declared, "gate_up_proj$": (6, 6)})


def test_muon_param_groups_takes_the_row_blocks_modules_declare_and_a_pattern_over_them():
    # A module's row_blocks attribute (the README's Block) was read by setup_optimizer
    # only: muon_param_groups(model) orthogonalized the fused gate_up as one matrix,
    # silently
    model = nn.ModuleDict({"layer": _Block({"gate_up.weight": (6, 6)}), "down": _Block(None)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain, fused = muon_param_groups(model)
    assert plain == {"params": [model["down"].gate_up.weight]}
    assert fused == {"params": [model["layer"].gate_up.weight], "row_blocks": (6, 6)}
    # the caller's pattern comes first: the declared group is left empty, so out
    plain, fused = muon_param_groups(model, row_blocks={r"layer\.gate_up": (4, 8)})
    assert fused == {"params": [model["layer"].gate_up.weight], "row_blocks": (4, 8)}
    # a declared param that goes to AdamW is refused, as a caller's pattern is
    aside = nn.ModuleDict({"embed_mix": _Block({"gate_up.weight": (6, 6)}), "down": _Block(None)})
    with pytest.raises(ValueError, match=r"declare row_blocks \(6, 6\) for \['embed_mix"):
        muon_param_groups(aside)
    # and the step splits the declared blocks as setup_optimizer's does, bitwise
    grads = [torch.randn(12, 8, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]

    def stepped(build) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.ModuleDict({"layer": _Block({"gate_up.weight": (6, 6)}), "down": _Block(None)})
        opt = build(net)
        for p, g in zip(net.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        return [p.detach().clone() for p in net.parameters()]

    config = OptimizerConfig(type="muon", lr=0.02, adjust_lr_fn="original", weight_decay=0.1)
    by_hand = stepped(lambda net: Muon(muon_param_groups(net), lr=0.02))
    assert all(map(torch.equal, by_hand, stepped(lambda net: setup_optimizer(net, config))))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 5, num_layers=2, bidirectional=True, proj_size=3)
        self.cell = nn.GRUCell(6, 4)
        self.rnn = nn.RNN(6, 5)  # one gate: nothing fused
        self.mlp = nn.Linear(6, 6, bias=False)


def test_lstm_and_gru_gate_weights_without_row_blocks_are_warned_about():
    # nn.LSTM's / nn.GRU's weight_ih and weight_hh stack 4 / 3 gates in rows: Muon
    # orthogonalized each whole without a word, where qkv_proj and the like are warned about
    model = _Recurrent()
    with pytest.warns(UserWarning) as record:
        muon_param_groups(model)
    assert len(record) == 1
    message = str(record[0].message)
    gates = [
        f"lstm.weight_{kind}_l{layer}{reverse}"
        for layer in range(2)
        for reverse in ("", "_reverse")
        for kind in ("ih", "hh")
    ] + ["cell.weight_ih", "cell.weight_hh"]
    assert message.startswith(f"muon_param_groups: {gates} look fused")
    # the warning's own declaration splits each gate weight into its gates and silences it
    declared = ast.literal_eval(re.search(r"row_blocks=(\{'\^[^}]*\})", message).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = muon_param_groups(model, row_blocks=declared)
    blocks = {id(p): g.get("row_blocks") for g in groups for p in g["params"]}
    params = dict(model.named_parameters())
    for name in gates:
        assert blocks[id(params[name])] == ((5,) * 4 if name.startswith("lstm") else (4,) * 3)
    for name in ("lstm.weight_hr_l0", "rnn.weight_ih_l0", "rnn.weight_hh_l0", "mlp.weight"):
        assert blocks[id(params[name])] is None, name


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "offloaded"])
def test_adamw_step_counters_saved_as_numbers_resume_as_torchs_adamw_does(wrap):
    # torch < 1.12 wrote `step` as a number, which torch's AdamW turns into a tensor on
    # load; Muon's AdamW groups failed at the next step ("API has changed, `state_steps`")
    from offload import CPUOffloadOptimizer

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        opt = Muon(muon_param_groups(model), lr=1e-2)
        return model, CPUOffloadOptimizer(opt) if wrap else opt

    def step(model, opt, seed):
        model(_randn(3, 8, seed=seed)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())  # its entries are the live state's
    for entries in saved["state"].values():
        if "step" in entries:
            entries["step"] = int(entries["step"].item())
    resumed, resumed_opt = build()
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(saved)
    for seed in (1, 2):
        step(model, opt, seed)
        step(resumed, resumed_opt, seed)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_schedule_given_as_lists_steps_as_one_given_as_tuples():
    """A schedule is cached by value: built from lists, its first step raised halfway
    (unhashable), after the momentum buffer had moved."""
    from muon import NewtonSchulzSchedule

    triple = (3.4445, -4.775, 2.0315)
    results = []
    for coefficients in ([list(triple)] * 5, (triple,) * 5):
        p = nn.Parameter(_randn(6, 4))
        opt = Muon([p], ns_coefficients=NewtonSchulzSchedule(coefficients))
        p.grad = _randn(6, 4, seed=1)
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_row_blocks_edited_in_place_between_steps_split_the_next_step():
    """The plan is rebuilt when a group's row_blocks change; a list edited in place
    compared equal to the key that held it, and the old split stayed."""
    grads = [_randn(6, 4, seed=s) for s in (1, 2)]
    finals = []
    for edit in ("in place", "replaced"):
        p = nn.Parameter(_randn(6, 4))
        opt = Muon([{"params": [p], "row_blocks": [3, 3]}])
        p.grad = grads[0]
        opt.step()
        if edit == "in place":
            opt.param_groups[0]["row_blocks"][:] = [2, 4]
        else:
            opt.param_groups[0]["row_blocks"] = [2, 4]
        p.grad = grads[1]
        opt.step()
        finals.append(p.detach().clone())
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize("coefficients", [None, "abc", ["abc"]])
def test_a_schedule_that_is_no_sequence_of_triples_is_refused_naming_it(coefficients):
    from muon import NewtonSchulzSchedule

    with pytest.raises(ValueError, match=r"should be a sequence but is: "):
        NewtonSchulzSchedule(coefficients)


def _stepped(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int, seed: int = 1):
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = _randn(*p.shape, seed=seed + 100 * step + i)
        opt.step()


def _zeroed_momentum(optimizer, state_dict):
    state = {k: {**v, "momentum_buffer": torch.zeros_like(v["momentum_buffer"])}
             for k, v in state_dict["state"].items()}  # fmt: skip
    return {**state_dict, "state": state}


def _momentum_replaced(optimizer):
    for entries in optimizer.state.values():
        entries["momentum_buffer"] = torch.full_like(entries["momentum_buffer"], 0.5)


@pytest.mark.parametrize(
    "register, hook",
    [
        ("register_load_state_dict_pre_hook", _zeroed_momentum),
        ("register_load_state_dict_post_hook", _momentum_replaced),
    ],
)
def test_load_state_dict_hooks_shape_what_loads_as_torch_optim_muon(register, hook):
    runs = {}
    for cls in (torch.optim.Muon, Muon):
        params = [nn.Parameter(_randn(8, 6)), nn.Parameter(_randn(6, 8, seed=1))]
        source = cls(params, lr=0.02, weight_decay=0.1)
        _stepped(source, params, 2)
        resumed = cls(params, lr=0.02, weight_decay=0.1)
        getattr(resumed, register)(hook)
        resumed.load_state_dict(source.state_dict())
        _stepped(resumed, params, 2, seed=7)
        runs[cls] = [p.detach().clone() for p in params]
    for ours, theirs in zip(runs[Muon], runs[torch.optim.Muon], strict=True):
        assert torch.equal(ours, theirs)


def test_a_pre_hook_that_adapts_state_to_the_params_is_checked_after_it_runs():
    saved_for = [nn.Parameter(_randn(8, 6))]
    source = Muon(saved_for)
    _stepped(source, saved_for, 1)
    params = [nn.Parameter(_randn(6, 8))]  # the model's layout changed: (in, out) now
    opt = Muon(params)

    def transposed(optimizer, state_dict):
        state = {k: {n: t.t().contiguous() for n, t in v.items()}
                 for k, v in state_dict["state"].items()}  # fmt: skip
        return {**state_dict, "state": state}

    opt.register_load_state_dict_pre_hook(transposed)
    opt.load_state_dict(source.state_dict())
    expected = source.state[saved_for[0]]["momentum_buffer"].t()
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], expected)


def test_a_torch_checkpoint_keeps_the_declared_row_blocks_and_algorithm():
    fused = nn.Parameter(_randn(12, 6))
    norm = nn.Parameter(_randn(6, seed=1))
    torch_muon = torch.optim.Muon([fused], lr=0.02)
    torch_adamw = torch.optim.AdamW([norm], lr=1e-3, weight_decay=0.1)
    _stepped(torch_muon, [fused], 1)
    _stepped(torch_adamw, [norm], 1)
    opt = Muon(
        [{"params": [fused], "row_blocks": (4, 8)}, {"params": [norm], "algorithm": "adamw"}],
        lr=0.02,
    )
    saved = torch_muon.state_dict()
    adamw_saved = torch_adamw.state_dict()
    merged = {
        "state": {0: saved["state"][0], 1: adamw_saved["state"][0]},
        "param_groups": [{**saved["param_groups"][0], "params": [0]},
                         {**adamw_saved["param_groups"][0], "params": [1]}],
    }  # fmt: skip
    opt.load_state_dict(copy.deepcopy(merged))  # torch's load shares the `step` tensors
    assert opt.param_groups[0]["row_blocks"] == (4, 8)
    assert opt.param_groups[1]["algorithm"] == "adamw"
    # and the AdamW group goes on as torch's AdamW, bit for bit
    theirs = nn.Parameter(norm.detach().clone())
    reference = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.1)
    reference.load_state_dict(adamw_saved)
    with warnings.catch_warnings():
        # the AdamW group has no `momentum` now: no scheduler cycled it
        warnings.simplefilter("error")
        _stepped(opt, [fused, norm], 2, seed=5)
    for step in range(2):
        theirs.grad = _randn(6, seed=5 + 100 * step + 1)
        reference.step()
    assert torch.equal(norm, theirs)


def test_a_param_listed_twice_by_name_or_in_a_group_appended_by_hand_is_refused():
    p = nn.Parameter(_randn(8, 6))
    with pytest.raises(ValueError, match="lists a param twice"):
        Muon([("w", p), ("w_again", p)])
    opt = Muon([p])
    opt.param_groups.append({**opt.param_groups[0], "params": [p], "algorithm": "adamw"})
    p.grad = _randn(8, 6, seed=1)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="is in param group 0 already"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


@pytest.mark.parametrize("option", ["params", "algorithm"])
def test_adamw_options_that_would_remake_the_adamw_group_are_refused(option):
    with pytest.raises(ValueError, match=f"adamw_options may not set '{option}'"):
        muon_param_groups(nn.Sequential(nn.Linear(4, 4)), adamw_options={option: []})


@pytest.mark.parametrize("where", ["row_blocks", "adamw_patterns"])
def test_a_pattern_that_is_no_regular_expression_is_refused_naming_it(where):
    model = nn.Sequential(nn.Linear(4, 8))
    patterns = {"row_blocks": {"(": (4, 4)}, "adamw_patterns": ("(",)}[where]
    with pytest.raises(ValueError, match=rf"{where} pattern '\(' is no regular expression"):
        muon_param_groups(model, **{where: patterns})


def test_row_blocks_given_one_number_is_refused_naming_the_pattern():
    # {pattern: 4} raised "'int' object is not iterable" from inside
    model = nn.ModuleDict({"qkv": nn.Linear(8, 12, bias=False)})
    with pytest.raises(TypeError, match=r"row_blocks\['qkv\\\\.weight\$'\] is 4; .*\(q, k, v\)"):
        muon_param_groups(model, row_blocks={r"qkv\.weight$": 4})


def test_a_row_blocks_pattern_matching_only_frozen_or_adamw_params_says_so():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"matches only \['0.weight \(frozen\)'\]"):
        muon_param_groups(model, row_blocks={r"^0\.weight$": (4, 4)})
    with pytest.raises(ValueError, match=r"matches only \['2.weight \(AdamW\)'\]"):
        muon_param_groups(model, row_blocks={r"^2\.weight$": (4, 4)})


def test_adamw_patterns_given_as_one_string_are_refused():
    with pytest.raises(TypeError, match=r"not one string: \('bias\|norm',\)"):
        muon_param_groups(nn.Sequential(nn.Linear(4, 4)), adamw_patterns="bias|norm")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_settings_and_steps_as_the_original(how):
    """torch's `Optimizer.__getstate__` keeps defaults, state and groups only: a copy lacked
    `ns_dtype` and the other settings, and its step raised AttributeError."""
    import io

    def copied(opt: Muon) -> Muon:
        if how == "deepcopy":
            return copy.deepcopy(opt)
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    weights = [nn.Parameter(_randn(8, 4, seed=1)), nn.Parameter(_randn(6, 6, seed=2))]
    opt = Muon(weights, lr=0.02, ns_dtype=torch.float32, bucket_cap_bytes=100, max_inflight=1)
    for p in weights:
        p.grad = torch.ones_like(p)
    opt.step()
    copy_ = copied(opt)
    assert (copy_.ns_dtype, copy_.bucket_cap_bytes, copy_.max_inflight) == (torch.float32, 100, 1)
    for step in range(2):
        for a, b in zip(
            opt.param_groups[0]["params"], copy_.param_groups[0]["params"], strict=True
        ):
            a.grad = _randn(*a.shape, seed=10 + step)
            b.grad = a.grad.clone()
        opt.step()
        copy_.step()
    for a, b in zip(opt.param_groups[0]["params"], copy_.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["momentum_buffer"], copy_.state[b]["momentum_buffer"])


def test_a_wrapper_that_hides_get_output_embeddings_still_sends_the_head_to_adamw():
    """`setup_optimizer(DDP(model))`: DDP hides the model's `get_output_embeddings()`, the
    only way a head named `proj_out` is found: it went to Muon, silently."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.mlp = nn.Linear(32, 32, bias=False)
            self.proj_out = nn.Linear(32, 50, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.proj_out

    class Wrapper(nn.Module):  # as DDP holds the model: `.module`, no model methods
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = LM()
    for wrapped in (model, Wrapper(model), nn.Sequential(model)):
        muon, adamw = muon_param_groups(wrapped)
        assert any(p is model.proj_out.weight for p in adamw["params"])
        assert [p for p in muon["params"]] == [model.mlp.weight]
    # a container of two models (a teacher and a student): each one's head
    teacher, student = LM(), LM()
    muon, _ = muon_param_groups(nn.ModuleDict({"teacher": teacher, "student": student}))
    assert [p for p in muon["params"]] == [teacher.mlp.weight, student.mlp.weight]


def _backbone() -> nn.Module:
    backbone = nn.Module()
    backbone.embed_tokens = nn.Embedding(50, 32)
    backbone.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in backbone.layers:
        layer.mlp = nn.Sequential(nn.Linear(32, 32, bias=False))
    backbone.norm = nn.LayerNorm(32)
    return backbone


@pytest.mark.parametrize("attribute", ["embedder", "normalizer", "debiased", "router_model"])
def test_a_wrapper_named_like_an_adamw_pattern_keeps_its_matrices_for_muon(attribute):
    # the default patterns searched the whole dotted name: a sentence-embedding or reward
    # wrapper holding its backbone as `embedder` sent every matrix in it to AdamW, silently
    wrapper = nn.Module()
    setattr(wrapper, attribute, _backbone())
    wrapper.proj = nn.Linear(32, 8, bias=False)
    groups = muon_param_groups(wrapper)
    muon = [p for g in groups if g.get("algorithm", "muon") == "muon" for p in g["params"]]
    matrices = [*getattr(wrapper, attribute).layers.parameters(), wrapper.proj.weight]
    assert {id(p) for p in muon} == {id(p) for p in matrices}


def test_a_layer_named_for_normals_is_not_taken_for_a_norm():
    # "norm" matched inside a word: a surface-normal head or a denormalizing projection
    # went to AdamW, silently (found by a hostile audit)
    model = nn.Module()
    for name in ("normal_proj", "abnormality_scorer", "denormalize"):
        setattr(model, name, nn.Linear(8, 8, bias=False))
    model.layernorm, model.q_norm = nn.LayerNorm(8), nn.Linear(8, 8, bias=False)
    groups = muon_param_groups(model)
    muon = {id(p) for g in groups if g.get("algorithm", "muon") == "muon" for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names == {"normal_proj.weight", "abnormality_scorer.weight", "denormalize.weight"}


class LayerNormLinear(nn.Module):
    """TransformerEngine's: a norm fused into the linear map after it."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(dim))
        self.weight = nn.Parameter(torch.randn(out, dim))


class LayerNormMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(dim))
        self.fc1_weight = nn.Parameter(torch.randn(hidden, dim))
        self.fc2_weight = nn.Parameter(torch.randn(dim, hidden))


def test_a_norm_fused_into_a_linear_map_keeps_its_matrices_for_muon():
    # TransformerEngine's TransformerLayer names them `layernorm_qkv` and `layernorm_mlp`:
    # the norm pattern sent the QKV and MLP matrices to AdamW, silently (hostile review)
    layer = nn.Module()
    layer.self_attention = nn.Module()
    layer.self_attention.layernorm_qkv = LayerNormLinear(16, 48)
    layer.self_attention.proj = nn.Linear(16, 16, bias=False)
    layer.layernorm_mlp = LayerNormMLP(16, 64)
    model = nn.ModuleDict({"layers": nn.ModuleList([layer])})
    with pytest.warns(
        UserWarning, match=r"\['layers.0.self_attention.layernorm_qkv.weight'\] look"
    ):
        groups = muon_param_groups(model)
    muon = {id(p) for g in groups if g.get("algorithm", "muon") == "muon" for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names == {
        "layers.0.self_attention.layernorm_qkv.weight",
        "layers.0.self_attention.proj.weight",
        "layers.0.layernorm_mlp.fc1_weight",
        "layers.0.layernorm_mlp.fc2_weight",
    }


def test_fsdp1_modules_are_refused_by_name():
    # FSDP1 flattens a unit's params into 1-D shards: every param went to AdamW, silently
    from torch.distributed.fsdp import FullyShardedDataParallel

    with one_rank_group():
        model = FullyShardedDataParallel(
            _backbone(), use_orig_params=True, device_id=torch.device("cpu")
        )
        with pytest.raises(ValueError, match=r"\['\(the root\)'\] are FSDP1"):
            muon_param_groups(model)


def test_every_param_going_to_adamw_is_warned_about():
    # DeepSpeed ZeRO-3 empties params to 1-D placeholders: none for Muon, and no word
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(0))
    model.other = nn.Parameter(torch.zeros(5))
    with pytest.warns(UserWarning, match="all 2 trainable params go to AdamW, none to Muon"):
        muon_param_groups(model)


def test_betas_in_a_group_left_muon_are_refused():
    # algorithm="adamw" forgotten: the betas were ignored and the embedding orthogonalized
    linear, embedding = nn.Linear(8, 8, bias=False), nn.Embedding(10, 8)
    with pytest.raises(ValueError, match="param group 1 sets betas, which only AdamW groups"):
        Muon([{"params": [linear.weight]}, {"params": [embedding.weight], "betas": (0.9, 0.95)}])
    Muon([{"params": [linear.weight]}, {"params": [embedding.weight], "algorithm": "adamw"}])


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("beta", "betas"),
        ("weight_decy", "weight_decay"),
        ("learning_rate", "lr"),
        ("beta1", "betas"),
    ],
)
def test_a_misspelled_group_key_is_refused_naming_the_setting(key, meant):
    # kept in the group as torch keeps any key, and never read: the AdamW group ran with
    # the default betas / weight decay, silently (hostile review)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    with pytest.raises(
        ValueError, match=f"sets '{key}', which no group reads: did you mean '{meant}'"
    ):
        Muon(muon_param_groups(model, adamw_options={key: (0.5, 0.5)}), lr=0.02)
    # a key of one's own that is no near miss is kept, as torch keeps it
    groups = muon_param_groups(model, adamw_options={"name": "x", "weight_decay_mult": 0.0})
    assert Muon(groups, lr=0.02).param_groups[1]["weight_decay_mult"] == 0.0


@pytest.mark.parametrize(
    "setting", [{"momentum": 0.5}, {"nesterov": False}, {"ns_steps": 3}, {"row_blocks": [2, 2]}]
)
def test_muon_settings_of_its_own_in_an_adamw_group_are_refused(setting):
    # kept unread (until the group is switched to Muon), where a Muon group's betas is
    # refused: momentum=0.5 meant as AdamW's beta1 silently did nothing (hostile review)
    weight, bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    (key,) = setting
    with pytest.raises(ValueError, match=f"param group 1 sets {key}=.*only Muon groups read"):
        Muon([{"params": [weight]}, {"params": [bias], "algorithm": "adamw", **setting}])


def test_groups_handed_back_from_an_optimizer_keep_their_muon_settings():
    """A group of an optimizer's `param_groups` carries every default torch filled in, and
    what loads and schedulers wrote since: not the caller's own settings (the first cut
    refused all of these: a review of it)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    first = Muon(muon_param_groups(model), lr=0.02, momentum=0.9)
    Muon(first.param_groups, lr=0.02)  # momentum=0.9 against this one's default 0.95
    loaded = Muon(muon_param_groups(model), lr=0.02)
    loaded.load_state_dict(first.state_dict())  # writes the AdamW group's ns_steps as 5
    Muon(loaded.param_groups, lr=0.02)
    copied = {k: v for k, v in loaded.param_groups[1].items() if k != "params"}
    loaded.add_param_group({**copied, "params": [nn.Parameter(torch.randn(3))]})
    cycled = Muon(muon_param_groups(model), lr=0.02)
    cycled.param_groups[1]["momentum"] = 0.85  # as OneCycleLR(cycle_momentum=True) writes it
    copied = {k: v for k, v in cycled.param_groups[1].items() if k != "params"}
    cycled.add_param_group({**copied, "params": [nn.Parameter(torch.randn(3))]})
    # the default's values as a list, written by hand
    weight, bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    coefficients = list(Muon([weight]).defaults["ns_coefficients"])
    Muon([{"params": [weight]}, {"params": [bias], "algorithm": "adamw",
                                  "ns_coefficients": coefficients}])  # fmt: skip


def test_muon_settings_in_adamw_options_are_refused():
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    with pytest.raises(ValueError, match=r"adamw_options sets \['momentum'\], which only Muon"):
        muon_param_groups(model, adamw_options={"momentum": 0.5})


def test_an_adamw_checkpoint_loaded_into_a_muon_group_is_refused_at_the_load():
    # switching from AdamW pretraining to Muon: the load succeeded and the first step
    # raised a bare KeyError: 'momentum'
    p, q = (nn.Parameter(torch.randn(6, 4)) for _ in range(2))
    adamw = torch.optim.AdamW([p])
    p.grad = torch.randn(6, 4)
    adamw.step()
    muon = Muon([q])
    with pytest.raises(ValueError, match=r"param group 0 .* lacks \['momentum'"):
        muon.load_state_dict(adamw.state_dict())
    q.grad = torch.randn(6, 4)
    muon.step()  # nothing was loaded
    assert set(muon.state[q]) == {"momentum_buffer"}


def test_words_in_a_params_module_or_its_parent_still_route_to_adamw():
    # looking at the last two names only sent DBRX's and JetMoe's routers
    # (`router.layer.weight`), DETR's box heads (`bbox_embed.layers.0.weight`) and
    # `patch_embed.0.weight` to Muon
    model = nn.Module()
    model.router = nn.Module()
    model.router.layer = nn.Linear(8, 4, bias=False)
    model.bbox_embed = nn.Module()
    model.bbox_embed.layers = nn.ModuleList([nn.Linear(8, 8, bias=False)])
    model.patch_embed = nn.Sequential(nn.Linear(8, 8, bias=False))
    model.rel_pos_bias = nn.Linear(8, 4, bias=False)
    model.body = nn.Linear(8, 8, bias=False)
    groups = muon_param_groups(model)
    assert [g["params"] for g in groups if g.get("algorithm", "muon") == "muon"] == [
        [model.body.weight]
    ]


def test_a_lazy_modules_param_is_refused_naming_it():
    # its shape is not known yet: it went to AdamW, and AdamW stepped the matrix for good
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"param 1\.weight is uninitialized .*forward once"):
        muon_param_groups(model)
    with pytest.raises(ValueError, match=r"param 1\.weight is uninitialized"):
        setup_optimizer(model, OptimizerConfig(type="muon"))


@pytest.mark.parametrize(
    ("spread_model", "error", "message"),
    [
        ("fast", TypeError, r"spread_model should be a muon\.SpreadModel but is: 'fast'"),
        (None, TypeError, r"spread_model should be a muon\.SpreadModel but is: None"),
        ({"replica_bytes_per_s": 0}, ValueError, r"replica_bytes_per_s should be > 0 but is: 0"),
        ({"ns_flops_per_s": -1.0}, ValueError, r"ns_flops_per_s should be > 0 but is: -1\.0"),
        ({"ns_steps": 0}, ValueError, r"spread_model.*\.ns_steps should be >= 1 but is: 0"),
    ],
    ids=["string", "none", "zero_rate", "negative_flops", "no_steps"],
)
def test_a_spread_model_of_the_wrong_type_or_range_is_refused_naming_it(
    spread_model, error, message
):
    # accepted, it failed under HSDP at the first step: an AttributeError, or dividing by 0
    from muon import SpreadModel

    if isinstance(spread_model, dict):
        spread_model = SpreadModel(**spread_model)
    with pytest.raises(error, match=message):
        Muon([nn.Parameter(_randn(4, 4))], spread_model=spread_model)
    opt = Muon([nn.Parameter(_randn(4, 4))])
    opt.spread_model = spread_model  # between steps, as the settings may be
    with pytest.raises(error, match=message):
        opt.step()
    if isinstance(spread_model, SpreadModel):
        with pytest.raises(error, match=message):
            OptimizerConfig(type="muon", muon_options={"spread_model": spread_model})


@pytest.mark.parametrize(
    ("key", "value"),
    [("momentum", 5.0), ("nesterov", "yes"), ("adjust_lr_fn", "bogus"), ("ns_algorithm", "x")],
)
def test_an_adamw_groups_muon_settings_are_checked_as_a_muon_groups(key, value):
    # unread by AdamW, they were accepted, and read once the group was switched to Muon
    group = {"params": [nn.Parameter(_randn(6, 4))], "algorithm": "adamw", key: value}
    with pytest.raises((TypeError, ValueError), match=rf"param group 0: {key} should be"):
        Muon([group]).step()


def test_a_group_from_a_torch_adamw_checkpoint_steps_and_switched_to_muon_says_what_it_lacks():
    # it has no Muon settings: the check of an AdamW group's raised a bare KeyError
    model = nn.Sequential(nn.Linear(8, 8, bias=False))
    saved = torch.optim.AdamW(model.parameters()).state_dict()
    opt = Muon([{"params": list(model.parameters()), "algorithm": "adamw"}], lr=0.02)
    opt.load_state_dict(saved)
    assert "momentum" not in opt.param_groups[0]
    model(_randn(2, 8)).sum().backward()
    opt.step()
    opt.param_groups[0]["algorithm"] = "muon"
    with pytest.raises(
        ValueError,
        match=r"param group 0: momentum, nesterov, adjust_lr_fn, ns_coefficients, ns_steps missing",
    ):
        opt.step()


def test_a_refused_param_group_is_not_added():
    # torch's add_param_group appended it before Muon checked it: the retry the error
    # suggests (algorithm='adamw') was refused as a duplicate, and every step raised
    weight, bias = nn.Parameter(_randn(8, 4)), nn.Parameter(_randn(8))
    opt = Muon([weight], lr=0.02)
    with pytest.raises(ValueError, match="Muon supports 2-D and 3-D params"):
        opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [bias], "algorithm": "adamw"})
    weight.grad, bias.grad = _randn(8, 4), _randn(8)
    opt.step()
    assert opt.state[bias]["exp_avg"].shape == (8,)


def test_a_param_tied_to_a_head_goes_to_adamw_whichever_name_comes_first():
    # named_parameters() names a tied param once, by its first registration: a raw token
    # table registered before `lm_head` sent the shared head to Muon, untied to AdamW
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Parameter(_randn(50, 16))  # read with F.embedding
            self.body = nn.Linear(16, 16, bias=False)
            self.lm_head = nn.Linear(16, 50, bias=False)
            self.lm_head.weight = self.tok

    model = LM()
    adamw = next(g for g in muon_param_groups(model) if g.get("algorithm") == "adamw")
    assert [p is model.tok for p in adamw["params"]] == [True]


def test_errors_name_a_param_by_its_name_where_the_group_has_names():
    # given model.named_parameters(), errors still said "param 1 (shape (8,))"
    model = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(ValueError, match=r"param 1 \('0\.bias', shape \(8,\)\): Muon supports"):
        Muon(model.named_parameters())
    opt = Muon([("0.weight", model[0].weight)])
    model[0].weight.grad = torch.zeros(8, 4).to_sparse()
    with pytest.raises(RuntimeError, match=r"param 0 \('0\.weight', shape \(8, 4\)\) has a"):
        opt.step()


def test_a_non_finite_grad_poisons_only_its_own_matrix():
    # the other blocks of a fused param and the other experts of a stack step as if the
    # bad one were not there (as torch.optim.Muon steps each matrix alone)
    def run(bad: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        fused = nn.Parameter(torch.randn(8, 6))
        stack = nn.Parameter(torch.randn(3, 5, 4))
        fused.grad, stack.grad = torch.randn(8, 6), torch.randn(3, 5, 4)
        if bad:
            fused.grad[1, 2], stack.grad[1, 0, 0] = float("nan"), float("inf")
        Muon([{"params": [fused], "row_blocks": (4, 4)}, {"params": [stack]}], lr=0.1).step()
        return [fused.detach()[4:], stack.detach()[0], stack.detach()[2], fused, stack]

    *clean, _, _ = run(False)
    *others, fused, stack = run(True)
    assert all(torch.equal(a, b) for a, b in zip(clean, others, strict=True))
    assert fused[:4].isnan().all() and stack[1].isnan().all()


def test_params_on_the_meta_device_step_as_torch_muon_steps_them():
    # a dry run on meta params failed inside the step with "unknown device type for
    # autocast"; torch.optim.Muon steps them
    params = [nn.Parameter(torch.empty(4, 6, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.empty_like(p)
    torch.optim.Muon(params[:1]).step()
    opt = Muon(params[1:])
    opt.step()
    assert opt.state[params[1]]["momentum_buffer"].is_meta


def test_three_d_params_not_named_as_expert_stacks_are_warned_about():
    # XLNet's (d_model, heads, head_dim) q went to Muon as d_model matrices of
    # (heads, head_dim), each orthogonalized alone, without a word
    model = nn.Module()
    model.rel_attn = nn.Module()
    model.rel_attn.q = nn.Parameter(torch.randn(8, 2, 4))
    model.experts = nn.Module()
    model.experts.w1 = nn.Parameter(torch.randn(3, 4, 5))
    with pytest.warns(UserWarning, match=r"\['rel_attn.q \(8, 2, 4\)'\] are 3-D and not named"):
        muon_param_groups(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        muon_param_groups(model, adamw_patterns=(r"rel_attn\.q$",))
        muon_param_groups(model, row_blocks={r"rel_attn\.q$": (2,)})  # a stack, declared


def _no_grad_warnings(step) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    found = [w for w in caught if "no grad on any" in str(w.message)]
    assert all(w.filename == __file__ for w in found)  # the user's line
    return [str(w.message) for w in found]


def test_an_optimizer_built_before_fully_shard_is_warned_about_at_its_second_step():
    # fully_shard replaces the params: the optimizer's old ones never get a grad, and its
    # steps updated nothing, silently (the loss never moved)
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        opt = Muon(model.parameters(), lr=0.1)
        fully_shard(model)

        def train():
            model(_randn(4, 8)).square().mean().backward()
            opt.step()

        assert _no_grad_warnings(train) == []  # one such step may be a step before training
        (message,) = _no_grad_warnings(train)
        assert "Muon.step() found no grad on any of its 2 params two steps in a row" in message
        assert "build it after fully_shard" in message
        assert _no_grad_warnings(train) == []  # once a run of them

        built_after = Muon(model.parameters(), lr=0.1)
        before = _snapshot(list(model.parameters()))

        def train_after():
            for _ in range(2):
                built_after.zero_grad()
                model(_randn(4, 8)).square().mean().backward()
                built_after.step()

        assert _no_grad_warnings(train_after) == []
        # a step with grads ends a run: one step without, one with, one without
        built_after.zero_grad()
        assert _no_grad_warnings(built_after.step) == []
        assert _no_grad_warnings(train_after) == []
        built_after.zero_grad()
        assert _no_grad_warnings(built_after.step) == []
        after = _snapshot(list(model.parameters()))
        assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_params_that_share_memory_are_refused_before_anything_steps():
    # A decoder tied as the encoder's transpose (two params, one storage): the step decays
    # a bucket's params, then updates them, torch one after the other; the result moved
    # with bucket_cap_bytes and differed from torch.optim.Muon, silently
    enc = nn.Parameter(_randn(6, 6))
    dec = nn.Parameter(enc.data.t())
    expanded = nn.Parameter(_randn(1, 6).expand(8, 6))
    unfolded = nn.Parameter(_randn(10).unfold(0, 4, 2))  # rows overlap, no stride of 0
    own = nn.Parameter(_randn(6, 6, seed=1))
    w = _randn(8, 12, seed=9)
    for p, seed in ((enc, 2), (dec, 3), (expanded, 4), (own, 5), (unfolded, 6)):
        p.grad = _randn(*p.shape, seed=seed)
    cases = [
        (
            [own, enc, dec],
            r"group 0: param 1 \(shape \(6, 6\)\) and param group 0: param 2 .* share",
        ),
        (
            [{"params": [enc]}, {"params": [dec], "algorithm": "adamw"}],
            "and param group 1: param 0",
        ),
        ([own, expanded], r"param 1 \(shape \(8, 6\)\) shares memory with itself"),
        ([unfolded], r"param 0 \(shape \(4, 4\)\) shares memory with itself"),
        # the overlapping pair is not next to each other by where they start
        ([w[:, 0::3], w[:, 1::3], w[:, 0::2]], r"param 0 .* and param group 0: param 2 "),
    ]
    for groups, named in cases:
        for p in groups if isinstance(groups[0], torch.Tensor) else ():
            if p.grad is None:
                p.grad = _randn(*p.shape, seed=10)
        opt = Muon(groups, lr=0.02)
        params = [p for g in opt.param_groups for p in g["params"]]
        before = _snapshot(params)
        with pytest.raises(ValueError, match=named):
            opt.step()
        _assert_nothing_stepped(opt, params, before)


@pytest.mark.parametrize(
    "cut",
    [
        lambda w: (w[:4], w[4:]),  # rows
        lambda w: (w[:, :4], w[:, 4:]),  # columns: their spans of memory intersect
        lambda w: (w[:, 0::2], w[:, 1::2]),  # interleaved
        lambda w: (w.view(2, 4, 8)[:, :, :4], w.view(2, 4, 8)[:, :, 4:]),  # expert stacks
    ],
)
def test_views_of_one_tensor_whose_elements_are_apart_step_as_params_of_their_own(cut):
    views = [nn.Parameter(v) for v in cut(_randn(8, 8, seed=6))]
    apart = [nn.Parameter(v.detach().clone()) for v in views]
    for a, b in zip(views, apart, strict=True):
        a.grad = _randn(*a.shape, seed=8)
        b.grad = a.grad.clone()
    Muon(views, lr=0.02).step()
    Muon(apart, lr=0.02).step()
    assert all(torch.equal(a, b) for a, b in zip(views, apart, strict=True))


def test_views_of_two_element_sizes_are_compared_by_their_bytes():
    from muon.optimizer import _check_memory_apart

    w = _randn(8, 8)
    apart = [nn.Parameter(w[:, :4]), nn.Parameter(w[:, 4:].view(torch.bfloat16))]
    _check_memory_apart([{"params": apart}])
    shared = [nn.Parameter(w[:, :5]), nn.Parameter(w[:, 4:].view(torch.bfloat16))]
    with pytest.raises(ValueError, match="share memory"):
        _check_memory_apart([{"params": shared}])


def test_params_of_a_wrapper_subclass_are_not_taken_as_sharing_memory():
    # a wrapper subclass's data_ptr() is 0: any two of them looked like one memory
    from torch.testing._internal.two_tensor import TwoTensor

    params = [nn.Parameter(TwoTensor(_randn(4, 4, seed=s), _randn(4, 4, seed=s))) for s in (1, 2)]
    for p in params:
        p.grad = TwoTensor(_randn(4, 4, seed=3), _randn(4, 4, seed=3))
    Muon([{"params": params, "algorithm": "adamw"}], lr=0.02).step()


def test_an_adamw_group_with_l2_weight_decay_is_refused():
    # torch.optim.Adam's groups carry decoupled_weight_decay=False (L2 decay); loaded into
    # an AdamW group it was kept, unread: the step decayed decoupled, silently
    p = nn.Parameter(_randn(6, 6))
    group = {"params": [p], "algorithm": "adamw", "weight_decay": 0.1}
    with pytest.raises(ValueError, match="decoupled_weight_decay=False is not supported"):
        Muon([{**group, "decoupled_weight_decay": False}])
    opt = Muon([{**group, "decoupled_weight_decay": True}])
    opt.param_groups[0]["decoupled_weight_decay"] = False
    p.grad = _randn(6, 6, seed=1)
    with pytest.raises(ValueError, match="decoupled_weight_decay=False is not supported"):
        opt.step()


@pytest.mark.parametrize(
    ("break_state", "message"),
    [
        ("amsgrad", "amsgrad was turned on after the state of"),
        ("del_exp_avg", "has AdamW state without 'exp_avg'"),
        ("float_step", "has a 'step' of type float"),
        ("exp_avg_shape", r"has an exp_avg Tensor \(3,\)"),
        ("exp_avg_none", "has an exp_avg NoneType"),
        ("exp_avg_bf16", "has an exp_avg Tensor .* torch.bfloat16"),
    ],
)
def test_a_step_refused_for_its_adamw_state_leaves_the_muon_matrices_as_they_were(
    break_state, message
):
    # the AdamW groups' state was read only when they stepped, after the Muon groups had:
    # a user who mended it and stepped again had one Muon update too many (hostile review)
    def run(refused: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        weight, bias = nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.randn(16))
        opt = Muon([{"params": [weight]}, {"params": [bias], "algorithm": "adamw"}], lr=0.02)
        for seed in range(3):
            weight.grad, bias.grad = _randn(16, 16, seed=seed), _randn(16, seed=10 + seed)
            if seed == 1 and refused:
                state, group = opt.state[bias], opt.param_groups[1]
                kept = dict(state)
                if break_state == "amsgrad":
                    group["amsgrad"] = True
                elif break_state == "del_exp_avg":
                    del state["exp_avg"]
                elif break_state == "float_step":
                    state["step"] = float(state["step"])
                else:
                    state["exp_avg"] = {
                        "exp_avg_shape": torch.zeros(3),
                        "exp_avg_none": None,
                        "exp_avg_bf16": state["exp_avg"].bfloat16(),
                    }[break_state]
                with pytest.raises(ValueError, match=message):
                    opt.step()
                group["amsgrad"] = False
                state.update(kept)
            opt.step()
        return [weight.detach(), opt.state[weight]["momentum_buffer"], bias.detach()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)
