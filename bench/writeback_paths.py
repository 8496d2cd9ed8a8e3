"""Two ways to write optimizer state back to pinned host memory, and what each does to
the trainer's own small device-to-host copy (`.item()`) enqueued while it runs.

    python -m bench.writeback_paths [--gib 2] [--json PATH]

- copy engine: `home.copy_(staging, non_blocking=True)` in 32 MiB pieces on a side
  stream (what `CPUOffloadOptimizer` does);
- kernel: a Triton kernel on a side stream that stores into the pinned buffer through
  its mapped device address (pinned host memory is device-addressable under unified
  addressing), with a few thread blocks, so the copy engine stays free.

For each: bandwidth alone, and the host time of a 4-byte `.item()` on the default stream
enqueued just after the write-back started (what a trainer's forward waits). What the
kernel costs a concurrent forward is measured end to end by `bench/train_step.py`
(an A/B in bench/measured: the overlapped forward's layers took longer with it). Prints
a table and writes JSON. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]
PIECE_BYTES = 32 << 20


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for offset in range(start, n, step):
            index = offset + tl.arange(0, BLOCK)
            mask = index < n
            tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)

    return copy


def writeback(path: str, src: torch.Tensor, dst: torch.Tensor, stream, blocks: int) -> None:
    """Enqueue the write-back of `src` into pinned `dst` on `stream`."""
    with torch.cuda.stream(stream):
        if path == "copy engine":
            step = PIECE_BYTES // src.element_size()
            for i in range(0, src.numel(), step):
                dst[i : i + step].copy_(src[i : i + step], non_blocking=True)
        else:
            _KERNEL[(blocks,)](src, dst, src.numel(), BLOCK=4096)


def bandwidth(path: str, src, dst, stream, blocks: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        writeback(path, src, dst, stream, blocks)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return src.numel() * src.element_size() / statistics.median(times) / 2**30


def item_wait_ms(path: str | None, src, dst, stream, blocks: int, repeats: int = 5) -> float:
    """Host ms of a small `.item()` enqueued right after the write-back (None: alone)."""
    small = torch.ones(1, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if path is not None:
            writeback(path, src, dst, stream, blocks)
        start = time.perf_counter()
        (small * 2).sum().item()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e3 * statistics.median(times)


_KERNEL = None


def main() -> None:
    global _KERNEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="bytes written back per run")
    parser.add_argument("--blocks", default="8,16,32,66", help="kernel thread blocks to try")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/writeback_paths.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/writeback_paths.py needs CUDA")
    _KERNEL = _copy_kernel()
    n = int(args.gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n, pin_memory=True)
    stream = torch.cuda.Stream()
    writeback("kernel", src, dst, stream, 32)
    torch.cuda.synchronize()
    exact = torch.equal(dst, src.cpu())
    rows = [{"path": "none", "item_ms": item_wait_ms(None, src, dst, stream, 0)}]
    arms = [("copy engine", 0)] + [("kernel", int(b)) for b in args.blocks.split(",")]
    for path, blocks in arms:
        rows.append(
            {
                "path": path,
                "blocks": blocks,
                "gib_s": bandwidth(path, src, dst, stream, blocks),
                "item_ms": item_wait_ms(path, src, dst, stream, blocks),
            }
        )
    device = torch.cuda.get_device_name()
    print(
        f"{device}, torch {torch.__version__}, {args.gib:g} GiB written back, kernel exact: {exact}"
    )
    print(f"{'path':<12} {'blocks':>6} {'GiB/s':>7} {'.item() ms':>11}")
    for r in rows:
        print(
            f"{r['path']:<12} {r.get('blocks', '-'):>6} {r.get('gib_s', 0):>7.1f} "
            f"{r['item_ms']:>11.2f}"
        )
    write_json(
        args.json,
        {
            "device": device,
            "gib": args.gib,
            "exact": exact,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
