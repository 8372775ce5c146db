"""A real (non-editable) install of the wheel ``pip wheel .`` builds: the installed package finds its shipped
rules, data tables and rule fixtures from any directory, and ``traceinspect rules test`` passes there. The
wheel ships exactly the fixture sets the shipped rules name, and stays small."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so", ".pytest_cache", ".ruff_cache")


MAX_WHEEL_BYTES = 5_000_000


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "traceinspect"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(src)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"pip wheel . failed: {r.stderr[-2000:]}")
    (whl,) = out.glob("traceinspect-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"pip install of the wheel failed: {r.stderr[-2000:]}")
    return target


def _named() -> tuple[set[str], set[str]]:
    """The fixture sets (``fixtures/...``) the shipped rules name in their ``tests``, and the model config files
    those entries analyse them with (``DIR --model-config FILE``)."""
    from traceinspect.judge import load_rule_set
    from traceinspect.judge.rule import split_test

    entries = [split_test(w) for r in load_rule_set() for kind in ("fires", "silent", "undecided")
               for w in r.tests.get(kind, [])]
    return {d for d, _ in entries}, {mc for _, mc in entries if mc is not None}


def test_the_wheel_ships_the_rules_fixture_sets_and_nothing_else(wheel: Path) -> None:
    assert wheel.stat().st_size < MAX_WHEEL_BYTES, f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    sets, configs = _named()
    assert configs, "a rule test analyses a set with a model config"
    files = {n.removeprefix("traceinspect/") for n in names if n.startswith("traceinspect/fixtures/")}
    assert configs <= files
    shipped = {n.rsplit("/", 1)[0].removesuffix("/graph_capture_profile") for n in files - configs}
    assert shipped == sets
    for d in shipped:  # whole sets: every rank file, server_info, manifest, capture traces
        here = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / d).rglob("*") if p.is_file())
        assert sorted(n.removeprefix("traceinspect/") for n in names
                      if n.startswith(f"traceinspect/{d}/")) == here, d
    assert not [n for n in names if n.endswith((".c", ".pyc", ".md", ".py")) and "/fixtures/" in n]
    assert "traceinspect/rules/tables/kernel_classes.yaml" in names


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
    r = _run(installed, tmp_path, "rules", "test")  # no --allow-missing: every named set is there
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " 0 failed, 0 skipped" in r.stdout and "fires on fixtures/" in r.stdout
    for d in _named()[0]:
        assert f"on {d}" in r.stdout, d


def test_installed_analyze_of_a_shipped_fixture(installed: Path, tmp_path: Path) -> None:
    fixture = installed / "traceinspect" / "fixtures" / "tp1-l6-full-graph"
    r = _run(installed, tmp_path, "analyze", str(fixture), "--no-cache", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kv-full-pool-cast" in (tmp_path / "a.json").read_text()
