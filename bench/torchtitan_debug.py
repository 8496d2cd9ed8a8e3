"""A few steps of torchtitan's llama3 debug model with our optimizer; losses and params to a file.

On one GPU, from the repository root, with torchtitan 0.3.0 importable (the
GPU image lacks it: `.whl/tt/` holds it and the wheels its trainer imports,
see README "With torchtitan"):

    torchrun --nproc-per-node 1 -m bench.torchtitan_debug --offload none --out /tmp/none.pt
    torchrun --nproc-per-node 1 -m bench.torchtitan_debug --offload optimizer --overlap \\
        --out /tmp/overlap.pt
    python -m bench.torchtitan_debug --compare /tmp/none.pt /tmp/overlap.pt

`--optimizer muon` for Muon. Each step's loss is printed as it is logged;
`--compare` prints both runs' losses and says whether losses and params are bit
for bit equal (exit status 1 if not).

What is torchtitan's: the `Trainer` (distributed init, deterministic mode and
seeding, meta-device model build, `parallelize_llama` with FSDP2 and selective
activation checkpointing, flex attention, chunked cross-entropy, grad clipping,
the LR scheduler, the train loop and its metrics), the `llama3_debugmodel` job
config, its `HuggingFaceTokenizer` and `ParallelAwareDataloader`. What is ours:
the optimizer (`MuonOffloadOptimizers.Config` in the job's `optimizer` field),
the tokenizer files and the dataloader (`bench.torchtitan_synthetic`: a
word-level tokenizer written to a temporary folder, seeded synthetic documents),
which replace the `tests/assets` of a torchtitan source checkout that the job
reads otherwise, and what fills the gaps between torchtitan 0.3.0 and the GPU
image (`fill_torchtitan_gaps`: two placeholders so its modules import, and
`torch.distributed.set_timeout` for its train loop). The job: `--steps` steps,
seed 0, `debug.deterministic`, no validation, no checkpoints, and CUDA graphs
off (forward overlap enqueues chunk work from forward hooks, which a captured
graph would freeze).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
import types
from collections.abc import Sequence
from datetime import timedelta

import torch

# Why the placeholders exist, in every error a placeholder raises.
PLACEHOLDER_WHY = (
    "bench.torchtitan_debug put it there so torchtitan's modules import; "
    "this job should never use it"
)


class _Placeholder:
    """Stands for a name that torchtitan imports and this job never uses: using it raises."""

    qualname = ""

    def __new__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.qualname} is a placeholder: {PLACEHOLDER_WHY}")


def _placeholder(qualname: str) -> type[_Placeholder]:
    return type(qualname.rsplit(".", 1)[-1], (_Placeholder,), {"qualname": qualname})


def fill_torchtitan_gaps() -> None:
    """Fill four gaps between torchtitan 0.3.0 and what this job runs on.

    - HF `datasets` (with pyarrow, far more than this job travels with): torchtitan's
      trainer imports its validator, which imports its HF text datasets module, which
      imports `datasets` at the top. Validation is off and the dataloader is ours, so
      where `datasets` is not installed, `datasets.Dataset`, `datasets.load_dataset`
      and `datasets.distributed.split_dataset_by_node` are placeholders.
    - `torch.distributed.fsdp.DataParallelMeshDims`: new after torch 2.11 (absent from
      2.11.0's `torch/distributed/fsdp`, present in 2.13.0), imported at the top of
      torchtitan's `distributed/fsdp.py` and `distributed/full_dtensor.py` and built
      only for a data-parallel mesh of more than one device (`resolve_fsdp_mesh`
      returns None for the size-1 mesh of a one-GPU run). Where torch lacks it, it is
      a placeholder; a run that would build one fails naming it.
    - `torch.distributed.set_timeout(timeout, group)`: torchtitan's train loop calls
      it after the first step (`set_pg_timeouts`); torch 2.11.0 and 2.13.0 have no
      such function, only the method `ProcessGroup.set_timeout(timeout)`, which it is
      set to call where missing (group None: the default group, as in torch's private
      `_set_pg_timeout`).
    - `create_block_mask(..., separate_full_blocks=...)`: torchtitan's flex-attention
      mask passes it (True unless in its batch-invariant mode); torch 2.11.0's
      `create_block_mask` has no such argument and always separates full blocks, which
      is what True asks. Where torch lacks it, torchtitan's compiled
      `create_block_mask` is called without it (False raises).
    """
    if importlib.util.find_spec("datasets") is None:
        datasets = types.ModuleType("datasets")
        datasets.Dataset = _placeholder("datasets.Dataset")
        datasets.load_dataset = _placeholder("datasets.load_dataset")
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = _placeholder(
            "datasets.distributed.split_dataset_by_node"
        )
        datasets.distributed = distributed
        sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _placeholder("torch.distributed.fsdp.DataParallelMeshDims")
    if not hasattr(dist, "set_timeout"):

        def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
            (dist.group.WORLD if group is None else group).set_timeout(timeout)

        dist.set_timeout = set_timeout
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        compiled = attention._compiled_create_block_mask

        def without_separate_full_blocks(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError(
                    "torchtitan's batch-invariant mode needs create_block_mask("
                    "separate_full_blocks=False), which this torch lacks"
                )
            return compiled(*args, **kwargs)

        attention._compiled_create_block_mask = without_separate_full_blocks


def job_config(args: argparse.Namespace, assets: str):
    """torchtitan's llama3 debug job with our optimizer, tokenizer files in `assets`,
    our dataloader, and a deterministic, short run."""
    fill_torchtitan_gaps()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from bench.torchtitan_synthetic import SyntheticTextDataLoader, write_tokenizer
    from muon_offload import OptimizerConfig
    from muon_offload.torchtitan import MuonOffloadOptimizers

    config = llama3_debugmodel()
    write_tokenizer(assets, config.model_spec.model.vocab_size)
    config.hf_assets_path = assets
    config.dump_folder = assets
    config.dataloader = SyntheticTextDataLoader.Config(seed=0)
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


def record_losses(trainer) -> list[float]:
    """The loss of each step the trainer logs (every step in the debug job), printed too."""
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def log_and_record(step: int, global_avg_loss: float, *args, **kwargs):
        losses.append(global_avg_loss)
        print(f"step {step}: loss {global_avg_loss!r} ({global_avg_loss.hex()})", flush=True)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = log_and_record
    return losses


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="torchtitan_debug_") as assets:
        trainer = job_config(args, assets).build()
        try:
            losses = record_losses(trainer)
            trainer.train()
            trainer.optimizers.wait_for_optimizer_step()
            params = {
                name: getattr(p, "full_tensor", lambda p=p: p)().detach().cpu()
                for part in trainer.model_parts
                for name, p in part.named_parameters()
            }
            if dist.get_rank() == 0:
                payload = {"params": params, "losses": losses, "args": vars(args)}
                torch.save(payload, args.out)
                print(f"wrote {args.out}: {len(params)} params after {len(losses)} steps")
        finally:
            trainer.optimizers.close()
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def compare(a_path: str, b_path: str) -> None:
    a, b = (torch.load(p, weights_only=False) for p in (a_path, b_path))
    print(f"A: {a['args']}\nB: {b['args']}")
    for step, (loss_a, loss_b) in enumerate(zip(a["losses"], b["losses"], strict=True), 1):
        same = "equal" if loss_a.hex() == loss_b.hex() else "DIFFER"
        print(f"step {step}: loss A {loss_a!r}  B {loss_b!r}  {same}")
    differ = [n for n, t in a["params"].items() if not torch.equal(t, b["params"][n])]
    if differ or a["losses"] != b["losses"]:
        raise SystemExit(
            f"not bit-equal: {len(differ)} of {len(a['params'])} params differ "
            f"(first: {differ[:3]}), losses {'equal' if a['losses'] == b['losses'] else 'differ'}"
        )
    print(f"losses of all {len(a['losses'])} steps and all {len(a['params'])} params bit-equal")


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
