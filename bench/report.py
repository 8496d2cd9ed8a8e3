"""How the benchmarks end: results written as JSON, spawned ranks torn down."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist


def write_json(path: str | Path, payload: Any) -> None:
    """Write `payload` to `path` (creating its folder) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")


def exit_spawned_rank(status: int = 0) -> NoReturn:
    """End a spawned rank whose work is done: tear down together, then exit with `status`.

    The barrier keeps a rank from destroying its group while a peer still talks.
    `os._exit` skips interpreter finalization, where gloo's C++ threads sometimes
    abort the process ("terminate called without an active exception") after a
    clean teardown.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
