"""A bounded, seeded atheris run of the native scanner's differential fuzzer (benchmarks/fuzz_native.py): a\nfixed number of inputs from a fixed seed, the same on every machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT
from test_native import _require_native

pytest.importorskip("atheris")


def test_fuzz_smoke(tmp_path) -> None:
    _require_native()
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz_native.py"), "-runs=2000",
                        "-seed=1", "-rss_limit_mb=4096", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done" in r.stderr and "runs" in r.stderr, r.stderr[-2000:]
