"""The package's layering: the import-linter contracts of pyproject.toml hold, the import graph has no cycle
(imports inside functions included), and loading a trace imports no judge, document or renderer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in adj:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(adj[v]):
                work.append((v, i + 1))
                w = adj[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    class Graph:
        modules = {"a", "b", "c", "d"}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}[m]

    assert _cycles(Graph()) == [["a", "b", "c"]]  # type: ignore[arg-type]


def test_no_import_cycle() -> None:
    # grimp counts imports inside functions too; imports under `if TYPE_CHECKING:` only name types
    graph = grimp.build_graph("traceinspect", include_external_packages=False, exclude_type_checking_imports=True,
                              cache_dir=None)
    assert _cycles(graph) == []


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
