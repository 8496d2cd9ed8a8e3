"""A few steps of torchtitan's llama3 debug model with our optimizer, then its params to a file.

torchtitan's trainer needs CUDA (0.3.0 picks "cuda" when no accelerator is found)
and its debug job reads `tests/assets/tokenizer` and `tests/assets/c4_test` from a
torchtitan source checkout (v0.3.0; neither the wheel nor the sdist ships them),
relative to the working directory. So, on one GPU, from that checkout:

    cd torchtitan   # git checkout v0.3.0
    export PYTHONPATH=/path/to/muon-offload
    torchrun --nproc-per-node 1 -m bench.torchtitan_debug --offload none --out /tmp/tt_none.pt
    torchrun --nproc-per-node 1 -m bench.torchtitan_debug --offload optimizer --overlap \\
        --out /tmp/tt_overlap.pt
    python -m bench.torchtitan_debug --compare /tmp/tt_none.pt /tmp/tt_overlap.pt

`--optimizer muon` for Muon. The job is torchtitan's `llama3_debugmodel` with
`--steps` steps, seed 0, deterministic mode (`debug.deterministic`), no
validation, no checkpoints, and CUDA graphs off (forward overlap enqueues chunk
work from forward hooks, which a captured graph would freeze), with
`MuonOffloadOptimizers.Config` as its optimizer. `--compare` says whether the
two runs' params are bit for bit equal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch


def job_config(args: argparse.Namespace):
    """torchtitan's llama3 debug job with our optimizer and a deterministic, short run."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from muon_offload import OptimizerConfig
    from muon_offload.torchtitan import MuonOffloadOptimizers

    config = llama3_debugmodel()
    config.training.steps = args.steps
    config.training.disable_cuda_graphs = True
    config.debug.seed = 0
    config.debug.deterministic = True
    config.validator.enable = False
    config.checkpoint.enable = False
    config.optimizer = MuonOffloadOptimizers.Config(
        optimizer=OptimizerConfig(
            type=args.optimizer,
            lr=8e-4,
            offload=args.offload,
            offload_overlap_forward=args.overlap,
        )
    )
    return config


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    trainer = job_config(args).build()
    try:
        trainer.train()
        trainer.optimizers.wait_for_optimizer_step()
        params = {
            name: getattr(p, "full_tensor", lambda p=p: p)().detach().cpu()
            for part in trainer.model_parts
            for name, p in part.named_parameters()
        }
        if dist.get_rank() == 0:
            torch.save({"params": params, "args": vars(args)}, args.out)
            print(f"wrote {args.out}: {len(params)} params after {args.steps} steps")
    finally:
        trainer.optimizers.close()
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def compare(a_path: str, b_path: str) -> None:
    a, b = (torch.load(p, weights_only=False) for p in (a_path, b_path))
    differ = [n for n, t in a["params"].items() if not torch.equal(t, b["params"][n])]
    print(f"{a['args']} vs {b['args']}")
    if differ:
        raise SystemExit(f"{len(differ)} of {len(a['params'])} params differ, first: {differ[:3]}")
    print(f"all {len(a['params'])} params bit for bit equal")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--offload", choices=("none", "optimizer"), default="none")
    parser.add_argument("--overlap", action="store_true", help="forward overlap (with offload)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="/tmp/torchtitan_debug.pt")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
    else:
        train(args)


if __name__ == "__main__":
    main()
