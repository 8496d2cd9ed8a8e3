"""How the benchmarks end: results written as JSON, spawned ranks torn down."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

CODE_PATHS = ("offload", "muon", "muon_offload", "bench", "pyproject.toml")
"""What a run's code fingerprint covers (`code_id`); results (bench/measured) are not code."""
RESULTS = "bench/measured/"


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
    "unknown" outside a git checkout), the fingerprint of the code that ran (`code_id`)
    and its UTC time."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no").strip():
        commit += "+dirty"
    info = {"commit": commit, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    code = code_id(root) if commit != "unknown" else None
    return info if code is None else {**info, "code": code}


def code_id(root: Path) -> str | None:
    """A fingerprint of the code under `root` (`CODE_PATHS`, files git tracks or does not
    ignore), the one `commit_code_id` gives the commit holding the same files: it names the
    code that ran where a checkout's HEAD does not (a copy synced onto another machine
    keeps the .git it was first sent with). None outside a git checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CODE_PATHS],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    if listed.returncode != 0:
        return None
    entries = {}
    for name in listed.stdout.split("\0"):
        path = root / name
        if name and not name.startswith(RESULTS) and path.is_file() and not path.is_symlink():
            content = path.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
            entries[name] = blob
    return _fingerprint(entries)


def commit_code_id(commit: str, root: Path) -> str:
    """`code_id` of the files `commit` holds."""
    tree = subprocess.run(
        ["git", "ls-tree", "-r", "-z", commit, "--", *CODE_PATHS],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    entries = {}
    for line in tree.split("\0"):
        if line:
            meta, name = line.split("\t", 1)
            mode, kind, blob = meta.split()
            if kind == "blob" and mode != "120000" and not name.startswith(RESULTS):
                entries[name] = blob
    return _fingerprint(entries)


def _fingerprint(entries: dict[str, str]) -> str:
    text = "".join(f"{name} {blob}\n" for name, blob in sorted(entries.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


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
