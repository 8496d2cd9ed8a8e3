"""Each option is checked in one place (`offload.options`, `muon.options`), and every door
(constructor, OptimizerConfig, its CLI flags and TOML, the planner) refuses a bad value
the same way, naming it as that door spells it."""

from __future__ import annotations

import argparse

import pytest
import torch

from muon_offload import OptimizerConfig
from offload import CPUOffloadOptimizer


def _adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW(torch.nn.Linear(8, 4).parameters())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"chunk_bytes": "256MiB"}, TypeError, "chunk_bytes should be an int but is: '256MiB'"),
        ({"chunk_bytes": 1.5}, TypeError, "chunk_bytes should be an int but is: 1.5"),
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes should be >= 1 but is: 0"),
        ({"staging_slots": 2.5}, TypeError, "staging_slots should be an int but is: 2.5"),
        (
            {"gpu_resident_bytes": True},
            TypeError,
            "gpu_resident_bytes should be an int or 'auto' but is: True",
        ),
        (
            {"gpu_resident_bytes": "half"},
            ValueError,
            "gpu_resident_bytes should be an int >= 0 or 'auto' but is: 'half'",
        ),
        ({"gpu_budget_bytes": 0.5}, TypeError, "gpu_budget_bytes should be an int"),
        ({"gpu_budget_bytes": 2**30}, ValueError, "gpu_budget_bytes bounds what"),
        (
            {"load_in_backward": "yes"},
            TypeError,
            "load_in_backward should be True, False, None or a byte count",
        ),
        ({"load_in_backward": 2.5}, TypeError, "True, False, None or a byte count"),
        ({"load_in_backward": -1}, ValueError, "load_in_backward should be a byte count >= 1"),
        (
            {"load_in_backward": 0},
            ValueError,
            "or False to load nothing in the backward, but is: 0",
        ),
        (
            {"load_in_backward": 2**30},
            ValueError,
            "load_in_backward=1073741824 needs overlap_forward=model",
        ),
    ],
)
def test_offload_constructor_refuses_wrong_types(kwargs, error, match):
    with pytest.raises(error, match=match):
        CPUOffloadOptimizer(_adamw(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"offload_gpu_resident_bytes": "half"}, ValueError, "offload_gpu_resident_bytes"),
        ({"offload_gpu_resident_bytes": -5}, ValueError, "offload_gpu_resident_bytes"),
        ({"lr": float("inf")}, ValueError, "lr should be finite but is: inf"),
        ({"weight_decay": float("inf")}, ValueError, "weight_decay should be finite"),
        ({"eps": float("inf")}, ValueError, "eps should be finite but is: inf"),
        ({"betas": (0.9, float("nan"))}, ValueError, r"betas\[1\] should be finite"),
        (
            {"type": "muon", "muon_options": {"max_inflight": 0}},
            ValueError,
            r"muon_options\['max_inflight'\] should be >= 1 but is: 0",
        ),
        (
            {"type": "muon", "muon_options": {"ns_dtype": "float16"}},
            ValueError,
            r"muon_options\['ns_dtype'\] should be torch.bfloat16 or torch.float32",
        ),
    ],
)
def test_config_refuses_at_construction(kwargs, error, match):
    # offload_gpu_resident_bytes="half" or -5 used to fail only in setup_optimizer
    with pytest.raises(error, match=match):
        OptimizerConfig(offload="optimizer", **kwargs)


def test_inf_from_toml_is_refused_naming_the_field(tmp_path):
    pytest.importorskip("tomllib")
    path = tmp_path / "train.toml"
    path.write_text("[optimizer]\nlr = inf\n")
    with pytest.raises(ValueError, match="lr should be finite but is: inf"):
        OptimizerConfig.from_toml(str(path))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    OptimizerConfig.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--lr", "inf"], "argument --lr: lr should be finite but is: inf"),
        (["--offload-chunk-bytes", "0"], "argument --offload-chunk-bytes: .* >= 1 but is: 0"),
        (["--offload-gpu-resident-bytes", "-5"], "argument --offload-gpu-resident-bytes"),
        (["--betas", "0.9", "1.5"], r"argument --betas: betas should be in \[0, 1\) but is: 1.5"),
        (["--muon-options", "{max_inflight: 3}"], "argument --muon-options: invalid JSON object"),
        (["--muon-options", "[3]"], "argument --muon-options: should be a JSON object like"),
        (
            ["--muon-options", '{"max_inflight": 0}'],
            r"argument --muon-options: muon_options\['max_inflight'\] should be >= 1 but is: 0",
        ),
    ],
)
def test_cli_flags_are_checked_naming_the_flag(argv, match):
    with pytest.raises(argparse.ArgumentError, match=match):
        _parse(argv)


def test_ns_dtype_by_name_from_toml_and_the_cli(tmp_path):
    # TOML has no way to write torch.bfloat16, and the CLI had no --muon-options
    pytest.importorskip("tomllib")
    from muon_offload import setup_optimizer

    path = tmp_path / "train.toml"
    path.write_text('[optimizer]\ntype = "muon"\nmuon_options = {ns_dtype = "float32"}\n')
    from_toml = OptimizerConfig.from_toml(str(path))
    args = _parse(["--type", "muon", "--muon-options", '{"ns_dtype": "float32"}'])
    from_cli = OptimizerConfig.from_args(args)
    assert (
        from_toml == from_cli == OptimizerConfig(type="muon", muon_options={"ns_dtype": "float32"})
    )
    optimizer = setup_optimizer(torch.nn.Linear(8, 4), from_cli)
    assert optimizer.ns_dtype is torch.float32


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget-gib", "4"], "--budget-gib picks among --sweep-fsdp's sizes"),
        (["--chunks"], "--chunks lists the offloaded step's chunks: give --offload"),
    ],
)
def test_planner_flags_that_need_another_are_refused(flags, message, capsys):
    # --budget-gib without a sweep exited 0 and never said it was ignored
    from muon_offload.plan import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "qwen3-8b", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget-gib", "-1"], "argument --budget-gib: should be a number of GiB > 0"),
        (["--sweep-fsdp", "8,a"], "argument --sweep-fsdp: should be comma-separated sizes"),
        (["--sweep-fsdp", "8,0"], "argument --sweep-fsdp: should be comma-separated sizes"),
        # these named internal fields (offload_slots, ...) or were accepted (nan, -1)
        (["--fsdp", "0"], "argument --fsdp: should be a whole number >= 1 but is: '0'"),
        (["--offload-slots", "0"], "argument --offload-slots: should be a whole number >= 1"),
        (["--max-inflight", "two"], "argument --max-inflight: should be a whole number >= 1"),
        (["--offload-chunk-mib", "-1"], "argument --offload-chunk-mib: should be a number of"),
        (["--bucket-cap-mib", "1e-9"], "argument --bucket-cap-mib: should be at least one byte"),
        (["--offload-resident-mib", "nan"], "argument --offload-resident-mib: should be a"),
        (["--offload-backward-load-mib", "-5"], "argument --offload-backward-load-mib: should"),
        (["--time-limit-s", "nan"], "argument --time-limit-s: should be a number of seconds > 0"),
        (["--time-limit-s", "-1"], "argument --time-limit-s: should be a number of seconds > 0"),
        (["--replica-gbs", "0"], "argument --replica-gbs: should be a number of GB/s > 0"),
    ],
)
def test_planner_flags_are_checked_naming_the_flag(flags, message, capsys):
    # --budget-gib -1 exited 0 marking every row over budget; --sweep-fsdp 8,a printed
    # "invalid literal for int()" without the flag
    from muon_offload.plan import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "qwen3-8b", "--sweep-fsdp", "8,16", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_door_refuses_a_value_with_the_same_check():
    from muon import Muon
    from muon_offload.estimate import StepSettings

    def message(make) -> str:
        with pytest.raises((TypeError, ValueError, argparse.ArgumentError)) as info:
            make()
        return str(info.value)

    params = [torch.nn.Parameter(torch.zeros(3, 4))]
    momentum = [
        message(lambda: Muon(params, momentum=1.5)),
        message(lambda: Muon([{"params": params, "momentum": 1.5}])),
        message(lambda: OptimizerConfig(momentum=1.5)),
        message(lambda: _parse(["--momentum", "1.5"])),
    ]
    # a group's error names the group
    prefixes = ("argument --momentum: ", "param group 0: ")
    assert {m.removeprefix(prefixes[0]).removeprefix(prefixes[1]) for m in momentum} == {
        "momentum should be in [0, 1) but is: 1.5"
    }
    chunk = [
        message(lambda: CPUOffloadOptimizer(_adamw(), chunk_bytes=0)),
        message(lambda: OptimizerConfig(offload="optimizer", offload_chunk_bytes=0)),
        message(lambda: _parse(["--offload-chunk-bytes", "0"])),
        message(lambda: StepSettings(offload_chunk_bytes=0)),
    ]
    assert [m.removeprefix("argument --offload-chunk-bytes: ") for m in chunk] == [
        "chunk_bytes should be >= 1 but is: 0"
    ] + ["offload_chunk_bytes should be >= 1 but is: 0"] * 3


@pytest.mark.parametrize("loads, expected", [(True, None), (1, 1), (2**30, 2**30)])
def test_load_in_backward_takes_true_or_a_byte_count(loads, expected):
    """One option: True loads the ring's chunks (no byte count), an int that many bytes;
    a count of 1 is a byte, not True."""
    model = torch.nn.Linear(4, 4)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), overlap_forward=model, load_in_backward=loads
    )
    assert opt.backward_load_bytes == expected and opt._load_in_backward
    opt.close()
