"""How the benchmarks end: results written as JSON, spawned ranks torn down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist


def write_json(path: str | Path, payload: Any) -> None:
    """Write `payload` to `path` (creating its folder) and say where. A dict gets a `run`
    entry (`run_info`), which `bench.report_measured` reads."""
    if isinstance(payload, dict):
        payload = {**payload, "run": run_info()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")


def run_info() -> dict[str, str]:
    """This run's commit (short hash, "+dirty" with uncommitted changes to tracked files;
    "unknown" outside a git checkout) and its UTC time."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no").strip():
        commit += "+dirty"
    return {"commit": commit, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


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
