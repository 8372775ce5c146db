"""A real (non-editable) ``pip install .``: the installed package finds its shipped rules, data tables and
rule fixtures from any directory, and ``traceinspect rules test`` passes there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so", ".pytest_cache", ".ruff_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "traceinspect"
    shutil.copytree(ROOT, src, ignore=SKIP)
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-compile", "--target", str(target), str(src)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.fail(f"pip install . failed: {r.stderr[-2000:]}")
    return target


def _run(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    return subprocess.run([sys.executable, "-m", "traceinspect", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_installed_package_is_the_one_run(installed: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    r = subprocess.run([sys.executable, "-c", "import traceinspect, traceinspect.resources as R; "
                        "print(traceinspect.__file__); print(R.rules_dir())"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, check=True)
    where, rules = r.stdout.split()
    assert Path(where).is_relative_to(installed) and Path(rules).is_relative_to(installed)
    assert (Path(rules) / "tables" / "kernel_classes.yaml").is_file() and any(Path(rules).glob("*.yaml"))


def test_rules_test_runs_from_any_directory(installed: Path, tmp_path: Path) -> None:
    r = _run(installed, tmp_path, "rules", "test", "--only", "small-m-gemm", "--only", "kv-full-pool-cast")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 failed" in r.stdout and "fires on fixtures/" in r.stdout


def test_installed_analyze_of_a_shipped_fixture(installed: Path, tmp_path: Path) -> None:
    fixture = installed / "traceinspect" / "fixtures" / "tp1-l6-full-graph"
    r = _run(installed, tmp_path, "analyze", str(fixture), "--no-cache", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kv-full-pool-cast" in (tmp_path / "a.json").read_text()
