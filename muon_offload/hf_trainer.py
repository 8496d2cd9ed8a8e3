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

import dataclasses
import inspect
import os
import warnings
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


# TrainingArguments' optimizer settings, and what of `OptimizerConfig` this Trainer uses
# in their place (None: nothing, `optim` picks an optimizer class).
_ARGS_THE_CONFIG_REPLACES = {
    "learning_rate": lambda c: c.lr,
    "weight_decay": lambda c: c.weight_decay,
    "adam_beta1": lambda c: c.betas[0],
    "adam_beta2": lambda c: c.betas[1],
    "adam_epsilon": lambda c: c.eps,
    "optim": lambda c: None,
    "optim_args": lambda c: None,
}


# `optim` values whose training_step passes `learning_rate` to `backward()` (transformers 5.x).
_BACKWARD_STEPPING_OPTIMS = ("lomo", "adalomo")


def _unused_args(args: transformers.TrainingArguments, config: OptimizerConfig) -> list[str]:
    """TrainingArguments' optimizer settings set away from their defaults and from what
    `config` sets: the Trainer's own optimizer would use them, this one does not."""
    defaults = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    unused = []
    for name, used in _ARGS_THE_CONFIG_REPLACES.items():
        value = getattr(args, name, None)
        if name in defaults and value != defaults[name] and value != used(config):
            unused.append(f"{name}={getattr(value, 'value', value)!r}")  # optim: an enum
    return unused


class Trainer(transformers.Trainer):
    """`transformers.Trainer` whose optimizer is `setup_optimizer(model, optimizer_config)`.

    Everything else (scheduler, clipping, checkpoint save and resume, FSDP2 through
    accelerate) is the Trainer's own. The optimizer's settings are the config's alone:
    TrainingArguments' `learning_rate`, `weight_decay`, `adam_*` and `optim` set to
    something else are warned about, and an optimizer or scheduler passed in is refused.
    """

    def __init__(self, *args: Any, optimizer_config: OptimizerConfig, **kwargs: Any) -> None:
        if not isinstance(optimizer_config, OptimizerConfig):
            raise TypeError(
                "optimizer_config should be an OptimizerConfig (OptimizerConfig(**fields), or "
                f"OptimizerConfig.from_toml(path)) but is: {type(optimizer_config).__name__}"
            )
        # by keyword or by position, as the next __init__ in the MRO takes them (a
        # subclass mixed with Seq2SeqTrainer has another 12th argument)
        try:
            given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        except TypeError:
            given = kwargs  # the Trainer's own call below says what is wrong
        optimizer, scheduler = given.get("optimizers") or (None, None)
        if optimizer is not None or given.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(
                "optimizers=(optimizer, ...) or optimizer_cls_and_kwargs set with "
                "optimizer_config: this Trainer builds the optimizer from optimizer_config; "
                "pass one or the other"
            )
        if scheduler is not None:
            raise ValueError(
                "optimizers=(None, scheduler): a scheduler built before the Trainer steps "
                "another optimizer than the one it builds from optimizer_config; choose the "
                "schedule with TrainingArguments (lr_scheduler_type, warmup_steps), or "
                "override create_scheduler"
            )
        self.optimizer_config = optimizer_config
        super().__init__(*args, **kwargs)
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim in _BACKWARD_STEPPING_OPTIMS:
            raise ValueError(
                f"TrainingArguments(optim={optim!r}): the Trainer's training_step then hands "
                "the learning rate to loss.backward() (LOMO steps inside the backward), "
                "which the optimizer optimizer_config builds does not take; leave optim at "
                "its default"
            )
        unused = _unused_args(self.args, optimizer_config)
        if unused:
            warnings.warn(
                f"TrainingArguments sets {', '.join(unused)}, which this Trainer does not use: "
                f"optimizer_config sets the optimizer (type={optimizer_config.type!r}, "
                f"lr={optimizer_config.lr}, weight_decay={optimizer_config.weight_decay}, "
                f"betas={optimizer_config.betas}, eps={optimizer_config.eps})",
                stacklevel=2,
            )
        self.add_callback(_WaitBeforeSave())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's own resume, with what a refused optimizer state means here: the
        checkpoint's optimizer is not the one `optimizer_config` builds over the params
        that train now (torch says only that the groups differ). Private API (transformers'
        resume hook; 5.x checked)."""
        if checkpoint is not None and os.path.isdir(checkpoint):
            names = os.listdir(checkpoint)
            if not any(name.startswith("optimizer") for name in names):
                warnings.warn(  # the Trainer then starts both anew, silently
                    f"resuming from {checkpoint}, which holds no optimizer state (saved with "
                    "save_only_model=True?): the optimizer's state and the learning-rate "
                    "schedule start anew from this step",
                    stacklevel=3,
                )
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except ValueError as error:
            raise ValueError(
                f"resuming from {checkpoint}: its optimizer or scheduler state does not fit "
                f"the optimizer built now (optimizer_config type="
                f"{self.optimizer_config.type!r}, offload={self.optimizer_config.offload!r}, "
                f"over the params that train now): {error}. Resume with the optimizer the "
                "checkpoint was saved with (this Trainer's: the same optimizer_config) and "
                "the params that trained then"
            ) from error

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            if self.is_fsdp_enabled and self.accelerator.state.fsdp_plugin.fsdp_version == 2:
                from accelerate.utils import fsdp2_prepare_model

                model = fsdp2_prepare_model(self.accelerator, model)  # in place
            self.optimizer = setup_optimizer(model, self.optimizer_config)
        return self.optimizer
