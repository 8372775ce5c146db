"""The server's load while the trace was profiled, as ``traceinspect capture`` recorded it in ``capture.json``
(``server_load.samples``: SGLang's ``/v1/loads`` or ``/metrics`` at the start of the profile window, during
it and at its end), read as run facts: ``running_requests`` (the running batch) and ``kv_tokens_in_use``
(the KV tokens the running requests hold: the KV rows a decode step reads). With data parallelism the
server's numbers are summed over its DP ranks; a rank's share is that sum / ``dp_size``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from traceinspect.model.run import Fact

SOURCE = "server_load"
# load key -> (fact, what it is)
KEYS = {"running": ("running_requests", "running requests"), "used_tokens": ("kv_tokens_in_use", "KV tokens in use")}
STEADY = 0.10  # samples within this fraction of their median: the load held through the window
DISAGREE = 0.25  # a bs=N marker this far from the server's running batch is warned about


class ServerLoad:
    """The ``server_load`` block of one ``capture.json`` (empty when there is none)."""

    def __init__(self, capture: Mapping[str, Any] | None) -> None:
        block = capture.get("server_load") if isinstance(capture, Mapping) else None
        samples = block.get("samples") if isinstance(block, Mapping) else None
        self.samples: list[Mapping[str, Any]] = [s for s in samples or [] if isinstance(s, Mapping)]
        self.problem = block.get("problem") if isinstance(block, Mapping) else None

    def __bool__(self) -> bool:
        return bool(self.samples)

    def values(self, key: str) -> list[tuple[str, float, float | None, str]]:
        """(at, value, t_s, source) of the samples that report ``key`` as a finite number >= 0."""
        out = []
        for s in self.samples:
            v = s.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                continue
            t = s.get("t_s")
            t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) else None
            out.append((str(s.get("at", "?")), float(v), t, str(s.get("source") or "?")))
        return out

    def fact(self, key: str, dp_size: int = 1) -> Fact | None:
        """The median of the samples of ``key`` (per DP rank), or None where no sample reports it.
        Confidence: medium when every sample is within :data:`STEADY` of the median and there is one DP
        rank, else low (the load moved in the window, or the ranks' shares are assumed equal)."""
        vals = self.values(key)
        if not vals or key not in KEYS:
            return None
        nums = sorted(v for _, v, _, _ in vals)
        n = len(nums)
        med = nums[n // 2] if n % 2 else (nums[n // 2 - 1] + nums[n // 2]) / 2
        steady = all(abs(v - med) <= STEADY * max(med, 1.0) for v in nums)
        dp = max(int(dp_size or 1), 1)
        value = med / dp
        shown = ", ".join(f"{_n(v)} at {at}" + (f" ({t:+.1f} s)" if t is not None else "")
                          for at, v, t, _ in (vals if n <= 4 else [vals[0], vals[-1]]))
        sources = "/".join(sorted({src for *_, src in vals}))
        detail = (f"capture.json server_load: {KEYS[key][1]} as the server reported them ({sources}) in the profile "
                  f"window, median of {n} sample(s): {shown}" + ("" if n <= 4 else f"; range {_n(nums[0])}-"
                                                                  f"{_n(nums[-1])}")
                  + (f"; / dp_size={dp} for one DP rank" if dp > 1 else "")
                  + ("" if steady else f"; the samples differ by more than {STEADY:.0%}"))
        return Fact(value, SOURCE, "medium" if steady and dp == 1 else "low", detail)


def load_facts(facts: dict[str, Fact], capture: Mapping[str, Any] | None, dp_size: int = 1) -> list[str]:
    """Add the server-load facts to ``facts`` where capture.json has them; the batch falls back to the server's
    running batch where the steps carry no ``bs=N``. Returns warnings (a marker far from the server's batch)."""
    load = ServerLoad(capture)
    if not load:
        return []
    for key, (name, _what) in KEYS.items():
        f = load.fact(key, dp_size)
        if f is not None:
            facts[name] = f
    running = facts.get("running_requests")
    batch = facts.get("batch")
    if running is None or running.value is None:
        return []
    if batch is None or batch.value is None:
        facts["batch"] = Fact(running.value, SOURCE, running.confidence,
                              f"no bs=N step annotation; {running.detail}")
        return []
    b, r = float(batch.value), float(running.value)
    if abs(b - r) > DISAGREE * max(b, r, 1.0):
        return [f"the steps' bs=N markers give a batch of {_n(b)} but the server reported {_n(r)} running requests "
                f"per rank while the trace was profiled (capture.json server_load); the markers' {_n(b)} is used"]
    return []


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"
