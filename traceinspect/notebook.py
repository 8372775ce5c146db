"""The notebook API: ``traceinspect.analyze(path)`` returns an :class:`Analysis` whose accessors are
pandas DataFrames (``kernels``, ``steps``, ``classes``, ``gemm``, ``findings``, ``ops``), with the same
numbers as the CLI's outputs (shares are of the step time, times in microseconds)::

    import traceinspect
    a = traceinspect.analyze("traces/")
    a.findings                      # one row per finding, most severe first, then by saving
    a.classes.head()                # time per class per step
    a.kernels.groupby("cls")["dur_us"].sum()
    a.html("report.html")           # the HTML report; a.to_json() is the JSON contract
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis as PipelineResult
    from traceinspect.analysis import Options


class Analysis:
    """One analysed trace set. The pipeline's own result is ``.result``; other attributes of it
    (``trace``, ``options``, ``efficiency``, ...) are reachable from here too."""

    def __init__(self, result: PipelineResult) -> None:
        self.result = result

    def __getattr__(self, name: str) -> Any:
        if name == "result":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.result, name)

    def __repr__(self) -> str:
        doc = self.to_json()
        lead = (self.findings["rule"].iloc[0] if len(self.findings) else "no findings")
        return (f"<traceinspect.Analysis {doc['run']['ranks']} rank(s), {doc['steps']['count']} "
                f"{doc['steps']['phase']} step(s) per rank, lead: {lead}>")

    def to_json(self) -> dict[str, Any]:
        """The ``traceinspect.analysis/1`` document (computed once)."""
        return self._doc

    @cached_property
    def _doc(self) -> dict[str, Any]:
        return self.result.to_json()

    @cached_property
    def _tables(self) -> dict[str, pd.DataFrame]:
        from traceinspect.render.tables import report_tables

        return report_tables(self.to_json())

    @cached_property
    def kernels(self) -> pd.DataFrame:
        """One row per GPU activity (kernel, memcpy, memset) of the analysed steps: rank, step, stream,
        name, cls, start_us / dur_us (the rank's clock), op (the launching CPU op, '' when none),
        graph_replay."""
        k = self.result.kernels
        return pd.DataFrame({
            "rank": k["rank"].to_numpy(), "step": k["step"].to_numpy(), "stream": k["stream"].to_numpy(),
            "kind": k["kind"].astype(str).to_numpy(), "name": k["name"].astype(str).to_numpy(),
            "cls": k["cls"].astype(str).to_numpy(), "start_us": k["ts"].to_numpy(), "dur_us": k["dur"].to_numpy(),
            "op": k["op_name"].astype(str).to_numpy(), "graph_replay": k["graph_replay"].to_numpy(),
        })

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per analysed step per rank: GPU window, span, busy and idle time, batch size."""
        cols = ["rank", "idx", "phase", "bs", "source", "gpu_start", "gpu_end", "span_us", "busy_us", "idle_us",
                "kernel_us", "n_kernels"]
        s = self.result.selected
        return s[[c for c in cols if c in s.columns]].rename(columns={"idx": "step"}).reset_index(drop=True)

    @cached_property
    def classes(self) -> pd.DataFrame:
        """One row per kernel class: time and calls per rank per step, share of the step time and of
        all kernel time."""
        from traceinspect.render.story import share_of_step

        doc = self.to_json()
        rows = [{"cls": c, "us_per_step": v.get("us_per_step"), "share_of_step": share_of_step(v, doc),
                 "share_of_kernel_time": v.get("share"), "calls_per_step": v.get("calls_per_step")}
                for c, v in (doc.get("classes") or {}).items()]
        df = pd.DataFrame(rows, columns=["cls", "us_per_step", "share_of_step", "share_of_kernel_time",
                                         "calls_per_step"])
        return df.sort_values("us_per_step", ascending=False).reset_index(drop=True)

    @property
    def gemm(self) -> pd.DataFrame:
        """One row per GEMM op and shape: dtype, M/N/K, calls, time per step, TFLOP/s, % of peak."""
        return self._tables["gemm"]

    @property
    def ops(self) -> pd.DataFrame:
        """One row per launching CPU op: kernels, calls, time per step, share of the step."""
        return self._tables["ops"]

    @property
    def kernel_table(self) -> pd.DataFrame:
        """One row per kernel name: class, launching op, calls, time, share of the step."""
        return self._tables["kernels"]

    @cached_property
    def findings(self) -> pd.DataFrame:
        """One row per finding, in the order every output uses (severity, then estimated saving)."""
        from traceinspect.render.story import saving_share, story

        doc = self.to_json()
        rows = [{"rule": f["rule"], "severity": f["severity"], "title": f["title"],
                 "saving_us_per_step": f.get("est_saving_us_per_step"), "saving_share": saving_share(f, doc),
                 "share": f.get("share"), "ranks": f.get("ranks"), "message": f["message"],
                 "remediation": f.get("remediation"), "evidence": f.get("evidence")}
                for f in story(doc).findings]
        return pd.DataFrame(rows, columns=["rule", "severity", "title", "saving_us_per_step", "saving_share", "share",
                                           "ranks", "message", "remediation", "evidence"])

    def html(self, path: str | Path) -> Path:
        """Write the HTML report."""
        from traceinspect.render.html import write_html

        return write_html(self.to_json(), path)

    def markdown(self) -> str:
        """The Markdown summary."""
        from traceinspect.render.markdown import render_markdown

        return render_markdown(self.to_json())

    def csv(self, out_dir: str | Path) -> list[Path]:
        """Write kernels.csv, gemm.csv and ops.csv (as ``analyze --csv DIR``)."""
        from traceinspect.render.tables import write_csv

        return write_csv(self._tables, out_dir)


def analyze(paths: Sequence[str | Path] | str | Path, options: Options | None = None, **kw: Any) -> Analysis:
    """Analyse a trace set (a directory, rank files or globs); keyword arguments are
    :class:`traceinspect.analysis.Options` fields (``phase``, ``server_info``, ``jobs``, ...)."""
    from traceinspect.pipeline import analyze as run

    return Analysis(run(paths, options, **kw))
