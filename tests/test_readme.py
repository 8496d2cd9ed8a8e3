"""Every ```python block of README.md and docs/*.md runs as written, each on its own (CPU);
the README's two commands are the ones .ci/run runs.

A block that cannot run on a CPU-only CI machine starts with `# requires: NAME`, where
NAME is `cuda` or a module to import (`# requires: torchtitan`): it runs where that is
available and is skipped, saying why, elsewhere. Keep such blocks rare.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REQUIRES = re.compile(r"# requires: (\S+)\n")


def _blocks() -> list[pytest.param]:
    params = []
    for document in DOCUMENTS:
        found = re.findall(r"^```python\n(.*?)^```", document.read_text(), re.S | re.M)
        for i, code in enumerate(found):
            name = f"{document.relative_to(ROOT)}:{i}"
            params.append(pytest.param(name, code, id=name))
    return params


BLOCKS = _blocks()


def _missing(requirement: str) -> bool:
    if requirement == "cuda":
        return not torch.cuda.is_available()
    return importlib.util.find_spec(requirement) is None


def test_readme_and_docs_have_examples():
    names = [param.values[0] for param in BLOCKS]
    assert sum(name.startswith("README.md") for name in names) >= 3
    assert sum(name.startswith("docs/") for name in names) >= 3


@pytest.mark.parametrize(("name", "code"), BLOCKS)
def test_block_runs(name, code):
    requirement = REQUIRES.match(code)
    if requirement and _missing(requirement.group(1)):
        pytest.skip(f"{name} requires {requirement.group(1)}")
    # A fresh namespace per block: each must be self-contained.
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})


def test_readme_commands_are_what_ci_runs():
    readme = ROOT / "README.md"
    commands = re.findall(r"^    (python3? .*)$", readme.read_text(), re.M)
    setup, tests = commands[0], commands[1]
    ci = (ROOT / ".ci" / "run").read_text().replace(" -q", "")
    for part in setup.split(" && ")[:-1]:  # the last part runs the demo
        assert (
            part.replace("python3 -m venv .venv", "python3 -m venv .ci-venv").replace(
                ". .venv/", ". .ci-venv/"
            )
            in ci
        ), f"README's set-up step {part!r} is not in .ci/run"
    assert setup.endswith("python -m bench.train")
    assert tests in ci.splitlines(), f"README's test command {tests!r} is not in .ci/run"


def test_relative_links_point_at_files_and_headings():
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", document.read_text()):
            path, anchor = (document.parent / target[0]).resolve(), target[1]
            assert path.exists(), f"{document.name} links to missing {target[0]}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
                slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{document.name} links to missing #{anchor} in {path.name}"
