"""The training demo's model, data and step: shapes, fused row blocks, and on 2 gloo
ranks, offloaded training (with and without forward overlap) == plain training bitwise."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from spawn_ranks import run_on_ranks

from bench.data import MarkovData
from bench.model import ModelConfig, Transformer
from bench.train import (
    Progress,
    StepTimes,
    Window,
    build,
    build_parser,
    compare_runs,
    default_json_path,
    parse_args,
    train_step,
    window_ends,
)
from muon_offload import OptimizerConfig

ROOT = Path(__file__).resolve().parents[1]

# Small enough for seconds on 2 cores; head dim 8, GQA, and a seq the chain can fill.
DENSE = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, seq_len=16
)
MOE = dataclasses.replace(DENSE, moe_experts=4, moe_top_k=2)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_forward_shapes_and_row_blocks(config):
    model = Transformer(config)
    tokens = torch.randint(config.vocab_size, (3, config.seq_len))
    assert model(tokens).shape == (3, config.seq_len, config.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    fused = {
        f"{name}.{param}": rows
        for name, module in model.named_modules()
        for param, rows in getattr(module, "row_blocks", {}).items()
    }
    # qkv and gate_up (or the expert stack) in every layer
    assert len(fused) == 2 * config.n_layers
    params = dict(model.named_parameters())
    for name, rows in fused.items():
        assert sum(rows) == params[name].shape[-2], name
    qkv = fused["layers.0.attention.qkv.weight"]
    assert qkv == [config.dim, config.dim // 2, config.dim // 2]  # 4 heads, 2 KV heads


def test_causal():
    """A token's logits do not depend on later tokens."""
    model = Transformer(DENSE)
    tokens = torch.randint(DENSE.vocab_size, (1, DENSE.seq_len))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % DENSE.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :-1], b[0, :-1])
    assert not torch.equal(a[0, -1], b[0, -1])


def test_markov_data_is_learnable_and_sharded():
    a0, a0_again, a1 = (MarkovData(64, 16, 4, rank=r) for r in (0, 0, 1))
    inputs, targets = a0.next_batch()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs, a0_again.next_batch()[0])  # deterministic per rank
    assert not torch.equal(inputs, a1.next_batch()[0])  # another shard on another rank
    # every transition is one of the token's few successors: the chain is learnable
    assert (a0.successors[inputs] == targets.unsqueeze(-1)).any(-1).all()
    assert (a0.successors.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct successors


STEPS = 3
ARMS = {
    "none": {"offload": "none"},
    # Tiny chunks so even this model's state is streamed through several chunks.
    "offload": {"offload": "optimizer", "offload_chunk_bytes": 4096},
    "offload+overlap": {
        "offload": "optimizer",
        "offload_chunk_bytes": 4096,
        "offload_overlap_forward": True,
    },
}


def _train(config: ModelConfig, opt: str, arm: dict, mesh, rank: int):
    """Train STEPS steps; returns (losses, local param shards, initial local shards)."""
    opt_config = OptimizerConfig(type=opt, lr=1e-2, **arm)
    model, optimizer = build(config, opt_config, mesh, torch.device("cpu"))
    initial = [p.to_local().clone() for p in model.parameters()]
    data = MarkovData(config.vocab_size, config.seq_len, 4, rank=rank)
    losses = []
    for _ in range(STEPS):
        loss, _ = train_step(model, optimizer, *data.next_batch(), sync=lambda: None)
        losses.append(loss)
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    return losses, [p.to_local().clone() for p in model.parameters()], initial


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for config_name, config in {"dense": DENSE, "moe": MOE}.items():
        for opt in ("adamw", "muon"):
            ref_losses, ref_params, initial = _train(config, opt, ARMS["none"], mesh, rank)
            tag = f"{config_name}/{opt}"
            if all(torch.equal(a, b) for a, b in zip(ref_params, initial, strict=True)):
                failures.append(f"{tag}: training left every param unchanged")
            if not ref_losses[-1] < ref_losses[0]:
                failures.append(f"{tag}: loss did not fall: {ref_losses}")
            for arm_name in ("offload", "offload+overlap"):
                losses, params, _ = _train(config, opt, ARMS[arm_name], mesh, rank)
                for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
                    if not torch.equal(a, b):
                        failures.append(f"{tag}/{arm_name}: loss of step {step} differs")
                for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
                    if not torch.equal(a, b):
                        failures.append(f"{tag}/{arm_name}: param {i} differs")
    assert not failures, failures


def test_offloaded_training_matches_plain_bitwise():
    run_on_ranks(_worker, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "0"], "argument --world: should be >= 1 but is: 0"),
        (["--steps", "0"], "argument --steps: should be >= 1 but is: 0"),
        (["--log-every", "0"], "argument --log-every: should be >= 1 but is: 0"),
        (["--offload", "none", "--overlap-forward"], "--overlap-forward needs --offload optimizer"),
        (["--offload", "none", "--compare"], "--compare runs with and without offload"),
        (["--json", "{file}/run.json"], "cannot create its folder"),
        (["--json", "{dir}"], "not a writable file path"),
        # a folder's permissions did not say: the run trained, then lost its results
        (["--json", "/proc/muon-offload-demo.json"], "not a writable file path"),
        # these failed in the spawned ranks, with a traceback each
        (["--heads", "3"], "model flags (--dim, --heads, --kv-heads, --moe-*, ...): dim 64"),
        (["--moe-experts", "2", "--moe-top-k", "3"], "moe_top_k should be in [1, 2]: 3"),
        (["--vocab", "1"], "vocab_size should be >= 8 but is: 1"),
        # ran, its lr never reaching --lr (hostile review)
        (["--warmup", "2", "--steps", "2"], "--warmup 2 should be below --steps 2 (the lr"),
    ],
)
def test_demo_flags_fail_before_training_in_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and error.startswith("python -m bench.train: error:")


def test_the_demo_leaves_no_file_behind_where_it_checks_one_can_be_written(tmp_path):
    path = tmp_path / "run.json"
    assert parse_args(["--json", str(path)]).json == path and not path.exists()
    link = tmp_path / "latest.json"  # a link to where the results go: kept, target not made
    link.symlink_to(tmp_path / "real.json")
    parse_args(["--json", str(link)])
    assert link.is_symlink() and not (tmp_path / "real.json").exists()


def test_demo_help_shows_defaults_and_results_are_named_per_run(tmp_path, monkeypatch):
    text = " ".join(build_parser().format_help().split())
    assert "training steps (default: 80)" in text and "(default: muon)" in text
    # under the working directory: an installed demo wrote into site-packages
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--optimizer", "adamw", "--overlap-forward", "--compare"])
    assert args.json.parent == tmp_path / "bench" / "results"
    now = time.strptime("2026-12-01 02:03:04", "%Y-%m-%d %H:%M:%S")
    path = default_json_path(args, now)
    assert path.name == "train-adamw-optimizer-overlap-compare-20261201-020304.json"


def test_steps_are_timed_as_windows():
    assert window_ends(80, 10) == [2, 10, 20, 30, 40, 50, 60, 70, 80]
    assert window_ends(1, 10) == [1]  # one step, no interval: still one window
    assert window_ends(3, 1) == [1, 2, 3]


def test_demo_line_is_the_window_mean(capsys):
    window = Window(3, 10, seconds=0.8, phases=StepTimes(0.16, 0.24, 0.4), mean_loss=2.5)
    progress = Progress(80)
    progress.tty = False
    progress.window(window)
    line = capsys.readouterr().out
    assert (
        "mean of steps 3-10: loss  2.500  step   100.0 ms (fwd   20.0  bwd   30.0  opt   50.0)"
        in line
    )


def test_compare_names_every_difference_bitwise():
    losses, params = [torch.tensor(1.0), torch.tensor(2.0)], [torch.ones(3), torch.zeros(2)]
    same = ([x.clone() for x in losses], [x.clone() for x in params])
    assert compare_runs((losses, params), same) == []
    nudged = torch.ones(3)
    nudged[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    other = ([losses[0], torch.tensor(2.5)], [nudged, params[1]])
    assert compare_runs((losses, params), other) == ["loss of step 2", "param 0"]


def test_sigint_to_the_launcher_stops_its_ranks(tmp_path):
    tiny = "--dim 16 --layers 1 --heads 2 --kv-heads 1 --ffn 16 --vocab 16 --seq 8 --batch 1"
    argv = [sys.executable, "-m", "bench.train", *tiny.split(), "--eval-batches", "1"]
    argv += ["--steps", "100000", "--log-every", "100000", "--json", str(tmp_path / "r.json")]
    log = tmp_path / "log"
    with open(log, "w") as out:
        # SIGINT at its default, as from a terminal: a shell without job control starts
        # background commands (e.g. a CI script run with `&`) with SIGINT ignored, and
        # Python then leaves it ignored
        launcher = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while "offload=optimizer" not in log.read_text():  # rank 0 is about to train
            assert launcher.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        ranks = [
            p
            for p in psutil.Process(launcher.pid).children()
            if "spawn_main" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 2
        os.kill(launcher.pid, signal.SIGINT)  # the launcher alone, not its process group
        assert launcher.wait(timeout=60) == 130
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks still running after the launcher exited: {alive}"
        assert "interrupted: stopped 2 ranks" in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for process in ranks:
            if process.is_running():
                process.kill()


def test_the_default_warmup_fits_a_short_run():
    # five steps of warmup by default: a run of two never reached --lr (hostile review)
    assert parse_args([]).warmup == 5
    assert parse_args(["--steps", "2"]).warmup == 1
    assert parse_args(["--steps", "1"]).warmup == 0
