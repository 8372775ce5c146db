"""Golden outputs: the JSON, Markdown, HTML and terminal text ``analyze`` writes for every fixture set.

``render(fixture, out)`` runs ``python -m traceinspect analyze`` on a fixture set and returns its outputs
normalised (the output directory and the generation time replaced by placeholders). The stored copies under
``tests/golden/<set>/`` are compared with them by ``tests/test_golden.py``; ``update.py`` rewrites them.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
OUTPUTS = ("analysis.json", "summary.md", "report.html", "terminal.txt")
_GENERATED = re.compile(r"generated \d{4}-\d\d-\d\d \d\d:\d\d UTC")


def fixture_sets() -> list[Path]:
    """Every fixture set (a directory with a manifest.json) under fixtures/, in a stable order."""
    return sorted(p.parent for p in (ROOT / "fixtures").rglob("manifest.json"))


def set_name(fixture: Path) -> str:
    return fixture.relative_to(ROOT / "fixtures").as_posix().replace("/", "__")


def render(fixture: Path, out: Path) -> dict[str, str]:
    """Analyse ``fixture`` into ``out`` and return each output, normalised."""
    out.mkdir(parents=True, exist_ok=True)
    rel = fixture.relative_to(ROOT).as_posix()
    cmd = [sys.executable, "-m", "traceinspect", "analyze", rel, "--no-cache",
           "--json", str(out / "analysis.json"), "--html", str(out / "report.html"),
           "--markdown", str(out / "summary.md")]
    env = {**os.environ, "COLUMNS": "120", "TRACEINSPECT_CACHE": "off"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{rel}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    (out / "terminal.txt").write_text(proc.stdout)
    texts = {}
    for name in OUTPUTS:
        text = (out / name).read_text()
        text = text.replace(str(out), "OUT")
        texts[name] = _GENERATED.sub("generated TIME", text)
    return texts


def report_from_json(out: Path) -> dict[str, str]:
    """``traceinspect report OUT/analysis.json``'s HTML and Markdown (written by :func:`render` before),
    normalised as :func:`render` normalises them."""
    cmd = [sys.executable, "-m", "traceinspect", "report", str(out / "analysis.json"),
           "-o", str(out / "from-json.html"), "--markdown", str(out / "from-json.md")]
    env = {**os.environ, "COLUMNS": "120", "TRACEINSPECT_CACHE": "off"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"report {out / 'analysis.json'}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return {name: _GENERATED.sub("generated TIME", (out / src).read_text().replace(str(out), "OUT"))
            for name, src in (("report.html", "from-json.html"), ("summary.md", "from-json.md"))}


def stored(fixture: Path) -> dict[str, str]:
    d = GOLDEN / set_name(fixture)
    return {name: gzip.decompress((d / f"{name}.gz").read_bytes()).decode() for name in OUTPUTS}


def store(fixture: Path, texts: dict[str, str]) -> None:
    d = GOLDEN / set_name(fixture)
    d.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        # mtime=0 keeps the stored bytes identical when the text is
        (d / f"{name}.gz").write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
