"""Config-driven setup of Muon / AdamW with optional CPU offload of their state."""

from muon.param_groups import model_row_blocks
from muon_offload.config import OptimizerConfig, setup_optimizer

__all__ = ["OptimizerConfig", "model_row_blocks", "setup_optimizer"]
