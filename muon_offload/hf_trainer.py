"""`transformers.Trainer` with the optimizer `setup_optimizer` builds, FSDP2 through accelerate.

    from muon_offload.hf_trainer import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_config=OptimizerConfig(type="muon", offload="optimizer",
                                                       offload_overlap_forward=True))

Needs transformers (and accelerate, which it uses); importing this module without
them fails with the usual ImportError.

Why a subclass: under FSDP2 (`fsdp_config={"fsdp_version": 2, ...}`) the Trainer
builds its optimizer on the unsharded model and accelerate then swaps the
optimizer's params for the sharded ones. Our optimizers plan from the params they
are given (Muon's owners and exchange, the offload chunks and host slabs, the
forward-overlap hooks on FSDP modules), so this Trainer shards the model first,
with accelerate's own `fsdp2_prepare_model` and the same plugin settings, and
builds the optimizer on the sharded model; accelerate's prepare then finds the
model sharded and maps every param to itself.

With forward overlap, `step()` returns before the update is done and the next
forward finishes it; the Trainer saves the model (and runs user callbacks) between
the two, so this Trainer waits for the step before a checkpoint and at the end of
training.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from muon_offload.config import OptimizerConfig, setup_optimizer


def wait_for_optimizer_step(optimizer: torch.optim.Optimizer | None) -> None:
    """Finish an overlapped step, through accelerate's `AcceleratedOptimizer` wrapper."""
    inner = getattr(optimizer, "optimizer", optimizer)
    getattr(inner, "wait_for_optimizer_step", lambda: None)()


class _WaitBeforeSave(transformers.TrainerCallback):
    """Params are read outside a forward to save them: finish the step first."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save or control.should_training_stop:
            wait_for_optimizer_step(optimizer)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        wait_for_optimizer_step(optimizer)


class Trainer(transformers.Trainer):
    """`transformers.Trainer` whose optimizer is `setup_optimizer(model, optimizer_config)`.

    Everything else (scheduler, clipping, checkpoint save and resume, FSDP2 through
    accelerate) is the Trainer's own.
    """

    def __init__(self, *args: Any, optimizer_config: OptimizerConfig, **kwargs: Any) -> None:
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None:
            raise ValueError(
                "optimizers=(optimizer, ...) and optimizer_config both set: this Trainer builds "
                "the optimizer from optimizer_config; pass one or the other"
            )
        self.optimizer_config = optimizer_config
        super().__init__(*args, **kwargs)
        self.add_callback(_WaitBeforeSave())

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            if self.is_fsdp_enabled and self.accelerator.state.fsdp_plugin.fsdp_version == 2:
                from accelerate.utils import fsdp2_prepare_model

                model = fsdp2_prepare_model(self.accelerator, model)  # in place
            self.optimizer = setup_optimizer(model, self.optimizer_config)
        return self.optimizer
