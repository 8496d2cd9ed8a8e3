"""Running a test file's Triton kernels under the interpreter (CPU tensors, TRITON_INTERPRET=1).

A file marks its interpreter tests `interp` (named `test_interp_*`) and calls
`rerun_under_interpreter(__file__)` from one ordinary test: the interpreter must be
switched on before triton is imported, so that test re-runs the file in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

interp = pytest.mark.skipif(not (INTERPRET and HAVE_TRITON), reason="needs TRITON_INTERPRET=1")
runs_interpreter = pytest.mark.skipif(
    INTERPRET or not HAVE_TRITON, reason="needs triton; runs the interpreter"
)


def rerun_under_interpreter(path: str) -> None:
    """Run `path`'s `interp_` tests with TRITON_INTERPRET=1; fail unless all ran and passed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", path, "-q", "-o", "addopts=", "-k", "interp_"]
        + ["-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
