"""The console scripts in pyproject.toml name callables of packages the wheel installs."""

import fnmatch
import importlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_console_scripts_resolve_to_installed_callables():
    project = tomllib.loads(PYPROJECT.read_text())
    scripts = project["project"]["scripts"]
    assert {"muon-offload-plan", "muon-offload-demo"} <= set(scripts)
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for name, target in scripts.items():
        module_name, _, attribute = target.partition(":")
        package = module_name.split(".")[0]
        assert any(fnmatch.fnmatchcase(package, p) for p in included), (name, included)
        assert callable(getattr(importlib.import_module(module_name), attribute)), name
