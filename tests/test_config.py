"""OptimizerConfig validation and setup_optimizer's groups and wrapping."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from muon import SCHEDULES, Muon
from muon_offload import OptimizerConfig, model_row_blocks, setup_optimizer
from offload import CPUOffloadOptimizer


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 16 + 8 + 8, bias=False)
        self.row_blocks = {"qkv.weight": (16, 8, 8)}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 16)
        self.attn = torch.nn.ModuleList([Attention(), Attention()])
        self.mlp = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.experts = torch.nn.Parameter(torch.zeros(3, 8, 16))
        self.lm_head = torch.nn.Linear(16, 10, bias=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type": "sgd"}, "type should be one of"),
        ({"offload": "everything"}, "offload should be one of"),
        ({"offload_overlap_forward": True}, "needs offload='optimizer'"),
        (
            {"offload": "optimizer", "offload_load_in_backward": True},
            "needs offload_overlap_forward=True",
        ),
        (
            {"offload": "optimizer", "offload_load_in_backward": 2**30},
            "offload_load_in_backward=1073741824 needs offload_overlap_forward=True",
        ),
        (
            {
                "offload": "optimizer",
                "offload_overlap_forward": True,
                "offload_load_in_backward": 0,
            },
            "offload_load_in_backward should be a byte count >= 1, or False to load nothing",
        ),
        ({"offload_load_in_backward": 1.5}, "should be of type bool | int | None"),
        ({"ns_schedule": "newton"}, "ns_schedule should be one of"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn should be one of"),
        # the choices named are those the field takes (it listed Muon's None, then refused it)
        ({"adjust_lr_fn": "none"}, r"one of \['original', 'match_rms_adamw'\] but is: 'none'"),
        ({"lr": -1.0}, "lr should be >= 0"),
        ({"offload": "optimizer", "offload_chunk_bytes": 0}, "offload_chunk_bytes"),
        ({"offload": "optimizer", "offload_staging_slots": 0}, "offload_staging_slots"),
        ({"muon_options": {"max_inflight": 2}}, "muon_options=.* set type='muon'"),
        # fields the chosen type or offload mode would leave unused
        ({"momentum": 0.9}, r"momentum=0.9 is set but type is 'adamw'.*only with type='muon'"),
        ({"nesterov": False}, "nesterov=False is set but type is 'adamw'"),
        ({"ns_schedule": "polar_express"}, "ns_schedule='polar_express' is set but type"),
        ({"adjust_lr_fn": "original"}, "adjust_lr_fn='original' is set but type is 'adamw'"),
        ({"offload_chunk_bytes": 2**20}, r"offload_chunk_bytes=1048576 is set but offload is"),
        ({"offload_staging_slots": 2}, "offload_staging_slots=2 is set but offload is 'none'"),
        ({"offload_gpu_resident_bytes": "auto"}, "offload_gpu_resident_bytes='auto' is set"),
        ({"offload_gpu_budget_bytes": 2**30}, "offload_gpu_budget_bytes=1073741824 is set"),
        ({"offload_load_in_backward": False}, "offload_load_in_backward=False is set but"),
        ({"type": "muon", "fused": False}, "fused=False is set but type is 'muon'"),
        ({"nesterov": "no"}, r"nesterov should be of type bool but is: 'no'"),
        ({"lr": "abc"}, r"lr should be of type float but is: 'abc'"),
        ({"betas": (0.9,)}, r"betas should be of type tuple\[float, float\].*like \(0.9, 0.95\)"),
        ({"betas": (0.9, 1.5)}, r"betas\[1\] should be in \[0, 1\)"),
        ({"offload_chunk_bytes": 1.5}, "offload_chunk_bytes should be of type int but is: 1.5"),
        ({"offload_overlap_forward": 1}, "offload_overlap_forward should be of type bool"),
        ({"momentum": 1.0}, r"momentum should be in \[0, 1\)"),
        ({"type": "muon", "muon_options": {"lr": 0.1}}, "muon.Muon does not take"),
        ({"type": "muon", "muon_options": {"bucket_cap_bytes": "1M"}}, "bucket_cap_bytes"),
    ],
)
def test_contradictory_configs_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_setup_optimizer_names_its_arguments_when_given_something_else():
    model = Net()
    with pytest.raises(TypeError, match=r"takes the model .* got: list, OptimizerConfig"):
        setup_optimizer(list(model.parameters()), OptimizerConfig())
    with pytest.raises(TypeError, match=r"got: Net, dict"):
        setup_optimizer(model, {"type": "muon"})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("type", "AdamW", "type should be one of"),
        ("offload", "cpu", "offload should be one of"),
        ("momentum", 0.5, "momentum"),
        ("lr", "1e-3", "lr should be"),
    ],
)
def test_fields_set_after_construction_are_checked_by_setup_optimizer(field, value, message):
    # setup_optimizer trusted the fields: type "AdamW" built Muon, offload "cpu" offloaded
    config = OptimizerConfig()
    setattr(config, field, value)
    with pytest.raises((TypeError, ValueError), match=message):
        setup_optimizer(torch.nn.Linear(4, 4), config)


@pytest.mark.parametrize("type_", ["adamw", "muon"])
def test_a_model_on_the_meta_device_is_refused(type_):
    # to_empty() after setup_optimizer left the optimizer stepping the meta params: the
    # model's weights never changed
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"param '0.weight' is on the meta device.*to_empty"):
        setup_optimizer(model, OptimizerConfig(type=type_))


def test_muon_setup_groups_every_param_once():
    model = Net()
    opt = setup_optimizer(model, OptimizerConfig(type="muon", lr=0.02))
    assert isinstance(opt, Muon)
    by_param = {}
    for group in opt.param_groups:
        for p in group["params"]:
            assert p not in by_param
            by_param[p] = group
    assert set(by_param) == set(model.parameters())
    for p in (model.embed.weight, model.norm.weight, model.lm_head.weight, model.mlp.bias):
        assert by_param[p]["algorithm"] == "adamw"
    for p in (model.mlp.weight, model.experts):
        assert by_param[p]["algorithm"] == "muon" and by_param[p]["row_blocks"] is None
    for attn in model.attn:
        assert by_param[attn.qkv.weight]["row_blocks"] == (16, 8, 8)
    assert all(g["lr"] == 0.02 for g in opt.param_groups)


def test_row_blocks_of_frozen_params_are_left_out_as_the_params_are():
    # fine-tuning the head alone: the pattern built for the frozen fused params matched
    # no Muon param, and setup_optimizer refused a valid setup with a pattern nobody wrote
    net = Net()
    for attention in net.attn:
        attention.qkv.weight.requires_grad_(False)
    assert model_row_blocks(net) == {}
    optimizer = setup_optimizer(net, OptimizerConfig(type="muon"))
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not any(id(a.qkv.weight) in stepped for a in net.attn)


@pytest.mark.parametrize(
    "config",
    [
        OptimizerConfig(type="adamw"),
        OptimizerConfig(type="muon"),
        OptimizerConfig(type="muon", offload="optimizer", offload_overlap_forward=True),
    ],
    ids=["adamw", "muon", "muon-offload-overlap"],
)
def test_a_param_unfrozen_after_setup_optimizer_is_warned_about_once(config):
    # gradual unfreezing: the param frozen at setup_optimizer got grads and never trained,
    # silently (it is in no group, as transformers' Trainer leaves frozen params out)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    frozen = net[2].weight
    frozen.requires_grad_(False)
    optimizer = setup_optimizer(net, config)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # wraps step(): as usual
    tokens = torch.randn(2, 5, 16)

    def step() -> None:
        net(tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    before = frozen.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()  # frozen, no grad: nothing to say
        assert not caught
        frozen.requires_grad_(True)
        step()
        step()
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "1 param(s) of the model have grads and are in no" in said[0]
    assert "(first: '2.weight')" in said[0] and "call it again after unfreezing" in said[0]
    assert caught[0].filename == __file__  # pointed at the caller's step()
    assert torch.equal(frozen, before)  # as said: it does not train
    if isinstance(optimizer, CPUOffloadOptimizer):
        optimizer.close()


def test_a_param_frozen_later_with_its_grad_kept_is_not_warned_about():
    # progressive freezing with grads zeroed in place: the frozen layer kept a zero grad,
    # and the optimizer built anew warned it was "unfrozen" (found by review)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    first = setup_optimizer(net, OptimizerConfig(type="adamw"))
    net(torch.randn(2, 16)).square().mean().backward()
    first.step()
    first.zero_grad(set_to_none=False)
    net[0].weight.requires_grad_(False)
    optimizer = setup_optimizer(net, OptimizerConfig(type="adamw"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(torch.randn(2, 16)).square().mean().backward()
        optimizer.step()
    assert net[0].weight.grad is not None  # the stale zeros are still there


def test_row_blocks_naming_no_param_of_the_module_are_refused_naming_it():
    net = Net()
    net.attn[1].row_blocks = {"qkv.weights": (16, 8, 8)}
    expected = (
        r"module 'attn.1' \(Attention\) declares row_blocks for 'qkv.weights', "
        r"which is none of its params \(\['qkv.weight'\]\)"
    )
    with pytest.raises(ValueError, match=expected):
        model_row_blocks(net)


def test_row_blocks_may_name_a_param_by_an_alias_of_its_module():
    # named by the alias, the pattern matched no name muon_param_groups gives the param
    # (it takes the first): the blocks were dropped, or refused as a pattern never written
    net = Net()
    net.attn[0].fused = net.attn[0].qkv  # one module under two names
    net.attn[0].row_blocks = {"fused.weight": (16, 8, 8)}
    assert list(model_row_blocks(net).values()) == [(16, 8, 8)]
    opt = setup_optimizer(net, OptimizerConfig(type="muon"))
    (group,) = [
        g for g in opt.param_groups if any(p is net.attn[0].qkv.weight for p in g["params"])
    ]
    assert group["row_blocks"] == (16, 8, 8)

    class Shared(nn.Module):  # the second parent of a shared module declares the blocks
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Module(), nn.Module()
            self.a.proj = self.b.qkv = nn.Linear(16, 32, bias=False)
            self.b.row_blocks = {"qkv.weight": (16, 8, 8)}

    shared = Shared()
    (group,) = setup_optimizer(shared, OptimizerConfig(type="muon")).param_groups
    assert group["row_blocks"] == (16, 8, 8)
    shared.a.row_blocks = {"proj.weight": (8, 24)}  # two layouts of one param: refused
    with pytest.raises(ValueError, match=r"\(8, 24\) as a.proj.weight and \(16, 8, 8\) as b.qkv"):
        model_row_blocks(shared)


def test_row_blocks_collected_from_modules():
    patterns = model_row_blocks(Net())
    assert list(patterns.values()) == [(16, 8, 8)]
    (pattern,) = patterns
    import re

    assert re.search(pattern, "attn.1.qkv.weight") and not re.search(pattern, "attn.1.qkv.bias")


def test_offload_wraps_and_overlap_registers_hooks():
    model = Net()
    config = OptimizerConfig(
        offload="optimizer",
        offload_chunk_bytes=4096,
        offload_gpu_resident_bytes="auto",
        offload_gpu_budget_bytes=2**20,
    )
    opt = setup_optimizer(model, config)
    assert isinstance(opt, CPUOffloadOptimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    assert opt.chunk_bytes == 4096 and opt._overlap is None and opt.gpu_resident_bytes == "auto"
    assert opt.gpu_budget_bytes == 2**20
    overlapped = setup_optimizer(
        model,
        OptimizerConfig(
            type="muon",
            offload="optimizer",
            offload_overlap_forward=True,
            offload_load_in_backward=2**30,
        ),
    )
    assert isinstance(overlapped.optimizer, Muon) and overlapped._overlap is not None
    assert overlapped._overlap.backward_reached is not None
    assert overlapped.backward_load_bytes == 2**30


def test_config_from_cli_flags_and_toml(tmp_path):
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    args = parser.parse_args(
        [
            "--type",
            "muon",
            "--lr",
            "0.01",
            "--offload",
            "optimizer",
            "--offload-overlap-forward",
            "--betas",
            "0.8",
            "0.9",
        ]
    )
    config = OptimizerConfig.from_args(args)
    assert config == OptimizerConfig(
        type="muon", lr=0.01, offload="optimizer", offload_overlap_forward=True, betas=(0.8, 0.9)
    )
    path = tmp_path / "train.toml"
    path.write_text('[optimizer]\ntype = "muon"\nlr = 0.01\nbetas = [0.8, 0.9]\n')
    assert OptimizerConfig.from_toml(str(path)) == OptimizerConfig(
        type="muon", lr=0.01, betas=(0.8, 0.9)
    )
    path.write_text("[optimizer]\nlearning_rate = 0.01\n")  # another trainer's name
    with pytest.raises(ValueError, match=r"'learning_rate' \(did you mean 'lr'\?\)"):
        OptimizerConfig.from_toml(str(path))
    path.write_text("[optimizer]\nlr = -1.0\n")  # a bad value names where it was set
    with pytest.raises(ValueError, match=r"^\[optimizer\] of .*train.toml: lr should be"):
        OptimizerConfig.from_toml(str(path))
    path.write_text("[optimizer]\nmomentun = 0.9\n")  # a typo gets the field it meant
    with pytest.raises(ValueError, match=r"'momentun' \(did you mean 'momentum'\?\)"):
        OptimizerConfig.from_toml(str(path))
    # a trainer's own layout: the table nested in its own (it was told to put the fields
    # under the very table they were under)
    path.write_text('[train]\nsteps = 10\n[train.optimizer]\ntype = "muon"\n')
    assert OptimizerConfig.from_toml(str(path), table="train.optimizer").type == "muon"
    path.write_text('["train.optimizer"]\ntype = "muon"\n')  # a quoted key with a dot
    assert OptimizerConfig.from_toml(str(path), table="train.optimizer").type == "muon"
    path.write_text('[train.optim]\ntype = "muon"\n[[runs]]\nseed = 1\n')
    with pytest.raises(ValueError, match=r"found tables \['\[runs\]', 'train', 'train.optim'\]"):
        OptimizerConfig.from_toml(str(path), table="train.optimizer")


def _fake_world(size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def test_offloaded_muon_buckets_fit_a_chunk_when_they_exchange():
    from torch.distributed.fsdp import fully_shard

    _fake_world(2)  # shapes only: no collective runs
    try:
        model = Net()
        fully_shard(model)
        config = OptimizerConfig(type="muon", offload="optimizer", offload_chunk_bytes=4096)
        # fp32 momentum shard of a bucket: 2 x 4096 bf16 bytes over 2 shards, one chunk
        assert setup_optimizer(model, config).optimizer.bucket_cap_bytes == 4096
        explicit = OptimizerConfig(
            type="muon", offload="optimizer", muon_options={"bucket_cap_bytes": 10**6}
        )
        assert setup_optimizer(model, explicit).optimizer.bucket_cap_bytes == 10**6
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_offloaded_muon_bucket_cap_counts_the_meshs_shards_whatever_a_small_param(world):
    # numel / local numel read a 3-element param on 2 ranks (shards of 2 and 1) as 3
    # shards: the cap, and the ring, grew past the chunk and the planner's
    from torch.distributed.fsdp import fully_shard

    from muon_offload.config import offload_bucket_cap

    _fake_world(world)  # shapes only: no collective runs
    try:
        model = Net()
        model.scale = torch.nn.Parameter(torch.ones(world + 1))
        fully_shard(model)
        config = OptimizerConfig(type="muon", offload="optimizer", offload_chunk_bytes=4096)
        cap = setup_optimizer(model, config).optimizer.bucket_cap_bytes
        assert cap == offload_bucket_cap(4096, world)
    finally:
        torch.distributed.destroy_process_group()


def test_offloaded_muon_on_one_rank_keeps_the_default_bucket_cap():
    # Nothing exchanges, so no bucket is a unit the ring must hold: a cap from the chunk
    # size only split the Newton-Schulz launches of the chunks loaded in the backward
    # (4x the launches of plain Muon at the bench's batch 16)
    config = OptimizerConfig(type="muon", offload="optimizer", offload_chunk_bytes=4096)
    plain = setup_optimizer(Net(), OptimizerConfig(type="muon"))
    assert setup_optimizer(Net(), config).optimizer.bucket_cap_bytes == plain.bucket_cap_bytes


def test_offloaded_muon_with_one_byte_chunks_steps_as_plain_muon_with_one_byte_buckets():
    config = OptimizerConfig(type="muon", offload="optimizer", offload_chunk_bytes=1)
    plain_config = OptimizerConfig(type="muon", muon_options={"bucket_cap_bytes": 1})
    torch.manual_seed(0)
    model = Net()
    plain_model = Net()
    plain_model.load_state_dict(model.state_dict())
    opt, plain = setup_optimizer(model, config), setup_optimizer(plain_model, plain_config)
    for step in range(2):
        for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        opt.step()
        plain.step()
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_valid_muon_options_and_int_lr_are_accepted():
    config = OptimizerConfig(
        type="muon", lr=1, muon_options={"ns_dtype": torch.float32, "ns_steps": None}
    )
    assert config.lr == 1 and config.muon_options["ns_dtype"] is torch.float32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[optimiser]\ntype = "muon"\n',
            r"no \[optimizer\] table \(found tables \['optimiser'\]\)",
        ),
        ('type = "muon"\n', r"no \[optimizer\] table \(found tables \[\]\)"),
        ("[optimizer]\nnesterov = 'no'\n", "nesterov should be of type bool"),
        # a TypeError that named nothing; a string split into characters
        ("[optimizer]\nbetas = 0.9\n", r"betas in \[optimizer\] .* should be an array"),
        ('[optimizer]\nbetas = "0.9, 0.95"\n', r"betas = \[0.9, 0.95\], but is: '0.9, 0.95'"),
        # the way out in TOML's syntax, not Python's (it said "set type='muon'")
        ("[optimizer]\nmomentum = 0.9\n", r'momentum = 0.9 is set .* set type = "muon" or'),
        (
            "[optimizer]\noffload_overlap_forward = true\n",
            r'offload_overlap_forward = true needs offload = "optimizer"',
        ),
        # tomllib's bare TOMLDecodeError named no file (hostile review)
        ("[optimizer\nlr = 1\n", r"train\.toml is not valid TOML: Expected ']'"),
        # values shown as Python writes them: True, (0.9, 0.95), None (hostile review)
        ('[optimizer]\nnesterov = "false"\n', r"set it like true$"),
        ("[optimizer]\nbetas = [0.9, 0.95, 0.99]\n", r"set it like \[0.9, 0.95\]$"),
        ('[optimizer]\ntype = "muon"\nfused = false\n', r"or leave fused out$"),
        # the table it said was missing was listed: an array of tables
        ("[[optimizer]]\nlr = 0.1\n", r"not an array of tables \[\[optimizer\]\]\)$"),
        ("[optimizer]\nnesterov = false\n", r"leave nesterov at its default \(true\)$"),
        ("[optimizer]\nbetas = [0.9]\n", r"but is: \[0.9\]; set it like"),
    ],
)
def test_toml_with_a_wrong_table_or_value_fails_naming_it(tmp_path, text, message):
    path = tmp_path / "train.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        OptimizerConfig.from_toml(str(path))


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("1048576", 1048576)])
def test_resident_bytes_flag_takes_auto_or_bytes(value, expected):
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    args = parser.parse_args(["--offload", "optimizer", "--offload-gpu-resident-bytes", value])
    assert OptimizerConfig.from_args(args).offload_gpu_resident_bytes == expected


def test_resident_bytes_flag_says_what_it_takes(capsys):
    # "invalid _bytes_or_auto value: '1GiB'" named a private function
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--offload-gpu-resident-bytes", "1GiB"])
    error = capsys.readouterr().err
    assert "argument --offload-gpu-resident-bytes: should be 'auto' or a whole number" in error


@pytest.mark.parametrize(
    "flag", ["--offload-chunk-bytes", "--offload-gpu-budget-bytes", "--offload-load-in-backward"]
)
def test_byte_count_flags_say_what_they_take(capsys, flag):
    # argparse's "invalid int value: '256MiB'" (hostile review)
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "256MiB"])
    error = capsys.readouterr().err
    assert f"argument {flag}: should be a whole number of bytes (e.g. 268435456 for 256" in error


@pytest.mark.parametrize(
    "flags, budget, loads",
    [
        ([], None, None),
        (["--offload-gpu-budget-bytes", "4096"], 4096, None),
        (["--no-offload-load-in-backward"], None, False),
        (["--offload-load-in-backward"], None, True),
        (["--offload-load-in-backward", "4096"], None, 4096),
    ],
)
def test_auto_budget_and_backward_load_flags(flags, budget, loads):
    """ "auto" chooses backward loads unless the flag says otherwise (the default is None)."""
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    base = ["--offload", "optimizer", "--offload-overlap-forward"]
    args = parser.parse_args([*base, "--offload-gpu-resident-bytes", "auto", *flags])
    config = OptimizerConfig.from_args(args)
    assert (config.offload_gpu_budget_bytes, config.offload_load_in_backward) == (budget, loads)
    with pytest.raises(ValueError, match="offload_gpu_budget_bytes bounds what"):
        OptimizerConfig(offload="optimizer", offload_gpu_budget_bytes=4096)


def _adamw_fused(opt: torch.optim.Optimizer) -> bool | None:
    inner = opt.optimizer if isinstance(opt, CPUOffloadOptimizer) else opt
    return inner.defaults["fused"]


def test_adamw_fused_is_chosen_by_the_config_and_its_flags():
    model = Net()
    assert _adamw_fused(setup_optimizer(model, OptimizerConfig())) is None  # CPU: torch's choice
    assert _adamw_fused(setup_optimizer(model, OptimizerConfig(fused=True))) is True
    offloaded = setup_optimizer(model, OptimizerConfig(fused=False, offload="optimizer"))
    assert _adamw_fused(offloaded) is False
    with pytest.raises(ValueError, match="fused=True is set but type is 'muon'"):
        OptimizerConfig(type="muon", fused=True)
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    assert OptimizerConfig.from_args(parser.parse_args([])).fused is None
    assert OptimizerConfig.from_args(parser.parse_args(["--fused"])).fused is True
    assert OptimizerConfig.from_args(parser.parse_args(["--no-fused"])).fused is False


def test_from_args_on_a_parser_without_the_flags_says_to_add_them():
    # an AttributeError ("'Namespace' object has no attribute 'type'") from inside
    with pytest.raises(ValueError, match=r"lacks the optimizer's flags \['type', .*add_arguments"):
        OptimizerConfig.from_args(argparse.Namespace(lr=1e-3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adamw_on_cuda_is_fused_by_default():
    model = Net().cuda()
    assert _adamw_fused(setup_optimizer(model, OptimizerConfig())) is True
    offloaded = setup_optimizer(model, OptimizerConfig(offload="optimizer"))
    assert _adamw_fused(offloaded) is True
    offloaded.close()
    assert _adamw_fused(setup_optimizer(model, OptimizerConfig(fused=False))) is False


def test_every_flag_has_its_fields_docstring_as_help():
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    helps = {
        action.dest: action.help for action in parser._actions if action.dest != "help"
    }  # --no-offload-load-in-backward shares its dest with the flag
    assert set(helps) == {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert all(helps.values()), [name for name, text in helps.items() if not text]
    assert helps["momentum"] == "Muon momentum. (default: %(default)r)"
    text = parser.format_help()  # a docstring's % must not break argparse's formatting
    assert "optimizer (muon_offload.OptimizerConfig)" in text and "--offload-chunk-bytes" in text
    # defaults and choices show (they did not): a docstring that explains its default
    # keeps its own words
    flat = " ".join(text.split())
    assert "Muon momentum. (default: 0.95)" in flat
    assert "--type {adamw,muon}" in flat and "--offload {none,optimizer}" in flat
    assert "--ns-schedule {" + ",".join(SCHEDULES) + "}" in flat
    assert "(default: None)" not in flat


def test_flags_that_do_not_combine_are_named_as_flags():
    # the error said "set type='muon'" to someone who typed flags
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    with pytest.raises(
        ValueError, match=r"--momentum 0.9 is set .* set --type 'muon' or leave --momentum at"
    ):
        OptimizerConfig.from_args(parser.parse_args(["--momentum", "0.9"]))
    with pytest.raises(
        ValueError, match=r"^--no-nesterov is set .* set --type 'muon' or drop --no-nesterov$"
    ):
        OptimizerConfig.from_args(parser.parse_args(["--no-nesterov"]))  # not "--nesterov False"
    # a default of None: what was typed is dropped, `--no-fused` too
    with pytest.raises(ValueError, match=r"^--no-fused is set .* or drop --no-fused$"):
        OptimizerConfig.from_args(parser.parse_args(["--type", "muon", "--no-fused"]))
    flags = ["--offload-gpu-budget-bytes", "100", "--offload", "optimizer"]
    unset = r"\(no --offload-overlap-forward\): leave --offload-gpu-budget-bytes unset"
    with pytest.raises(ValueError, match=unset):
        OptimizerConfig.from_args(parser.parse_args(flags))
    # with overlap and nothing resident it bounds the default's backward loads
    overlapped = OptimizerConfig.from_args(parser.parse_args([*flags, "--offload-overlap-forward"]))
    assert overlapped.offload_gpu_budget_bytes == 100


def test_configs_parsed_by_one_parser_do_not_share_muon_options():
    # argparse hands every parse its one default dict: an edit of one config's
    # muon_options showed up in every later parse (found by a hostile audit)
    parser = argparse.ArgumentParser()
    OptimizerConfig.add_arguments(parser)
    first = OptimizerConfig.from_args(parser.parse_args(["--type", "muon"]))
    first.muon_options["max_inflight"] = 1
    assert OptimizerConfig.from_args(parser.parse_args(["--type", "muon"])).muon_options == {}


def test_a_model_with_nothing_to_train_is_refused_saying_why():
    # torch's "optimizer got an empty parameter list" did not say why (found by an audit)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    for model, why in ((frozen, "all 2 are frozen"), (torch.nn.ReLU(), "it has none")):
        for kind in ("adamw", "muon"):
            with pytest.raises(ValueError, match=f"no trainable params to optimize \\({why}"):
                setup_optimizer(model, OptimizerConfig(type=kind))


def test_numpy_numbers_are_taken_as_the_python_numbers_they_hold():
    # a sweep's np.float32 lr was refused ("should be of type float"), where Muon and the
    # wrapper take it (hostile review); kept as Python's, which TOML and JSON write; in
    # muon_options too, and NumPy's float64 and bool (a review of the first cut)
    np = pytest.importorskip("numpy")
    config = OptimizerConfig(
        lr=np.float32(0.5),
        betas=(np.float32(0.5), np.float64(0.95)),
        offload="optimizer",
        offload_chunk_bytes=np.int64(2**20),
        fused=np.bool_(True),
    )
    assert type(config.lr) is float and config.lr == 0.5
    assert [type(b) for b in config.betas] == [float, float]
    assert type(config.offload_chunk_bytes) is int and config.fused is True
    muon = OptimizerConfig(
        type="muon", nesterov=np.bool_(False), muon_options={"bucket_cap_bytes": np.int64(2**20)}
    )
    assert muon.nesterov is False and type(muon.muon_options["bucket_cap_bytes"]) is int
