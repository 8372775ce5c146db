"""``class`` metrics: one subject per kernel class, declared beside their computation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from traceinspect.judge.metrics.registry import Subject, class_ids, declare

if TYPE_CHECKING:
    import pandas as pd

declare("class", "class_name", "text", "Kernel class id of the subject (see rules/tables/kernel_classes.yaml).")
declare("class", "class_us_per_step", "us", "GPU time of the class per rank per step.")
declare("class", "class_share", "ratio", "Share of all GPU time of the analysed steps.")
declare("class", "class_calls_per_step", "count", "Calls of the class per rank per step.")


class ClassMetrics:
    """The ``class`` scope of :class:`~traceinspect.judge.metrics.MetricContext`."""

    k: pd.DataFrame
    run: dict[str, Any]

    def class_subjects(self, classes: Sequence[str] | None) -> list[Subject]:
        out = []
        for c in classes or class_ids():
            us = self.run.get(f"cls_{c}_us_per_step")
            if not us:
                continue
            v = {"class_name": c, "class_us_per_step": us, "class_share": self.run.get(f"cls_{c}_share"),
                 "class_calls_per_step": self.run.get(f"cls_{c}_calls_per_step")}
            ranks = sorted(int(r) for r in self.k.loc[self.k["cls"] == c, "rank"].unique())
            out.append(Subject("class", c, v, ranks, classes=(c,)))
        return out

