"""Run a test body on several ranks (gloo, or NCCL with one GPU each) and fail the test
with the ranks' tracebacks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks fork from a server that imported torch and this project once (CUDA stays
# uninitialized there): a spawned rank imported them anew, seconds of a 2-core machine per
# test on ranks, the suite's largest cost on CI.
mp.set_forkserver_preload(["torch", "torch.distributed", "spawn_ranks", "offload", "muon"])


def _environment() -> dict[str, str]:
    """The environment, less what pytest sets for each test."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


_ENVIRONMENT = _environment()  # at collection, before any test's monkeypatching


def _start_method() -> str:
    """ "forkserver", whose server starts (at its first use) with the environment the tests
    were collected in, unless a test changed it (a monkeypatched variable): a forked rank
    has the server's, and the modules it preloaded read some on import (`muon`'s
    backends), so such a test's ranks spawn."""
    return "forkserver" if _environment() == _ENVIRONMENT else "spawn"


def run_on_ranks(body: Callable[..., None], world: int, *args: Any, backend: str = "gloo") -> None:
    """`body(rank, world, *args)` in `world` processes on one `backend` group.

    Under "nccl" rank r uses cuda:r (passed as `device_id`: NCCL otherwise guesses the
    device from the rank). `body` must be a module-level function (it is pickled by
    name). A rank that raises leaves its traceback; one killed by a signal leaves its
    Python stacks.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(
                _rank_main,
                args=(world, tmp, body, args, backend),
                nprocs=world,
                join=True,
                start_method=_start_method(),
            )
        except Exception as err:
            reports = []
            for name in sorted(os.listdir(tmp)):
                if name.startswith(("error", "fault")):
                    with open(os.path.join(tmp, name)) as f:
                        text = f.read()
                    if text:
                        reports.append(f"--- {name}\n{text}")
            pytest.fail("\n".join([f"a rank failed: {err}", *reports]))


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone (world 1), for the block's length."""
    from bench.train import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_main(
    rank: int, world: int, tmp: str, body: Callable[..., None], args: tuple, backend: str
) -> None:
    torch.set_num_threads(1)
    fault_log = open(os.path.join(tmp, f"fault.{rank}"), "w")  # open until the process exits
    faulthandler.enable(file=fault_log, all_threads=True)
    options: dict[str, Any] = {}
    if backend == "nccl":
        options["device_id"] = torch.device("cuda", rank)
        torch.cuda.set_device(options["device_id"])
    dist.init_process_group(
        backend, init_method=f"file://{tmp}/init", rank=rank, world_size=world, **options
    )
    exit_code = 0
    try:
        body(rank, world, *args)
        dist.barrier()  # no rank tears down while a peer still talks
    except Exception:
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        exit_code = 1
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: there, gloo's C++ threads sometimes abort the
    # process ("terminate called without an active exception", no Python frame on
    # the stack) after the rank's work is done and reported.
    os._exit(exit_code)
