"""Which implementation runs the elementwise part of the Muon step (momentum, apply).

"torch" is the plain torch ops in `muon.optimizer` (the CPU default, what CI runs);
"triton" forces the fused kernels of `muon.fused` (CUDA, or CPU tensors under
TRITON_INTERPRET=1); "auto" (default) uses them for CUDA tensors when triton imports.
Set with `MUON_ELEMENTWISE_BACKEND` or `set_backend`. CPU tensors never import
triton under "auto".
"""

from __future__ import annotations

import torch

from muon.backend import BACKENDS, BackendSetting

__all__ = ["BACKENDS", "get_backend", "set_backend", "use_fused"]

_setting = BackendSetting("MUON_ELEMENTWISE_BACKEND")


def set_backend(backend: str) -> str:
    """Set the process-wide elementwise backend; returns the previous one."""
    return _setting.set(backend)


def get_backend() -> str:
    """The process-wide elementwise backend (`MUON_ELEMENTWISE_BACKEND`, else "auto")."""
    return _setting.value


def use_fused(device: torch.device) -> bool:
    """Whether the Muon step runs `muon.fused`'s kernels for tensors on `device`."""
    backend = _setting.value
    if backend == "auto":
        if device.type != "cuda":
            return False
        from muon import fused

        return fused.available()
    return backend == "triton"
