"""Peak elements that ops allocate (on any device, CPU included), for workspace models."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTracker(TorchDispatchMode):
    """Counts the elements of the storages ops allocate while they are alive; keeps the peak.

    Tensors of at most `ignore_numel` elements (the per-matrix norms) are not counted.
    """

    def __init__(self, ignore_numel: int) -> None:
        super().__init__()
        self.ignore_numel = ignore_numel
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, numel: int) -> None:
        self._seen.discard(key)
        self.live -= numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            numel = storage.nbytes() // t.element_size()
            if key in before or key in self._seen or numel <= self.ignore_numel:
                continue
            self._seen.add(key)
            self.live += numel
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, numel)
        return out
