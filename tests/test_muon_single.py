"""Muon on one process: torch.optim.Muon parity, schedules, fused / stacked params, groups."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from muon import (
    DEEPSEEK_V4,
    KELLER_JORDAN,
    POLAR_EXPRESS,
    SCHEDULES,
    Muon,
    NewtonSchulzSchedule,
    muon_param_groups,
    zeropower,
)
from offload import CPUOffloadOptimizer

SHAPES = [(37, 53), (70, 33), (8, 70), (64, 64), (1, 9)]


def _params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _run(optimizer, params, steps: int = 3, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
        {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "adjust_lr_fn": "original"},
        {"ns_coefficients": (3.0, -3.2, 1.2), "ns_steps": 3, "eps": 1e-5},
    ],
)
def test_matches_torch_muon_bitwise(options):
    ours, theirs = _params(SHAPES), _params(SHAPES)
    _run(Muon(ours, bucket_cap_bytes=4000, **options), ours)
    ref = torch.optim.Muon(theirs, **options)
    _run(ref, theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_buckets_and_inflight_do_not_change_the_result():
    results = []
    for cap, inflight in [(10**9, 1), (3000, 1), (3000, 3), (1, 2)]:
        params = _params(SHAPES)
        opt = Muon(params, bucket_cap_bytes=cap, max_inflight=inflight)
        _run(opt, params)
        results.append(params)
        assert len(opt.metrics) == {10**9: 1, 1: len(SHAPES)}.get(cap, len(opt.metrics))
    for other in results[1:]:
        for p, q in zip(results[0], other, strict=True):
            assert torch.equal(p, q)


def test_same_shape_matrices_update_alike_whatever_the_bucket_cap():
    # three (16, 16) matrices share one batch under the default cap, one each under a cap
    # of 1 byte: CPU batched bf16 products made 2 of 30 seeds differ
    for seed in range(30):
        results = []
        for options in ({}, {"bucket_cap_bytes": 1}):
            params = _params([(16, 16)] * 3, seed=seed)
            _run(Muon(params, **options), params, steps=2, seed=seed)
            results.append(params)
        for p, q in zip(*results, strict=True):
            assert torch.equal(p, q), seed


def test_a_param_given_a_new_shape_is_replanned():
    # the cached plan kept the old shape: after p.data = bigger, only the old rows moved
    ours = _params([(5, 7), (6, 7)])
    opt = Muon(ours)
    _run(opt, ours, steps=1)
    for p, shape in zip(ours, [(9, 7), (6, 4)], strict=True):
        p.data = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    opt.state.clear()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    _run(opt, ours, steps=2)
    _run(torch.optim.Muon(theirs), theirs, steps=2)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_zeropower_matches_torch_and_schedules_orthogonalize():
    x = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(0))
    for m in (x, x.mT):
        ref = torch.stack(
            [_zeropower_via_newtonschulz(a, (3.4445, -4.775, 2.0315), 5, 1e-7) for a in m]
        )
        assert torch.equal(zeropower(m.bfloat16(), KELLER_JORDAN), ref)
        assert torch.equal(zeropower(m[0].bfloat16(), KELLER_JORDAN), ref[0])
    bounds = {"keller_jordan": (0.6, 1.2), "polar_express": (0.8, 1.2), "deepseek_v4": (0.99, 1.01)}
    for name, schedule in SCHEDULES.items():
        singular = torch.linalg.svdvals(zeropower(x, schedule))
        low, high = bounds[name]
        assert low < singular.min() and singular.max() < high, name
    assert DEEPSEEK_V4.steps == 10 and POLAR_EXPRESS.norm_scale == 1.02


def test_fused_rows_and_expert_stacks_equal_separate_matrices():
    gen = torch.Generator().manual_seed(3)
    fused = torch.nn.Parameter(torch.randn(16, 12, generator=gen))
    experts = torch.nn.Parameter(torch.randn(3, 7, 10, generator=gen))
    pieces = [torch.nn.Parameter(t.clone()) for t in fused.detach().split((8, 4, 4))]
    singles = [torch.nn.Parameter(t.clone()) for t in experts.detach().unbind(0)]
    opt = Muon([{"params": [fused], "row_blocks": (8, 4, 4)}, {"params": [experts]}], lr=0.1)
    ref = Muon(pieces + singles, lr=0.1)
    for _ in range(3):
        fused.grad = torch.randn(16, 12, generator=gen)
        experts.grad = torch.randn(3, 7, 10, generator=gen)
        for p, g in zip(
            pieces + singles, [*fused.grad.split((8, 4, 4)), *experts.grad], strict=True
        ):
            p.grad = g.clone()
        opt.step()
        ref.step()
    assert torch.equal(fused, torch.cat(pieces))
    assert torch.equal(experts, torch.stack(singles))
    assert opt.state_layout(experts) == {"momentum_buffer": (torch.Size([3, 7, 10]), torch.float32)}


def test_adamw_group_matches_torch_adamw_bitwise():
    ours, theirs = _params([(5, 7), (11,)]), _params([(5, 7), (11,)])
    opt = Muon([{"params": ours, "algorithm": "adamw", "lr": 1e-2, "betas": (0.8, 0.9)}])
    _run(opt, ours)
    _run(torch.optim.AdamW(theirs, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1), theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    assert opt.state_layout(ours[1]) == {
        "exp_avg": (torch.Size([11]), torch.float32),
        "exp_avg_sq": (torch.Size([11]), torch.float32),
    }


def test_subset_step_units_hyperparameters_and_params_without_grads():
    def setup():
        params = _params(SHAPES + [(4,)])
        groups = [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]
        return params, Muon(groups, lr=0.02, bucket_cap_bytes=9000)

    ref_params, ref = setup()
    params, opt = setup()
    for p in params:
        assert set(opt.state_layout(p)) in ({"momentum_buffer"}, {"exp_avg", "exp_avg_sq"})
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(ref_params, params, strict=True):
            q.grad = p.grad = (
                None if step == 1 and p is ref_params[0] else torch.randn(p.shape, generator=gen)
            )
        ref.step()
        subset = opt.begin_subset_step()
        opt.param_groups[0]["lr"] = 123.0  # a scheduler stepping mid-step must not matter
        units = subset.units
        assert sorted(id(p) for u in units for p in u) == sorted(id(p) for p in params)
        assert len(units) > 2
        for unit in units[::-1]:
            subset.step_params(unit)
        opt.param_groups[0]["lr"] = 0.02
    for p, q in zip(ref_params, params, strict=True):
        assert torch.equal(p, q)
        for key, value in ref.state[p].items():
            assert torch.equal(opt.state[q][key], value)
        for key, (shape, dtype) in opt.state_layout(q).items():
            assert (opt.state[q][key].shape, opt.state[q][key].dtype) == (shape, dtype)
    assert [len(unit) for unit in units] == [1] * len(params)  # local matrices: a unit each


class _CountingList(list):
    """A group's params that count the params an iteration over them visits (indexing is
    not counted)."""

    visits = 0

    def __iter__(self):
        for p in super().__iter__():
            _CountingList.visits += 1
            yield p


def test_state_layout_of_every_param_visits_each_param_once():
    # state_layout scanned the groups for each param: called for every param (as the
    # offload wrapper sizes its slabs and checks a load), the visits grew as params squared
    n = 200
    params = _params([(3, 2)] * n)
    opt = Muon([{"params": params[: n // 2]}, {"params": params[n // 2 :], "algorithm": "adamw"}])
    for group in opt.param_groups:
        group["params"] = _CountingList(group["params"])
    _CountingList.visits = 0
    for _ in range(2):
        for p in params:
            opt.state_layout(p)
    assert _CountingList.visits <= n


def test_state_layout_follows_groups_added_loaded_and_edited():
    a, b, c = _params([(4, 3), (4, 3), (5,)])
    opt = Muon([{"params": [a]}, {"params": [b], "algorithm": "adamw"}])
    muon = {"momentum_buffer": (torch.Size([4, 3]), torch.float32)}
    adamw = ("exp_avg", "exp_avg_sq")
    amsgrad = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert opt.state_layout(a) == muon and tuple(opt.state_layout(b)) == adamw
    opt.add_param_group({"params": [c], "algorithm": "adamw", "amsgrad": True})
    assert opt.state_layout(c) == {key: (torch.Size([5]), torch.float32) for key in amsgrad}
    # a load takes the saved groups' options: amsgrad in group 1 now
    x, y, z = _params([(4, 3), (4, 3), (5,)])
    saved = Muon(
        [
            {"params": [x]},
            {"params": [y], "algorithm": "adamw", "amsgrad": True},
            {"params": [z], "algorithm": "adamw"},
        ]
    ).state_dict()
    opt.load_state_dict(saved)
    assert tuple(opt.state_layout(b)) == amsgrad and tuple(opt.state_layout(c)) == adamw
    # params traded between groups of one length each, by hand
    first, second = opt.param_groups[0], opt.param_groups[1]
    first["params"], second["params"] = second["params"], first["params"]
    assert tuple(opt.state_layout(a)) == amsgrad and opt.state_layout(b) == muon
    with pytest.raises(ValueError, match="not in this optimizer's param groups"):
        opt.state_layout(torch.nn.Parameter(torch.zeros(2, 2)))


def test_metrics_and_timings():
    params = _params(SHAPES)
    opt = Muon(params, bucket_cap_bytes=3000, collect_timings=True)
    _run(opt, params, steps=1)
    assert sum(m.matrices for m in opt.metrics) == len(SHAPES)
    for m in opt.metrics:
        assert m.bytes_sent == m.bytes_received == 0 and m.workspace_bytes > 0
        assert min(m.exchange_s, m.ns_s, m.apply_s) >= 0.0
    _run(Muon(params), params, steps=1)


def test_offloaded_muon_is_bitwise_equal_to_plain():
    results = []
    for chunk_bytes in (None, 2**40, 3000, 1):
        params = _params(SHAPES + [(6,)])
        groups = [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]
        opt = Muon(groups, lr=0.02, bucket_cap_bytes=4000)
        if chunk_bytes is not None:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=chunk_bytes)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            scheduler.step()
        results.append((params, opt.state_dict()))
    for params, state in results[1:]:
        for p, q in zip(results[0][0], params, strict=True):
            assert torch.equal(p, q)
        for index, entries in results[0][1]["state"].items():
            for key, value in entries.items():
                assert torch.equal(state["state"][index][key], value), (index, key)


def _adamw_names(model: torch.nn.Module) -> set[str]:
    (*_, adamw) = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in adamw["params"]}


def test_param_group_helper_sends_convs_embeddings_and_heads_to_adamw():
    # Conv1d weights (3-D) went to Muon as expert stacks; GPT-2's wte / wpe and heads
    # named head / output / classifier / score went to Muon
    model = torch.nn.ModuleDict(
        {
            "wte": torch.nn.Embedding(10, 8),
            "conv": torch.nn.Conv1d(8, 8, 3),
            "proj": torch.nn.Linear(8, 8, bias=False),
            **{name: torch.nn.Linear(8, 4, bias=False) for name in ("output", "classifier")},
        }
    )
    assert _adamw_names(model) == {
        "wte.weight", "conv.weight", "conv.bias", "output.weight", "classifier.weight",
    }  # fmt: skip
    transformers = pytest.importorskip("transformers")
    tiny = {"vocab_size": 32, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 8}
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny))
    assert {n for n in _adamw_names(gpt2) if "ln_" not in n and "bias" not in n} == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
    }  # lm_head is tied to wte: one param
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        )
    )  # fmt: skip
    assert {n for n in _adamw_names(llama) if "norm" not in n} == {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_labels=3,
        )
    )  # fmt: skip
    assert "score.weight" in _adamw_names(classifier)


def test_param_group_helper_routes_task_heads_hidden_outputs_and_learned_tokens():
    # Task heads of stock transformers models went to Muon (a rank-2 QA head's update
    # orthogonalized: qa_outputs, classifier.out_proj, classifier.1, ...), square hidden
    # projections named `output` deep in a block went to AdamW (RWKV, LED), and learned
    # query tokens (BLIP-2's, (1, 32, hidden)) went to Muon as a stack of one matrix
    transformers = pytest.importorskip("transformers")
    bert = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1}
    bert |= {"num_attention_heads": 2, "intermediate_size": 32}
    qa = transformers.BertForQuestionAnswering(transformers.BertConfig(**bert))
    assert "qa_outputs.weight" in _adamw_names(qa)
    assert "bert.encoder.layer.0.output.dense.weight" not in _adamw_names(qa)  # hidden
    roberta = transformers.RobertaForSequenceClassification(
        transformers.RobertaConfig(**bert, num_labels=3)
    )
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= _adamw_names(roberta)
    model = torch.nn.Module()
    model.classifier = torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(8, 3))
    model.score = torch.nn.Module()
    model.score.out_proj = torch.nn.Linear(8, 3, bias=False)
    model.blocks = torch.nn.ModuleList([torch.nn.Module()])
    model.blocks[0].attention = torch.nn.Module()
    model.blocks[0].attention.output = torch.nn.Linear(8, 8, bias=False)
    model.output = torch.nn.Linear(8, 10, bias=False)  # torchtitan's head, at the root
    model.query_tokens = torch.nn.Parameter(torch.zeros(1, 4, 8))
    assert _adamw_names(model) == {
        "classifier.1.weight", "classifier.1.bias", "score.out_proj.weight",
        "output.weight", "query_tokens",
    }  # fmt: skip
    # torchtitan's head under two wrappers (DDP around a compiled model) is still the head
    outer = torch.nn.Module()
    outer.module = torch.nn.Module()
    outer.module._orig_mod = model
    assert "module._orig_mod.output.weight" in _adamw_names(outer)


def test_param_group_helper_sends_heads_of_megatron_timm_and_olmo_core_to_adamw():
    # Megatron's `output_layer`, timm's `head.fc` and OLMo-core's `lm_head.w_out` went to
    # Muon; hidden layers of the same names inside numbered blocks stay with it
    model = torch.nn.Module()
    model.output_layer = torch.nn.Linear(8, 20, bias=False)  # Megatron's GPTModel
    model.head = torch.nn.Module()
    model.head.fc = torch.nn.Linear(8, 3, bias=False)  # timm's ConvNeXt, ViT with a pool
    model.lm_head = torch.nn.Module()
    model.lm_head.w_out = torch.nn.Linear(8, 20, bias=False)  # OLMo-core's LMHead
    model.blocks = torch.nn.ModuleList([torch.nn.Module()])
    model.blocks[0].output_layer = torch.nn.Linear(8, 8, bias=False)
    model.blocks[0].mlp = torch.nn.Module()
    model.blocks[0].mlp.fc = torch.nn.Linear(8, 8, bias=False)
    model.input_ff_layer = torch.nn.Module()  # TimesFM's residual input block: hidden
    model.input_ff_layer.output_layer = torch.nn.Linear(8, 8, bias=False)
    assert _adamw_names(model) == {"output_layer.weight", "head.fc.weight", "lm_head.w_out.weight"}
    wrapped, fp16 = torch.nn.Module(), torch.nn.Module()
    wrapped.module, fp16.module = fp16, model  # DDP around Megatron's Float16Module
    assert "module.module.output_layer.weight" in _adamw_names(wrapped)
    assert "module.module.input_ff_layer.output_layer.weight" not in _adamw_names(wrapped)


def test_param_group_helper_sends_the_models_output_embeddings_to_adamw():
    # A head named otherwise (BERT's cls.predictions.decoder untied, a custom model's
    # proj_out) went to Muon: the name patterns did not match it
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 8, bias=False)
            self.proj_out = torch.nn.Linear(8, 20, bias=False)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.proj_out

    assert _adamw_names(Model()) == {"proj_out.weight"}

    class Headless(Model):
        def get_output_embeddings(self) -> torch.nn.Module:
            raise NotImplementedError

    assert [g.get("algorithm") for g in muon_param_groups(Headless())] == [None]  # all Muon
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=8, tie_word_embeddings=False,
        )
    )  # fmt: skip
    assert "cls.predictions.decoder.weight" in _adamw_names(bert)
    # a model without a head (transformers' base models return None): its matrices stay
    assert "pooler.dense.weight" not in _adamw_names(transformers.BertModel(bert.config))


def test_param_group_helper():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 8)
            self.qkv_proj = torch.nn.Linear(8, 16, bias=False)
            self.o_proj = torch.nn.Linear(8, 8)
            self.input_norm = torch.nn.LayerNorm(8)
            self.router = torch.nn.Linear(8, 4, bias=False)
            self.experts = torch.nn.Parameter(torch.zeros(4, 6, 8))
            self.lm_head = torch.nn.Linear(8, 10, bias=False)

    model = Block()
    groups = muon_param_groups(
        model, row_blocks={r"qkv_proj\.weight$": (8, 4, 4)}, adamw_options={"lr": 3e-4}
    )
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [sorted(names[id(p)] for p in g["params"]) for g in groups]
    assert by_group == [
        ["experts", "o_proj.weight"],
        ["qkv_proj.weight"],
        [
            "embed_tokens.weight",
            "input_norm.bias",
            "input_norm.weight",
            "lm_head.weight",
            "o_proj.bias",
            "router.weight",
        ],
    ]
    assert groups[1]["row_blocks"] == (8, 4, 4)
    assert groups[2]["algorithm"] == "adamw" and groups[2]["lr"] == 3e-4
    Muon(groups).step()
    with pytest.raises(ValueError, match="matches no Muon param"):
        muon_param_groups(model, row_blocks={"nothing": (1,)})
    with pytest.raises(TypeError, match="takes the model .* not its params: got generator"):
        muon_param_groups(model.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr should be >= 0 but is: -1.0"),
        ({"lr": float("inf")}, "lr should be finite but is: inf"),
        ({"momentum": -0.5}, r"momentum should be in \[0, 1\) but is: -0.5"),
        ({"momentum": 1.5}, r"momentum should be in \[0, 1\) but is: 1.5"),
        ({"weight_decay": -0.1}, "weight_decay should be >= 0 but is: -0.1"),
        ({"weight_decay": float("nan")}, "weight_decay should be finite but is: nan"),
        ({"eps": -1.0}, "eps should be >= 0 but is: -1.0"),
        ({"eps": float("inf")}, "eps should be finite but is: inf"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn should be one of .* but is: 'spectral'"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients should be \(a, b, c\)"),
        ({"ns_steps": 100}, "ns_steps should be None or in"),
        ({"ns_coefficients": POLAR_EXPRESS, "ns_steps": 3}, "ns_steps should be None or 5"),
        ({"ns_dtype": torch.float16}, "ns_dtype should be"),
        ({"ns_dtype": "half"}, "ns_dtype should be .* but is: 'half'"),
        ({"bucket_cap_bytes": 0}, "bucket_cap_bytes should be >= 1 but is: 0"),
        ({"max_inflight": 0}, "max_inflight should be >= 1 but is: 0"),
        ({"lr": torch.tensor(0.1)}, "Tensor lr"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(_params([(3, 4)]), **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nesterov": "no"}, "nesterov should be True or False but is: 'no'"),
        ({"lr": "1e-3"}, "lr should be a number but is: '1e-3'"),
        ({"bucket_cap_bytes": 1.5}, "bucket_cap_bytes should be an int but is: 1.5"),
        ({"max_inflight": True}, "max_inflight should be an int but is: True"),
        ({"collect_timings": 1}, "collect_timings should be True or False but is: 1"),
    ],
)
def test_constructor_type_errors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Muon(_params([(3, 4)]), **kwargs)


@pytest.mark.parametrize(
    "group, error, match",
    [
        ({"momentum": 1.5}, ValueError, r"momentum should be in \[0, 1\) but is: 1.5"),
        ({"nesterov": "no"}, TypeError, "nesterov should be True or False but is: 'no'"),
        ({"lr": float("inf")}, ValueError, "lr should be finite but is: inf"),
        ({"row_blocks": (16, -4, 4)}, ValueError, r"row_blocks\[1\] should be >= 1 but is: -4"),
        (
            {"algorithm": "adamw", "betas": (0.9,)},
            ValueError,
            r"betas should be a pair \(beta1, beta2\) but is: \(0.9,\)",
        ),
    ],
)
def test_add_param_group_checks_each_hyperparameter(group, error, match):
    opt = Muon(_params([(3, 4)]))
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": _params([(16, 4)]), **group})


def test_ns_dtype_by_name_is_the_dtype():
    runs = []
    for ns_dtype in (torch.float32, "float32"):
        params = _params([(6, 5)])
        opt = Muon(params, ns_dtype=ns_dtype)
        _run(opt, params)
        assert opt.ns_dtype is torch.float32
        runs.append(params[0])
    assert torch.equal(*runs)


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_zero_size_matrices_are_left_alone(adjust_lr_fn):
    # (8, 0) raised ZeroDivisionError in the "original" lr adjustment (as torch.optim.Muon
    # does); a matrix without elements has nothing to update.
    empty = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 8, 0), (8, 0), (0, 8)]]
    ours, alone = _params([(3, 4)]), _params([(3, 4)])
    _run(Muon(empty + ours, adjust_lr_fn=adjust_lr_fn), empty + ours)
    _run(Muon(alone, adjust_lr_fn=adjust_lr_fn), alone)  # the same grads: empty ones draw none
    assert torch.equal(ours[0], alone[0])


def test_group_errors():
    with pytest.raises(ValueError, match=r"2-D and 3-D .* algorithm='adamw' group, as muon_param"):
        Muon(_params([(4,)]))
    with pytest.raises(ValueError, match=r"param 1 \(shape \(5, 4\)\): row_blocks should sum to 5"):
        Muon([{"params": _params([(3, 4), (5, 4)]), "row_blocks": (1, 2)}])
    with pytest.raises(ValueError, match=r"param 1 \(shape \(4,\)\): Muon supports 2-D and 3-D"):
        Muon(_params([(3, 4), (4,)]))
    with pytest.raises(ValueError, match=r"betas\[1\] should be in"):
        Muon([{"params": _params([(3,)]), "algorithm": "adamw", "betas": (0.9, 1.0)}])
    with pytest.raises(ValueError, match="algorithm should be"):
        Muon([{"params": _params([(3, 4)]), "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="at least one iteration"):
        NewtonSchulzSchedule(())


@pytest.mark.parametrize("option", ["foreach", "fused", "capturable", "differentiable"])
@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
def test_torch_options_the_step_would_ignore_are_refused(option, algorithm):
    # an adamw group with foreach=True stepped as it always does, without a word
    group = {"params": _params([(3, 4)]), "algorithm": algorithm, option: True}
    with pytest.raises(ValueError, match=f"param group 0: {option}=True is not supported"):
        Muon([group])
    opt = Muon(_params([(3, 4)]))
    with pytest.raises(ValueError, match=f"param group 1: {option}=True is not supported"):
        opt.add_param_group({**group, "params": _params([(5, 4)])})
    Muon([{**group, option: False}])  # torch's behaviour, said aloud


def test_adamw_group_maximize_matches_torch_adamw_bitwise():
    # maximize=True was dropped: the group descended
    ours, theirs = _params([(5, 7), (11,)]), _params([(5, 7), (11,)])
    opt = Muon([{"params": ours, "algorithm": "adamw", "lr": 1e-2, "maximize": True}])
    _run(opt, ours)
    _run(torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, maximize=True), theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="param group 0: maximize=True is not supported by a Muon"):
        Muon([{"params": _params([(3, 4)]), "maximize": True}])
    with pytest.raises(TypeError, match="param group 0: maximize should be True or False"):
        Muon([{"params": _params([(3,)]), "algorithm": "adamw", "maximize": 1}])


@pytest.mark.parametrize("offloaded", [False, True])
def test_adamw_group_amsgrad_matches_torch_adamw_bitwise(offloaded):
    # amsgrad=True was refused (before that, dropped): the group stepped as plain AdamW
    ours, theirs = _params([(5, 7), (11,)]), _params([(5, 7), (11,)])
    opt = Muon([{"params": ours, "algorithm": "adamw", "lr": 1e-2, "amsgrad": True}])
    if offloaded:
        opt = CPUOffloadOptimizer(opt, chunk_bytes=64)
    _run(opt, ours, steps=4)
    plain = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, amsgrad=True)
    _run(plain, theirs, steps=4)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["max_exp_avg_sq"], plain.state[q]["max_exp_avg_sq"])
    with pytest.raises(ValueError, match="param group 0: amsgrad=True is not supported by a Muon"):
        Muon([{"params": _params([(3, 4)]), "amsgrad": True}])
    with pytest.raises(TypeError, match="param group 0: amsgrad should be True or False"):
        Muon([{"params": _params([(3,)]), "algorithm": "adamw", "amsgrad": 1}])


@pytest.mark.parametrize(
    "coefficients, error, match",
    [
        (
            (3.0, float("nan"), 1.0),
            ValueError,
            r"ns_coefficients\[1\] should be finite but is: nan",
        ),
        ((3.0, -4.0, float("inf")), ValueError, r"ns_coefficients\[2\] should be finite"),
        (("3", -4.0, 2.0), TypeError, r"ns_coefficients\[0\] should be a number but is: '3'"),
        ((3.0, True, 2.0), TypeError, r"ns_coefficients\[1\] should be a number but is: True"),
        ("abc", ValueError, r"ns_coefficients should be \(a, b, c\) .* but is: 'abc'"),
    ],
)
def test_ns_coefficients_are_finite_numbers(coefficients, error, match):
    # NaN and inf were taken (every update NaN); strings failed inside baddbmm at step()
    with pytest.raises(error, match=f"param group 0: {match}"):
        Muon(_params([(3, 4)]), ns_coefficients=coefficients)
    opt = Muon(_params([(3, 4)]))
    with pytest.raises(error, match=f"param group 1: {match}"):
        opt.add_param_group({"params": _params([(5, 4)]), "ns_coefficients": coefficients})
    opt.param_groups[0]["ns_coefficients"] = coefficients  # set by hand (or loaded)
    with pytest.raises(error, match=f"param group 0: {match}"):
        opt.step()


def test_a_param_listed_twice_is_refused():
    # torch only warns for the same group, and the step then updated the param twice
    p, q = _params([(3, 4), (5, 4)])
    with pytest.raises(ValueError, match=r"param group 0 lists a param twice \(params 1 and 2"):
        Muon([p, q, q])
    with pytest.raises(ValueError, match=r"param 0 of param group 1 .* is in param group 0"):
        Muon([{"params": [p, q]}, {"params": [q], "algorithm": "adamw"}])
    opt = Muon([p])
    with pytest.raises(ValueError, match=r"param 1 of param group 1 .* is in param group 0"):
        opt.add_param_group({"params": [q, p]})
    assert len(opt.param_groups) == 1


def test_loads_a_torch_muon_state_dict_and_continues_bitwise():
    ours, theirs = _params(SHAPES), _params(SHAPES)
    ref = torch.optim.Muon(theirs, lr=0.02)
    _run(ref, theirs, steps=2)
    for p, q in zip(ours, theirs, strict=True):
        p.data.copy_(q)
    opt = Muon(ours, lr=0.02)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a checkpoint: no shared tensors
    assert opt.param_groups[0]["algorithm"] == "muon"
    _run(opt, ours, steps=2, seed=5)
    _run(ref, theirs, steps=2, seed=5)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def _checkpoint_and_two_copies(opt, params):
    """`opt`'s state dict after two steps of `params`, and two copies of the params then:
    one to resume, one for the reference."""
    _run(opt, params, steps=2)
    checkpoint = copy.deepcopy(opt.state_dict())
    copies = _params([tuple(p.shape) for p in params]), _params([tuple(p.shape) for p in params])
    for p, q, r in zip(params, *copies, strict=True):
        q.data.copy_(p)
        r.data.copy_(p)
    return checkpoint, *copies


@pytest.mark.parametrize("offload", [False, True])
def test_a_resume_keeps_the_declared_row_blocks_and_says_where_the_checkpoint_differs(offload):
    # row_blocks describe the model: a run resumed after declaring a fused param's blocks
    # (a warning told the user to) steps as if they had been declared from the checkpoint
    # on; loading took the checkpoint's None silently.
    def build(params, row_blocks):
        groups = [{"params": params[:1], "row_blocks": row_blocks}, {"params": params[1:]}]
        opt = Muon(groups, lr=0.02, ns_dtype=torch.float32)
        return CPUOffloadOptimizer(opt, chunk_bytes=1) if offload else opt

    first = _params([(64, 16), (16, 32)])
    checkpoint, resumed, declared = _checkpoint_and_two_copies(build(first, None), first)
    opt, ref = build(resumed, (32, 32)), build(declared, (32, 32))
    with pytest.warns(UserWarning, match=r"group 0: the checkpoint's row_blocks None differs"):
        opt.load_state_dict(checkpoint)
    assert opt.param_groups[0]["row_blocks"] == (32, 32)
    without_blocks = copy.deepcopy(checkpoint)  # as a torch.optim.Muon checkpoint: no key
    for group in without_blocks["param_groups"]:
        del group["row_blocks"]
    ref.load_state_dict(without_blocks)
    _run(opt, resumed, steps=2, seed=5)
    _run(ref, declared, steps=2, seed=5)
    for p, q in zip(resumed, declared, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("offload", [False, True])
def test_a_resume_keeps_how_this_run_computes_and_says_where_the_checkpoint_differs(offload):
    # ns_algorithm and replica_owners came from the checkpoint, silently: a run resumed with
    # "standard" Newton-Schulz to compare against another ran the saved "gram" (hostile
    # review)
    def build(params, ns_algorithm, replica_owners):
        groups = [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}]
        opt = Muon(
            groups,
            lr=0.02,
            ns_dtype=torch.float32,
            ns_algorithm=ns_algorithm,
            replica_owners=replica_owners,
        )
        return CPUOffloadOptimizer(opt, chunk_bytes=1) if offload else opt

    first = _params([(64, 16), (16, 32)])
    checkpoint, resumed, fresh = _checkpoint_and_two_copies(build(first, "gram", "spread"), first)
    opt, ref = build(resumed, "standard", "per_replica"), build(fresh, "standard", "per_replica")
    with pytest.warns(UserWarning) as record:
        opt.load_state_dict(checkpoint)
    said = [str(w.message) for w in record]
    assert any(
        "checkpoint's ns_algorithm 'gram' differs from this optimizer's 'standard'" in m
        for m in said
    )
    assert any("checkpoint's replica_owners 'spread' differs" in m for m in said)
    assert not any("param group 1" in m for m in said)  # an AdamW group reads neither
    group = opt.param_groups[0]
    assert (group["ns_algorithm"], group["replica_owners"]) == ("standard", "per_replica")
    # the same as loading a checkpoint saved with this run's settings
    same = copy.deepcopy(checkpoint)
    for saved in same["param_groups"]:
        saved["ns_algorithm"], saved["replica_owners"] = "standard", "per_replica"
    ref.load_state_dict(same)
    _run(opt, resumed, steps=2, seed=5)
    _run(ref, fresh, steps=2, seed=5)
    for p, q in zip(resumed, fresh, strict=True):
        assert torch.equal(p, q)


def test_torch_muon_loads_our_state_dict_and_continues_bitwise():
    # our ns_steps=None went into the state dict, and torch's step compared it with an int
    ours, theirs = _params(SHAPES), _params(SHAPES)
    opt = Muon(ours, lr=0.02)
    _run(opt, ours, steps=2)
    for p, q in zip(ours, theirs, strict=True):
        q.data.copy_(p)
    ref = torch.optim.Muon(theirs, lr=0.02)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(opt, ours, steps=2, seed=5)
    _run(ref, theirs, steps=2, seed=5)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_a_compiled_step_is_the_eager_step_bit_for_bit():
    eager, compiled = _params(SHAPES), _params(SHAPES)
    opt, other = Muon(eager, lr=0.02), Muon(compiled, lr=0.02)
    _run(opt, eager)
    _run(type("Compiled", (), {"step": staticmethod(torch.compile(other.step))})(), compiled)
    for p, q in zip(eager, compiled, strict=True):
        assert torch.equal(p, q)


def test_a_state_dict_of_other_shapes_is_refused_before_loading_anything():
    """A checkpoint of another model: refused at the load, naming param and key (it used to
    load, and the next step failed in a broadcast)."""
    saved, other = _params([(8, 8), (8,)]), _params([(6, 6), (6,)])
    source = Muon([{"params": saved[:1]}, {"params": saved[1:], "algorithm": "adamw"}], lr=0.02)
    _run(source, saved, steps=1)
    opt = Muon([{"params": other[:1]}, {"params": other[1:], "algorithm": "adamw"}], lr=0.02)
    with pytest.raises(
        ValueError, match=r"'momentum_buffer' of param 0 has shape \(8, 8\), expected \(6, 6\)"
    ):
        opt.load_state_dict(copy.deepcopy(source.state_dict()))
    assert not opt.state


@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_is_plain_data_that_checkpoint_code_takes(offload):
    # DCP's full-state gather (transformers.Trainer saving under FSDP2) raised
    # "Unexpected value type NewtonSchulzSchedule" on a schedule in the groups.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Linear(16, 8))
        groups = muon_param_groups(model)
        opt = Muon(groups, lr=0.02, ns_coefficients=POLAR_EXPRESS if offload else DEEPSEEK_V4)
        return model, CPUOffloadOptimizer(opt) if offload else opt

    options = StateDictOptions(full_state_dict=True)
    model, opt = build()
    params = list(model.parameters())
    _run(opt, params, steps=2)
    saved = io.BytesIO()
    torch.save(get_optimizer_state_dict(model, opt, options=options), saved)
    saved.seek(0)
    fresh_model, fresh_opt = build()
    fresh_opt.param_groups[0]["ns_coefficients"] = KELLER_JORDAN  # the checkpoint's must win
    fresh_model.load_state_dict(model.state_dict())
    set_optimizer_state_dict(
        fresh_model, fresh_opt, torch.load(saved, weights_only=True), options=options
    )
    assert fresh_opt.param_groups[0]["ns_coefficients"] == opt.param_groups[0]["ns_coefficients"]
    fresh_params = list(fresh_model.parameters())
    _run(opt, params, steps=2, seed=5)
    _run(fresh_opt, fresh_params, steps=2, seed=5)
    for p, q in zip(params, fresh_params, strict=True):
        assert torch.equal(p, q)


def test_a_group_whose_algorithm_changes_is_replanned():
    params = _params([(6, 5), (4, 3)])
    opt = Muon([{"params": params[:1]}, {"params": params[1:]}], lr=0.02)
    _run(opt, params, steps=1)
    opt.param_groups[1]["algorithm"] = "adamw"  # by hand
    _run(opt, params, steps=1)
    assert set(opt.state[params[1]]) >= {"exp_avg", "exp_avg_sq"}
    # and through load_state_dict: group 0 comes back as an AdamW group
    state = opt.state_dict()
    state["param_groups"][0].update(algorithm="adamw", betas=(0.9, 0.99), eps=1e-8)
    fresh = Muon([{"params": params[:1]}, {"params": params[1:]}], lr=0.02)
    fresh.load_state_dict(state)
    _run(fresh, params, steps=1)
    assert set(fresh.state[params[0]]) >= {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("key, value", [("ns_steps", 0), ("ns_algorithm", "svd"), ("lr", -1.0)])
def test_a_bad_hyperparameter_set_later_raises(key, value):
    params = _params([(6, 5)])
    opt = Muon(params)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=key):
        _run(opt, params, steps=1)


def test_complex_params_are_refused_and_empty_ones_step_like_torch():
    with pytest.raises(ValueError, match="complex"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))])
    ours, theirs = _params([(0, 64), (5, 7)]), _params([(0, 64), (5, 7)])
    _run(Muon(ours), ours)
    _run(torch.optim.Muon(theirs), theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_plan_models_the_gram_workspace(monkeypatch):
    # issue 11: a group forced to Gram Newton-Schulz on squarish matrices (where Gram
    # holds more than the standard iteration): the plan's workspace is what the step's
    # Newton-Schulz launches allocate, earlier launches' results included
    from ns_alloc_tracker import PeakTracker

    from muon import optimizer as optimizer_module
    from muon.newton_schulz import ns_workspace_numel

    shapes = [(48, 48)] * 3 + [(40, 56), (24, 72)]
    params = _params(shapes)
    opt = Muon(params, ns_algorithm="gram", ns_dtype=torch.float32, bucket_cap_bytes=2**30)
    calls = []
    real = optimizer_module.zeropower

    def tracked(x, *args, **kwargs):
        with PeakTracker(ignore_numel=x.size(0)) as tracker:
            out = real(x, *args, **kwargs)
        calls.append((tracker.peak, out.numel()))
        return out

    monkeypatch.setattr(optimizer_module, "zeropower", tracked)
    _run(opt, params, steps=1)
    measured = done = 0
    for peak, numel in calls:
        measured, done = max(measured, done + peak), done + numel
    (metric,) = opt.metrics
    full = sum(r * c for r, c in shapes)
    planned = metric.workspace_bytes // 4 - full  # a local bucket: its full buffer, then NS
    assert planned == measured
    standard = ns_workspace_numel([(3, 48, 48), (1, 40, 56), (1, 24, 72)], per_matrix=True)
    assert planned > standard


def test_momentum_assigned_by_hand_is_taken_in_fp32_or_refused_before_anything_steps():
    # torch.optim.Muon's bf16 buffer copied in by hand failed the step at that param
    # ("expected dtype c10::BFloat16"), after the earlier params' momentum had moved.
    ours, theirs = _params(SHAPES), _params(SHAPES)
    opt, ref = Muon(ours, lr=0.02), Muon(theirs, lr=0.02)
    _run(opt, ours, steps=1)
    _run(ref, theirs, steps=1)
    last = ours[-1]
    bf16 = opt.state[last]["momentum_buffer"].bfloat16()
    opt.state[last]["momentum_buffer"] = bf16
    ref.state[theirs[-1]]["momentum_buffer"] = bf16.float()
    _run(opt, ours, steps=2, seed=7)
    _run(ref, theirs, steps=2, seed=7)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    opt.state[last]["momentum_buffer"] = None  # the reset idiom: zeros, as a fresh entry
    ref.state[theirs[-1]].pop("momentum_buffer")
    _run(opt, ours, steps=1, seed=9)
    _run(ref, theirs, steps=1, seed=9)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    opt.state[last]["momentum_buffer"] = torch.zeros(3)
    before = {p: opt.state[p]["momentum_buffer"].clone() for p in ours[:-1]}
    with pytest.raises(ValueError, match=r"param group 0: param \d+ .* momentum_buffer Tensor"):
        _run(opt, ours, steps=1)
    for p, buf in before.items():
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)


def test_a_gate_is_a_router_only_beside_experts():
    # D-FINE's and DEIMv2's `self.gate = nn.Linear(2 d, 2 d)` is a gated layer's linear map;
    # a `gate` next to `experts` (Mixtral, Qwen-MoE, OLMoE) is an MoE router, for AdamW.
    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(16, 16, bias=False)

    class Moe(torch.nn.Module):
        def __init__(self, stacked: bool) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(16, 4, bias=False)
            if stacked:
                self.experts = torch.nn.Parameter(torch.zeros(4, 8, 16))
            else:
                self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 8) for _ in range(4))

    model = torch.nn.ModuleDict({"fuse": Gated(), "mlp": Moe(False), "moe": Moe(True)})
    (muon, adamw) = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert "fuse.gate.weight" in {names[id(p)] for p in muon["params"]}
    assert {"mlp.gate.weight", "moe.gate.weight"} <= {names[id(p)] for p in adamw["params"]}
