"""Run a test body on several gloo ranks and fail the test with the ranks' tracebacks."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(body: Callable[..., None], world: int, *args: Any) -> None:
    """`body(rank, world, *args)` in `world` spawned processes on one gloo group.

    `body` must be a module-level function (spawn pickles it by name).
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank_main, args=(world, tmp, body, args), nprocs=world, join=True)
        except Exception as err:
            errors = [
                open(os.path.join(tmp, name)).read()
                for name in sorted(os.listdir(tmp))
                if name.startswith("error")
            ]
            pytest.fail("\n".join(errors) or f"a rank failed: {err}")


def _rank_main(rank: int, world: int, tmp: str, body: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
        dist.barrier()  # no rank tears down while a peer still talks (gloo aborts at exit)
    except Exception:
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
