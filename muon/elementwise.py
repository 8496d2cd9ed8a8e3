"""Which implementation runs the elementwise part of the Muon step (momentum, apply).

"torch" is the plain torch ops in `muon.optimizer` (the CPU default, what CI runs);
"triton" forces the fused kernels of `muon.fused` (CUDA, or CPU tensors under
TRITON_INTERPRET=1); "auto" (default) uses them for CUDA tensors when triton imports.
Set with `MUON_ELEMENTWISE_BACKEND` or `set_backend`. CPU tensors never import
triton under "auto".
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")

_backend = os.environ.get("MUON_ELEMENTWISE_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"MUON_ELEMENTWISE_BACKEND should be one of {BACKENDS} but is: {_backend!r}")


def set_backend(backend: str) -> str:
    """Set the process-wide elementwise backend; returns the previous one."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"backend should be one of {BACKENDS} but is: {backend!r}")
    previous, _backend = _backend, backend
    return previous


def get_backend() -> str:
    """The process-wide elementwise backend (`MUON_ELEMENTWISE_BACKEND`, else "auto")."""
    return _backend


def use_fused(device: torch.device) -> bool:
    """Whether the Muon step runs `muon.fused`'s kernels for tensors on `device`."""
    if _backend == "auto":
        if device.type != "cuda":
            return False
        from muon import fused

        return fused.available()
    return _backend == "triton"
