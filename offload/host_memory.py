"""Host slabs for offloaded state: checked against free memory, then allocated
once per dtype, NUMA-local to the GPU and pinned.

Pinning registers plain host pages (`cudaHostRegister`) instead of asking the
caching host allocator, which rounds each request up to a power of two and
would hold up to twice the state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import psutil
import torch

from offload.numa import bound_to_node, device_numa_node

logger = logging.getLogger(__name__)


class HostMemoryError(MemoryError):
    """The host cannot hold the offloaded state."""


def check_host_memory(needed_bytes: int, what: str = "offloaded optimizer state") -> None:
    """Raise before allocating anything if the host has less free memory than needed."""
    available = psutil.virtual_memory().available
    if needed_bytes > available:
        raise HostMemoryError(
            f"{what} needs {needed_bytes} bytes ({needed_bytes / 2**30:.2f} GiB) of host memory, "
            f"but only {available} bytes ({available / 2**30:.2f} GiB) are available; "
            "free host memory, shard over more ranks, or do not offload"
        )


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes `device` can still allocate, where that can be known: a CUDA device's free
    memory plus what torch's caching allocator holds unused; the host's available
    memory when the device is the host; None elsewhere."""
    if device.type == "cpu":
        return psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return None


def device_headroom_bytes(device: torch.device) -> int:
    """What `device` had free at its peak so far, less `BUDGET_MARGIN_FRACTION` of its
    memory: a CUDA device's memory less the most torch's allocator has reserved; the
    host's available memory when the device is the host (0 where unknown)."""
    from offload.residency import BUDGET_MARGIN_FRACTION

    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_reserved(device)
    elif device.type == "cpu":
        memory = psutil.virtual_memory()
        total, peak = memory.total, memory.total - memory.available
    else:
        return 0
    return max(0, total - peak - int(BUDGET_MARGIN_FRACTION * total))


def room_under_peak_bytes(device: torch.device) -> int | None:
    """What `device`'s allocator has held at its peak so far beyond what it holds now (at
    a step: the forward's and backward's activations, given back): memory this process
    has already used, so state held there does not raise its peak. None off CUDA."""
    if device.type != "cuda":
        return None
    return max(0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))


def check_device_memory(needed_bytes: int, device: torch.device, what: str, fix: str) -> None:
    """Raise before allocating if `device` has less free memory than needed (where known)."""
    free = free_device_bytes(device)
    if free is not None and needed_bytes > free:
        error = HostMemoryError if device.type == "cpu" else torch.OutOfMemoryError
        raise error(
            f"{what} needs {needed_bytes} bytes ({needed_bytes / 2**30:.2f} GiB) on {device}, "
            f"but only {free} bytes ({free / 2**30:.2f} GiB) are free; {fix}"
        )


def _pin(slab: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    nbytes = slab.numel() * slab.element_size()
    err = cudart.cudaHostRegister(slab.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise HostMemoryError(
            f"cudaHostRegister of {nbytes} bytes failed with error {int(err)} "
            "(check `ulimit -l` for locked-memory limits)"
        )
    # Unregister when the slab goes; the optimizer holds it as long as its state views live.
    weakref.finalize(slab, cudart.cudaHostUnregister, slab.data_ptr())


def allocate_host_slabs(
    numel: Mapping[torch.dtype, int], device: torch.device
) -> dict[torch.dtype, torch.Tensor]:
    """One zeroed slab per dtype, on `device`'s NUMA node, pinned when `device` is a GPU.

    The zero fill is the first touch, so the pages land where the memory policy
    points while the allocating thread is bound.
    """
    check_host_memory(sum(n * dtype.itemsize for dtype, n in numel.items()))
    slabs = {}
    with bound_to_node(device_numa_node(device)):
        for dtype, n in numel.items():
            # on the CPU whatever the default device (`torch.set_default_device`) is
            slab = torch.zeros(n, dtype=dtype, device="cpu")
            if device.type == "cuda" and n > 0:
                _pin(slab)
            slabs[dtype] = slab
    return slabs
