"""The package's layering: the import-linter contracts of pyproject.toml hold, the import graph has no cycle
(imports inside functions and under ``if TYPE_CHECKING:`` included), no stage imports a later one, and loading
a trace imports no judge, document or renderer."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grimp
import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    g = nx.DiGraph((m, d) for m in graph.modules for d in graph.find_modules_directly_imported_by(m))
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_cycle_finder_finds_a_cycle() -> None:
    class Graph:
        modules = {"a", "b", "c", "d"}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}[m]

    assert _cycles(Graph()) == [["a", "b", "c"]]  # type: ignore[arg-type]


def test_no_import_cycle() -> None:
    # grimp counts imports inside functions too, and those under `if TYPE_CHECKING:`
    graph = grimp.build_graph("traceinspect", include_external_packages=False, exclude_type_checking_imports=False,
                              cache_dir=None)
    assert _cycles(graph) == []


# the stages, earliest first: a stage imports only earlier ones (and the shared modules below them all)
STAGES = ["model", "load", "link", "steps", "classify", "measure", "judge", "whatif", "document", "analysis",
          "pipeline", "render", "gate", "notebook", "capture", "commands", "cli"]
SHARED = ["errors", "fileio", "resources", "saferegex", "tables", "units", "version"]  # below the model


class _Graph:
    """The import graph of a package's modules read with ``ast``: every ``import`` and ``from ... import``
    statement, wherever it is (inside functions, under ``if TYPE_CHECKING:``)."""

    def __init__(self, root: Path) -> None:
        self.package = root.name
        self.modules: dict[str, Path] = {}
        for p in sorted(root.rglob("*.py")):
            parts = list(p.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.modules[".".join(parts)] = p
        # a C extension (built from its .c source beside the modules) imports nothing of the package: a leaf
        self.extensions = {".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.c")}
        self.edges = {m: set(self._imports(m, p)) for m, p in self.modules.items()}
        self.edges.update({x: set() for x in self.extensions})

    def _imports(self, module: str, path: Path) -> Iterable[str]:
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in self.modules and name not in self.extensions:  # a name in a module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    yield name

    def unit(self, module: str) -> str:
        """The stage package or top-level module a module belongs to (a C extension: itself)."""
        if module in self.extensions:
            return module
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    def unit_edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for m, targets in self.edges.items():
            out.setdefault(self.unit(m), set()).update(self.unit(t) for t in targets if self.unit(t) != self.unit(m))
        return out


class _Adj:
    """An adjacency mapping as the graph :func:`_cycles` reads."""

    def __init__(self, edges: dict[str, set[str]]) -> None:
        self.edges = edges
        self.modules = set(edges) | {t for ts in edges.values() for t in ts}

    def find_modules_directly_imported_by(self, m: str) -> set[str]:
        return self.edges.get(m, set())


def _package_graph() -> _Graph:
    return _Graph(ROOT / "traceinspect")


def test_no_cycle_between_stages_type_imports_included() -> None:
    g = _package_graph()
    assert _cycles(_Adj(g.unit_edges())) == []  # type: ignore[arg-type]
    assert _cycles(_Adj(g.edges)) == []  # type: ignore[arg-type]  (nor between the modules of one stage)


def test_no_stage_imports_a_later_stage() -> None:
    g = _package_graph()
    rank = {u: i for i, u in enumerate(STAGES)} | {u: -1 for u in SHARED}
    units = set(g.unit_edges()) - {"traceinspect", "__main__"} - g.extensions
    assert units <= set(rank), f"stage order unknown for {sorted(units - set(rank))}"
    late = sorted((m, t) for m, ts in g.edges.items() for t in ts
                  if g.unit(m) in rank and g.unit(t) in rank and rank[g.unit(t)] > rank[g.unit(m)])
    assert late == []


def test_the_graph_reader_sees_type_only_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n")
    (pkg / "b.py").write_text("def f():\n    from .a import thing\n")
    g = _Graph(pkg)
    assert g.edges["pkg.a"] == {"pkg.b"} and g.edges["pkg.b"] == {"pkg.a"}
    assert _cycles(_Adj(g.unit_edges())) == [["a", "b"]]  # type: ignore[arg-type]


def test_layer_contracts() -> None:
    from importlinter.cli import lint_imports

    cwd = Path.cwd()
    os.chdir(ROOT)  # the contracts are read from ./pyproject.toml
    try:
        assert lint_imports(no_cache=True) == 0
    finally:
        os.chdir(cwd)


def test_loading_imports_no_judge_or_renderer() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import traceinspect.load"], capture_output=True,
                       text=True, env=_env(), cwd=ROOT, check=True)
    mods = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    ours = [m for m in mods if m.startswith("traceinspect")]
    assert "traceinspect.load" in ours
    late = [m for m in ours if m.split(".")[1:2] in (["judge"], ["render"], ["gate"], ["analysis"], ["document"])]
    assert late == []


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in (ROOT / "traceinspect").rglob("*.py")}
    assert len(sizes) > 100
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# each stage's module: its docstring says what it takes and what it gives, one line each
STAGE_MODULES = ["model/__init__.py", "load/__init__.py", "link.py", "steps/__init__.py", "classify/__init__.py",
                 "measure/__init__.py", "judge/__init__.py", "whatif/__init__.py", "document/__init__.py",
                 "pipeline.py", "render/__init__.py"]


def test_each_stage_says_its_inputs_and_outputs() -> None:
    for rel in STAGE_MODULES:
        doc = ast.get_docstring(ast.parse((ROOT / "traceinspect" / rel).read_text(encoding="utf-8"))) or ""
        lines = doc.splitlines()
        said = [i for i, line in enumerate(lines) if line.startswith(("Inputs: ", "Outputs: "))]
        assert len(said) == 2 and said[1] == said[0] + 1 and lines[said[0]].startswith("Inputs: "), rel
