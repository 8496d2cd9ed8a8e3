"""Write-backs to pinned host memory by a kernel, leaving the copy engine to the trainer.

A device-to-host copy the trainer enqueues (`.item()` in a model's forward, FSDP2's
small copies) waits in the copy engine behind every copy enqueued before it, from any
stream: behind a step's write-backs it waited as long as they took
(`bench/writeback_paths.py`). A kernel with a few thread blocks stores into the pinned
slab through its device address instead (pinned host memory is device-addressable under
unified addressing) at about the copy engine's rate, and the copy engine stays free.
Bytes are copied as they are: the result is bit-identical to `Tensor.copy_`.

Needs CUDA and Triton; `kernel_writer` says where it cannot run, and the caller then
uses the copy engine.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

THREAD_BLOCKS = 8
"""Thread blocks per write-back: `bench/writeback_paths.py` shows 8 at the copy engine's rate."""
BLOCK_BYTES = 16384  # bytes one block stores per loop iteration

HostWriter = Callable[[Tensor, Tensor], None]
"""`write(home, staging)`: enqueue the copy of device `staging` into pinned `home` on the
current stream (same shape, dtype and contiguity)."""


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        stride = tl.num_programs(0) * BLOCK
        for offset in range(start, n, stride):
            index = offset + tl.arange(0, BLOCK)
            mask = index < n
            tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)

    return copy_words


def _words(tensor: Tensor) -> Tensor:
    """`tensor`'s bytes as 4-byte words where they divide into them, else as bytes."""
    as_bytes = tensor.view(-1).view(torch.uint8)
    if as_bytes.numel() % 4 == 0 and as_bytes.data_ptr() % 4 == 0:
        return as_bytes.view(torch.int32)
    return as_bytes


def write_by_kernel(home: Tensor, staging: Tensor) -> None:
    src, dst = _words(staging), _words(home)
    if src.dtype != dst.dtype:  # aligned differently: fall back to bytes on both
        src, dst = staging.view(-1).view(torch.uint8), home.view(-1).view(torch.uint8)
    block = BLOCK_BYTES // src.element_size()
    blocks = min(THREAD_BLOCKS, -(-src.numel() // block))
    if blocks:
        _kernel()[(blocks,)](src, dst, src.numel(), BLOCK=block)


def write_by_copy_engine(home: Tensor, staging: Tensor) -> None:
    home.copy_(staging, non_blocking=True)


def kernel_writer(home: Tensor, device: torch.device) -> HostWriter:
    """`write_by_kernel` where it works for pinned `home` and `device`, else the copy engine.

    Tried once on a few elements of `home` (which must hold no state yet or be restored:
    its first elements are written and read back), synchronizing the device once.
    """
    if device.type != "cuda" or home.numel() == 0:
        return write_by_copy_engine
    try:
        import triton  # noqa: F401
    except ImportError:
        return write_by_copy_engine
    probe = home[:64]
    saved = probe.clone()
    staging = torch.arange(probe.numel(), device=device).to(probe.dtype)
    try:
        write_by_kernel(probe, staging)
        torch.cuda.synchronize(device)
        works = torch.equal(probe, staging.cpu())
    except Exception as error:  # a Triton or driver refusal: the copy engine always works
        logger.info("offload: write-backs by the copy engine (kernel writes failed: %s)", error)
        works = False
    probe.copy_(saved)
    return write_by_kernel if works else write_by_copy_engine
