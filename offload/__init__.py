"""Optimizer-state CPU offload: the subset-step protocol and CPUOffloadOptimizer."""

from offload.chunk_plan import OffloadPlan, plan_offload
from offload.cpu_offload import CPUOffloadOptimizer
from offload.host_memory import HostMemoryError
from offload.residency import ResidencyChoice
from offload.subset_step import (
    GroupSubsetStep,
    ParamSlice,
    SlicingSubsetStep,
    SubsetStep,
    SupportsSubsetStep,
    subset_step_for,
)

__all__ = [
    "CPUOffloadOptimizer",
    "GroupSubsetStep",
    "HostMemoryError",
    "OffloadPlan",
    "ParamSlice",
    "ResidencyChoice",
    "SlicingSubsetStep",
    "SubsetStep",
    "SupportsSubsetStep",
    "plan_offload",
    "subset_step_for",
]
