"""torchtitan adapter: a job config selects `muon.Muon` and/or offloaded state with overlap.

torchtitan (checked against 0.3.0) builds its optimizer from the trainer config's
`optimizer` field, an `OptimizersContainer.Config`, after the model is
parallelized: `config.optimizer.build(model_parts=...)`. A `Config` subclass whose
owner is another container is the hook it offers, so a job config picks ours with

    from muon_offload import OptimizerConfig
    from muon_offload.torchtitan import MuonOffloadOptimizers

    config = llama3_debugmodel()   # any Trainer.Config from a config_registry
    config.optimizer = MuonOffloadOptimizers.Config(
        optimizer=OptimizerConfig(type="muon", lr=8e-4, offload="optimizer",
                                  offload_overlap_forward=True))

and every `OptimizerConfig` field but `muon_options` (a dict, which tyro does not
parse from one flag) is a CLI flag through torchtitan's tyro parser
(`--optimizer.optimizer.offload optimizer`). The container holds
`setup_optimizer(part, config)` per model part; stepping, zeroing, the
scheduler and torchtitan's FQN-keyed checkpoint state go through torchtitan's
own container code. Needs torchtitan (imported here, not by `muon_offload`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)

from muon_offload.config import OptimizerConfig, setup_optimizer


class MuonOffloadOptimizers(OptimizersContainer):
    """torchtitan's optimizers container over `setup_optimizer(model_part, config.optimizer)`.

    Each param group carries `param_names` (the canonical FQNs torchtitan's
    checkpointer keys optimizer state by), as torchtitan's own groups do.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
        """What `muon_offload.setup_optimizer` builds for each model part."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        # torchtitan's own fields (param_groups, implementation, the factories' kwargs)
        # would be silently unused: everything comes from config.optimizer
        base = OptimizersContainer.Config()
        for name in (f.name for f in dataclasses.fields(base)):
            if getattr(config, name) != getattr(base, name):
                raise ValueError(
                    f"MuonOffloadOptimizers.Config.{name} is set, but the optimizer comes "
                    "from config.optimizer alone (an OptimizerConfig: muon_param_groups' "
                    f"groups for type='muon', its fused and muon_options); leave {name} at "
                    f"its default, {getattr(base, name)!r}"
                )
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        for part in model_parts:
            optimizer = setup_optimizer(part, config.optimizer)
            names = {id(p): canonical_fqn(name) for name, p in part.named_parameters()}
            for group in optimizer.param_groups:
                group["param_names"] = [names[id(p)] for p in group["params"]]
                all_params.extend(group["params"])
            self.optimizers.append(optimizer)
        self._validate_params(all_params)
        self._post_init(all_params)

    def state_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for optimizer in self.optimizers:
            self._init_state(optimizer)
            result.update(get_flat_optim_state_dict(optimizer))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer in self.optimizers:
            self._init_state(optimizer)
            load_flat_optim_state_dict(optimizer, state_dict)

    @staticmethod
    def _init_state(optimizer) -> None:
        """torchtitan's state-creating zero-lr step, finished: under forward overlap a step
        (that one, or the last training step) creates or updates a chunk's state only when
        the chunk runs, and a read of the state that runs it warns of a rank-local read
        (distributed Muon). torchtitan saves and loads on every rank."""
        getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
        init_optim_state(optimizer)
        getattr(optimizer, "wait_for_optimizer_step", lambda: None)()

    def wait_for_optimizer_step(self) -> None:
        """Finish every part's overlapped step (before reading params outside a forward)."""
        for optimizer in self.optimizers:
            getattr(optimizer, "wait_for_optimizer_step", lambda: None)()

    def close(self) -> None:
        """Remove the optimizers' hooks (forward overlap), where they have any."""
        for optimizer in self.optimizers:
            getattr(optimizer, "close", lambda: None)()
