"""Exact Muon for plain tensors and FSDP2 (DTensor) params."""

from muon.newton_schulz import NewtonSchulzPath, ns_path, zeropower
from muon.ns_schedules import (
    DEEPSEEK_V4,
    KELLER_JORDAN,
    POLAR_EXPRESS,
    SCHEDULES,
    NewtonSchulzSchedule,
)
from muon.optimizer import BucketMetrics, Muon, MuonStep
from muon.param_groups import muon_param_groups
from muon.planning import SpreadModel

__all__ = [
    "DEEPSEEK_V4",
    "KELLER_JORDAN",
    "POLAR_EXPRESS",
    "SCHEDULES",
    "BucketMetrics",
    "Muon",
    "MuonStep",
    "NewtonSchulzPath",
    "NewtonSchulzSchedule",
    "SpreadModel",
    "muon_param_groups",
    "ns_path",
    "zeropower",
]
