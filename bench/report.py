"""How the benchmarks end: results written as JSON, spawned ranks torn down."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
CODE_PATHS = ("offload", "muon", "muon_offload", "bench", "pyproject.toml")
"""What a run's code fingerprint covers (`code_id`); results (bench/measured) are not code."""
RESULTS = "bench/measured/"


def write_json(path: str | Path, payload: Any) -> None:
    """Write `payload` to `path` (creating its folder) and say where. A dict gets a `run`
    entry (`run_info`: versions, commit, date), which `bench.report_measured` reads; the
    versions are printed beside the path."""
    if isinstance(payload, dict):
        run = run_info()
        payload = {**payload, "run": run}
        print(
            f"torch {run['torch']}, CUDA {run['cuda']}, driver {run['driver']}, "
            f"Python {run['python']}, commit {run['commit']}"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi gives it; None without a CUDA device or
    nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not torch.cuda.is_available() or smi is None:
        return None
    query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    try:  # a hung nvidia-smi must not hold up writing the results
        out = subprocess.run(query, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def run_info() -> dict[str, str | None]:
    """What ran this bench, the one place every bench records it: torch's version, the
    CUDA it was built with (None on a CPU build), the NVIDIA driver (`driver_version`),
    Python's version; the commit (short hash, "+dirty" with uncommitted changes to
    tracked files; None outside a git checkout), the fingerprint of the code that ran
    (`code_id`, in a checkout) and the UTC time."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or None
    if commit is not None and git("status", "--porcelain", "--untracked-files=no").strip():
        commit += "+dirty"
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver_version(),
        "python": platform.python_version(),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    code = code_id(ROOT) if commit is not None else None
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
