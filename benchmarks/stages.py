"""Where the time of ``analyze`` and ``report`` goes, stage by stage, in fresh processes.

Each run is a new interpreter that does what the command does (set the memory settings of one large read,
import the pipeline, run the stages, build the document; for ``report``, write the HTML and the merged
Perfetto trace, as ``report --perfetto`` does), with every
pipeline stage timed: wall seconds, and CPU seconds of all this process's threads. Cache off. The table gives the median over ``--repeat`` runs of each
stage, for the benchmark's 114 MB rank file (``analyze``) and its 8 x 122 MB set (``report``)::

    python benchmarks/stages.py --work /tmp/benchwork                # after bench.py made the traces
    python benchmarks/stages.py --work /tmp/benchwork --write-readme # the table of benchmarks/README.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench  # noqa: E402 - the benchmark's trace builder and README writer

MARK_START, MARK_END = "<!-- bench:stages:start -->", "<!-- bench:stages:end -->"
STAGES = [("start", "start-up: interpreter, imports"),
          ("load", "load: the rest of the read, tables, link"), ("steps", "steps"), ("classify", "classify"),
          ("select", "step selection and the analysis record"), ("measure", "measure (GEMM, memory, collectives, host activity)"),
          ("judge", "judge (rules)"), ("whatif", "what-if (the fixes' replays)"), ("document", "document (the JSON contract)"),
          ("html", "HTML report"), ("perfetto", "merged Perfetto trace (`--perfetto`, gzipped)"),
          ("total", "whole process")]

CHILD = r"""
import gc, json, sys, time
w0, c0 = time.perf_counter(), time.process_time()
out = {}
path, html = sys.argv[1], sys.argv[2]
gc.disable()  # as the command line does, with pyarrow hidden from pandas
from traceinspect.cli import hide_pyarrow_from_pandas
hide_pyarrow_from_pandas()
from traceinspect.load import memory_settings
memory_settings()
import traceinspect.pipeline as p
out["start"] = [time.perf_counter() - w0 + float(sys.argv[3]), time.process_time() - c0]

def timed(name, f):
    def g(*a, **k):
        w, c = time.perf_counter(), time.process_time()
        try:
            return f(*a, **k)
        finally:
            prev = out.get(name, [0.0, 0.0])
            out[name] = [prev[0] + time.perf_counter() - w, prev[1] + time.process_time() - c]
    return g

for name in ("load", "steps", "classify", "measure", "judge", "whatif"):
    setattr(p, name, timed(name, getattr(p, name)))
p.select = timed("select", p.select)
p.record = timed("select", p.record)
a = p.analyze([path], use_cache=False)
doc = timed("document", a.to_json)(report=html != "-")
if html != "-":
    from traceinspect.render.html import write_html
    timed("html", write_html)(doc, html)
    from traceinspect.render.perfetto import write_perfetto
    timed("perfetto", write_perfetto)(a, html + ".trace.json.gz", doc)
out["total"] = [time.perf_counter() - w0 + float(sys.argv[3]), time.process_time() - c0]
print(json.dumps(out))
"""


def _run(path: Path, html: str) -> dict[str, list[float]]:
    env = {**os.environ, "TRACEINSPECT_CACHE": "off", "PYTHONPATH": str(ROOT)}  # this checkout
    # the interpreter's own start-up, before the child's first line: timed from outside, added to start
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
    boot = time.perf_counter() - t
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), html, f"{boot:.6f}"], check=True, env=env,
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(path: Path, html: str, repeat: int) -> dict[str, dict[str, float]]:
    runs = [_run(path, html) for _ in range(repeat)]
    return {k: {"wall_s": round(statistics.median(r.get(k, [0.0, 0.0])[0] for r in runs), 3),
                "cpu_s": round(statistics.median(r.get(k, [0.0, 0.0])[1] for r in runs), 3)} for k, _ in STAGES}


def table(res: dict[str, Any]) -> str:
    cases = res["cases"]
    head = "| stage | " + " | ".join(f"{c['label']}: wall s | CPU s" for c in cases.values()) + " |"
    out = [head, "| --- |" + " --: | --: |" * len(cases)]
    for key, label in STAGES:
        cells = []
        for c in cases.values():
            s = c["stages"].get(key)
            cells += ["", ""] if s is None or (key in ("html", "perfetto") and not c["html"]) else [f"{s['wall_s']:.2f}",
                                                                                      f"{s['cpu_s']:.2f}"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"{res['date']}, `python benchmarks/stages.py{res['args']}`: {res['machine']['cores']} cores, "
               f"median of {res['repeat']} fresh processes per case, cache off; load average "
               f"{res['load_average'][0]} at the start, {res['load_average'][1]} at the end. CPU seconds count "
               "every thread of the process (the inflate and hash threads). Generated by the benchmark; not edited by "
               "hand.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="bench.py's work directory (traces made if missing; default: a "
                                               "temporary one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hta-mb", type=float, default=114.0)
    ap.add_argument("--rank-mb", type=float, default=122.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one run: runs everything")
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hta_mb, args.rank_mb, args.ranks, args.repeat = 3.0, 2.0, 2, 1
    work = args.work or Path(tempfile.mkdtemp(prefix="ti-stages-"))
    gen = work / "gen"
    hta, ranks = work / "hta", work / "ranks"
    bench.make_set(bench.DEFAULT_SOURCE, hta, args.hta_mb, 1, gen)  # made once per size (kept in gen)
    bench.make_set(bench.DEFAULT_SOURCE, ranks, args.rank_mb, args.ranks, gen)
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-readme"]
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "args": "".join(f" {a}" for a in shown), "machine": bench._machine(),
                           "repeat": args.repeat, "load_average": [bench._load()], "cases": {}}
    f = next(hta.glob("*.trace.json.gz"))
    res["cases"]["hta"] = {"label": f"`analyze`, one {args.hta_mb:g} MB rank file", "html": False,
                           "stages": measure(f, "-", args.repeat)}
    with tempfile.TemporaryDirectory() as td:
        res["cases"]["ranks"] = {"label": f"`report`, {args.ranks} x {args.rank_mb:g} MB rank files", "html": True,
                                 "stages": measure(ranks, str(Path(td) / "report.html"), args.repeat)}
    res["load_average"].append(bench._load())
    print(json.dumps(res, indent=2))
    text = table(res)
    print(text, file=sys.stderr)
    if args.write_readme and not args.smoke:
        readme = bench.README.read_text()
        if MARK_START in readme and MARK_END in readme:
            a, b = readme.index(MARK_START), readme.index(MARK_END) + len(MARK_END)
            bench.README.write_text(readme[:a] + f"{MARK_START}\n{text}\n{MARK_END}" + readme[b:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
