"""Two checkouts of traceinspect on the benchmark's traces, paired in one run: is a change as fast as what
it replaced?

    python benchmarks/compare.py --base /path/to/other/checkout --work /tmp/benchwork
    python benchmarks/compare.py --base ../old --cases small,hta --repeat 5
    python benchmarks/compare.py --base ../old --mixes eager,cpu-heavy,graph --write-readme

Each case alternates the two checkouts' ``python -m traceinspect`` (each checkout first on its own
``PYTHONPATH``, byte-compiled as ``pip install`` does), ``--repeat`` times, cache off, on the traces
``bench.py`` makes (made here if ``--work`` does not have them yet): ``small`` (``analyze`` of 5 MB),
``hta`` (``analyze`` of 114 MB), ``big`` (``analyze`` of 1 GB of plain JSON) and ``ranks`` (``report``
of 8 rank files), each on every event mix of ``--mixes`` (``bench.MIXES``). Prints, per case, min and median wall time, median CPU time and peak RSS of both,
and the ratio of the medians (this checkout over the base); ``--json`` writes them. The exit status is
1 when a case's median wall time or peak RSS is more than ``--tolerance`` (default 5%) over the base's.
``--write-readme`` writes the table of the run into benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the benchmark's trace maker and runner

ROOT = bench.ROOT
MARK_START, MARK_END = "<!-- bench:mixes:start -->", "<!-- bench:mixes:end -->"
CASE_TEXT = {"small": "`analyze`, one 5 MB rank file", "hta": "`analyze`, one 114 MB rank file",
             "big": "`analyze`, one 1 GB rank file (plain JSON)", "ranks": "`report`, 8 rank files of 122 MB"}
SIZES = {"small": ("small_mb", 5.0, 1, False), "hta": ("hta_mb", 114.0, 1, False),
         "big": ("big_mb", 1000.0, 1, True), "ranks": ("rank_mb", 122.0, 8, False)}


def _env(checkout: Path) -> dict[str, str]:
    return {**bench._ENV, "PYTHONPATH": str(checkout)}


# the directory the runs start in: not a checkout, whose own package `python -m` would import first
# (the current directory comes before PYTHONPATH on sys.path)
NEUTRAL = Path(tempfile.gettempdir())


def _imported(checkout: Path) -> Path:
    """Where a run with ``_env(checkout)`` imports traceinspect from."""
    r = subprocess.run([sys.executable, "-c", "import traceinspect; print(traceinspect.__file__)"],
                       env=_env(checkout), cwd=NEUTRAL, capture_output=True, text=True, check=True)
    return Path(r.stdout.strip()).resolve().parent.parent


def _command(case: str, target: Path, out: Path) -> list[str]:
    if case == "ranks":
        return bench._ti("report", str(target), "-o", str(out), "--no-cache")
    return bench._ti("analyze", str(target), "--no-cache", "--quiet")


def _target(case: str, work: Path, gen: Path, source: Path, scale: float = 1.0) -> Path:
    _, mb, ranks, plain = SIZES[case]
    mb *= scale
    d = work / case
    bench.make_set(source, d, mb, ranks, gen, plain=plain)
    if case == "ranks":
        return d
    return next(d.glob("*.trace.json" if plain else "*.trace.json.gz"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (its repository root)")
    ap.add_argument("--cases", default="small,hta,big,ranks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where the traces are kept (default: a temp dir)")
    ap.add_argument("--mixes", default="eager", help=f"event mixes, comma-separated ({', '.join(bench.MIXES)})")
    ap.add_argument("--source", type=Path, default=None, help="replicate this fixture instead of --mixes")
    ap.add_argument("--write-readme", action="store_true", help="write the run's table into benchmarks/README.md")
    ap.add_argument("--scale", type=float, default=1.0, help="rank file sizes times this (a quick look)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    base = args.base.resolve()
    if not (base / "traceinspect" / "__init__.py").is_file():
        ap.error(f"{base}: not a traceinspect checkout (no traceinspect/__init__.py)")
    cases = [c for c in args.cases.split(",") if c]
    mixes = {"source": args.source} if args.source else {m: bench.MIXES.get(m) for m in args.mixes.split(",") if m}
    if None in mixes.values():
        ap.error(f"unknown mix(es) in {args.mixes} (known: {', '.join(bench.MIXES)})")
    unknown = set(cases) - set(SIZES)
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))} (known: {', '.join(SIZES)})")
    for checkout in (ROOT, base):
        compileall.compile_dir(checkout / "traceinspect", quiet=1)
        if _imported(checkout) != checkout.resolve():
            ap.error(f"a run meant for {checkout} imports traceinspect from {_imported(checkout)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="ti-compare-"))
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-readme"]
    res: dict[str, Any] = {"this": str(ROOT), "base": str(base), "repeat": args.repeat, "cases": {},
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "args": "".join(f" {a}" for a in shown), "machine": bench._machine()}
    slower = []
    for mix, source in mixes.items():
        gen = work / mix / "gen"
        gen.mkdir(parents=True, exist_ok=True)
        for case in cases:
            target = _target(case, work / mix, gen, source, args.scale)
            out = work / f"compare-{case}.html"
            load0 = bench._load()
            this_runs, base_runs = [], []
            for _ in range(args.repeat):  # alternated, so drift in the machine's load falls on both
                base_runs.append(bench.run(_command(case, target, out), env=_env(base), cwd=NEUTRAL))
                this_runs.append(bench.run(_command(case, target, out), env=_env(ROOT), cwd=NEUTRAL))
            this, other = bench._stats(this_runs), bench._stats(base_runs)
            ratio = this["median_s"] / other["median_s"]
            rss = this["peak_rss_mb"] / other["peak_rss_mb"]
            res["cases"][f"{mix}/{case}"] = {"mix": mix, "case": case, "this": this, "base": other,
                                             "time_ratio": round(ratio, 3), "rss_ratio": round(rss, 3),
                                             "load_average": [load0, bench._load()]}
            print(f"{mix:9s} {case:6s} this {this['median_s']:7.2f} s (min {this['min_s']:.2f}, "
                  f"cpu {this['cpu_median_s']:.2f}, {this['peak_rss_mb']:.0f} MB)  base {other['median_s']:7.2f} s "
                  f"(min {other['min_s']:.2f}, cpu {other['cpu_median_s']:.2f}, {other['peak_rss_mb']:.0f} MB)  "
                  f"time x{ratio:.3f}  rss x{rss:.3f}", flush=True)
            if ratio > 1 + args.tolerance or rss > 1 + args.tolerance:
                slower.append(f"{mix}/{case}")
    res["slower"] = slower
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.write_readme:
        text = bench.README.read_text()
        block = f"{MARK_START}\n{table(res)}\n{MARK_END}"
        if MARK_START in text and MARK_END in text:
            a, b = text.index(MARK_START), text.index(MARK_END) + len(MARK_END)
            bench.README.write_text(text[:a] + block + text[b:])
    return 1 if slower else 0


def table(res: dict[str, Any]) -> str:
    """The run as a Markdown table: per event mix and case, both checkouts' wall time and peak RSS."""
    rows = ["| mix | case | this checkout: wall s (median, min), peak RSS | base: wall s (median, min), peak RSS "
            "| time ratio |", "| --- | --- | --- | --- | --: |"]
    for c in res["cases"].values():
        t, b = c["this"], c["base"]
        rows.append(f"| {c['mix']} | {CASE_TEXT[c['case']]} | {t['median_s']:.2f}, {t['min_s']:.2f}, "
                    f"{t['peak_rss_mb']:.0f} MB | {b['median_s']:.2f}, {b['min_s']:.2f}, {b['peak_rss_mb']:.0f} MB "
                    f"| {c['time_ratio']:.2f} |")
    m = res["machine"]
    return "\n".join(rows) + (
        f"\n\n{res['date']}, `python benchmarks/compare.py{res['args']}`: {m['cores']} cores ({m['cpu']}), "
        f"Python {m['python']}, native scanner {'built' if m['native_scanner'] else 'NOT built'}; {res['repeat']} "
        "paired runs per case, cache off. Generated by the benchmark from its latest run; not edited by hand.")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
