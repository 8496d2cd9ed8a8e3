"""The packages' import graph, read from the source: no circle, and offload and muon apart."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "muon", "muon_offload")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (function bodies and
    `TYPE_CHECKING` blocks included): `from a import b` is module a.b if there is
    one, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        for target in sorted(graph[node]):
            if found := visit(target):
                return found
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if found := visit(node):
            return found
    return None


def test_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_relative_and_lazy_imports_are_edges(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n    from .c import g\n")
    modules = {"pkg": package / "__init__.py", "pkg.a": package / "a.py"}
    modules.update({f"pkg.{m}": package / f"{m}.py" for m in ("b", "c")})
    assert _imports("pkg.a", package / "a.py", modules) == {"pkg.b", "pkg.c"}


def test_no_import_circle():
    graph = _graph()
    assert "muon.newton_schulz" in graph and graph["muon.optimizer"], "the walk found no imports"
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_offload_and_muon_do_not_import_each_other():
    for name, targets in _graph().items():
        package = name.split(".")[0]
        other = {"offload": "muon", "muon": "offload"}.get(package)
        crossing = sorted(t for t in targets if t.split(".")[0] == other)
        assert not crossing, f"{name} imports {crossing}: {package} must not import {other}"
