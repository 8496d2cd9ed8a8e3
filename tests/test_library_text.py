"""Library docstrings and comments state contracts and units, not one machine's figures:
a constant chosen by measurement names the bench that measured it (bench/measured/ keeps
the results)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "muon", "muon_offload")
DEVICE_NAMES = ("H200", "H100", "A100")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_device_names_in_library(package):
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(name in line for name in DEVICE_NAMES)
    ]
    assert not hits, "device figures belong in bench/measured/, not the library:\n" + "\n".join(
        hits
    )
