"""Which rank files a capture expects, and waiting until each one is on disk and complete.

SGLang writes one file per scheduler process:
``{prefix-}{profile_id}-TP-{r}[-DP-{d}][-PP-{p}][-EP-{e}][-EXTEND|-DECODE].trace.json.gz``, with the
DP/PP/EP parts only where that size is > 1. A file counts as complete when its size and mtime have
not changed for a while and it reads to the end as gzip holding a JSON object.
"""

from __future__ import annotations

import gzip
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceinspect.model.run import ServerInfo

# The analyzer's name pattern (traceinspect.load.discover.SGLANG_NAME; a test keeps the two equal),
# repeated here so that capturing does not import the analyzer's table stack.
SGLANG_NAME = re.compile(
    r"^(?P<stem>.*?)-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?(?:-EP-(?P<ep>\d+))?"
    r"(?:-(?P<stage>EXTEND|DECODE|prefill|decode))?(?:\.pt)?\.trace\.json(?:\.gz)?$"
)


@dataclass(frozen=True, order=True)
class RankKey:
    """One scheduler process, as its file name identifies it."""

    dp: int | None
    pp: int | None
    tp: int
    ep: int | None = field(default=None, compare=False)

    @property
    def match(self) -> tuple[int | None, int | None, int]:
        return (self.dp, self.pp, self.tp)

    @property
    def label(self) -> str:
        s = f"TP-{self.tp}"
        if self.dp is not None:
            s += f"-DP-{self.dp}"
        if self.pp is not None:
            s += f"-PP-{self.pp}"
        if self.ep is not None:
            s += f"-EP-{self.ep}"
        return s


def expected_ranks(info: dict[str, Any]) -> list[RankKey]:
    """The rank files a server with this ``server_info`` writes for one capture.

    ``dp_size`` counts replicas (each with its own TP group) unless DP attention is on, where it
    splits one TP group (older releases: ``enable_dp_attention``; 0.5.23 reports ``attn_dp_size``).
    """
    si = ServerInfo(info)
    tp, pp, ep = si.size("tp_size"), si.size("pp_size"), si.size("ep_size")
    dp = si.size("dp_size")
    if "attn_dp_size" in info:
        replicas, attn_dp = dp, si.size("attn_dp_size")
    elif info.get("enable_dp_attention"):
        replicas, attn_dp = 1, dp
    else:
        replicas, attn_dp = dp, 1
    moe_dp = si.size("moe_dp_size")
    dp_ranks = replicas * attn_dp
    keys: list[RankKey] = []
    for d in range(replicas):
        for p in range(pp):
            for t in range(tp):
                dp_rank: int | None = None
                if dp_ranks > 1:
                    dp_rank = d if replicas > 1 else t // max(1, tp // attn_dp)
                ep_rank: int | None = None
                if ep > 1:
                    group = max(1, tp // moe_dp)
                    ep_rank = (t % group) // max(1, group // ep)
                keys.append(RankKey(dp=dp_rank, pp=p if pp > 1 else None, tp=t, ep=ep_rank))
    return keys


def check_complete(path: Path) -> str | None:
    """None when ``path`` is a whole gzip stream holding a JSON object, else why it is not."""
    try:
        with gzip.open(path, "rb") as f:
            head = f.read(64).lstrip()
            if not head:
                return "empty"
            if not head.startswith(b"{"):
                return "not a JSON object"
            tail = head
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                tail = chunk[-64:] if len(chunk) >= 64 else (tail + chunk)[-64:]
    except EOFError:
        return "gzip stream is truncated (still being written?)"
    except (OSError, zlib.error) as e:
        return f"not a valid gzip file ({e})"
    if not tail.rstrip().endswith(b"}"):
        return "JSON is cut short"
    return None


@dataclass
class TrackedFile:
    """A capture file seen on disk."""

    path: Path
    key: RankKey | None
    stage: str | None
    size: int = -1
    mtime: float = -1.0
    stable_since: float = 0.0
    complete: bool = False
    problem: str | None = None


@dataclass
class WaitResult:
    """What was on disk when waiting ended."""

    complete: dict[RankKey, TrackedFile]
    missing: list[RankKey]
    files: list[TrackedFile]  # every file of this capture, any stage
    timed_out: bool
    elapsed_s: float


class RankWatcher:
    """Tracks the files of one capture (``{stem}-TP-...``) in a directory."""

    def __init__(self, directory: Path, stem: str, expected: list[RankKey], stage: str | None,
                 stable_s: float = 1.0, alt_stem: str | None = None) -> None:
        self.directory = Path(directory)
        self.stem = stem
        # releases before profile_prefix write "{profile_id}-TP-..." whatever prefix was asked for
        self.stems = (stem,) + ((alt_stem,) if alt_stem else ())
        # releases before profile_by_stage write stage-less files on their own; these count until
        # /stop_profile is sent (after that a stage-less file is what a stop wrote)
        self.accept_stageless = True
        self.expected = list(expected)
        self.stage = stage.upper() if stage else None
        self.stable_s = stable_s
        self.files: dict[str, TrackedFile] = {}
        self._by_match = {k.match: k for k in self.expected}

    def _identify(self, name: str) -> tuple[RankKey | None, str | None] | None:
        if not any(name.startswith(st + "-") for st in self.stems):
            return None
        m = SGLANG_NAME.match(name)
        if not m or m.group("stem") not in self.stems:
            return None
        stage = m.group("stage").upper() if m.group("stage") else None

        def num(k: str) -> int | None:
            v = m.group(k)
            return int(v) if v is not None else None

        key = self._by_match.get((num("dp"), num("pp"), int(m.group("tp"))))
        return key, stage

    def poll(self, now: float | None = None, verify: bool = True) -> None:
        """Look at the directory once; verify files that have been stable long enough."""
        now = time.monotonic() if now is None else now
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        for name in names:
            if name in self.files:
                continue
            ident = self._identify(name)
            if ident is None:
                continue
            self.files[name] = TrackedFile(path=self.directory / name, key=ident[0], stage=ident[1],
                                           stable_since=now)
        for tf in self.files.values():
            try:
                st = tf.path.stat()
            except OSError:
                tf.complete, tf.size = False, -1
                continue
            if (st.st_size, st.st_mtime) != (tf.size, tf.mtime):
                tf.size, tf.mtime, tf.stable_since, tf.complete = st.st_size, st.st_mtime, now, False
                continue
            if tf.complete or not verify or now - tf.stable_since < self.stable_s:
                continue
            tf.problem = check_complete(tf.path)
            try:
                st2 = tf.path.stat()
            except OSError:
                continue
            if (st2.st_size, st2.st_mtime) == (tf.size, tf.mtime) and tf.problem is None:
                tf.complete = True

    def wanted(self, tf: TrackedFile) -> bool:
        if tf.key is None:
            return False
        return tf.stage == self.stage or (self.accept_stageless and tf.stage is None)

    def result(self, timed_out: bool, elapsed_s: float) -> WaitResult:
        complete: dict[RankKey, TrackedFile] = {}
        for tf in sorted(self.files.values(), key=lambda t: t.stage != self.stage):  # staged files first
            if tf.complete and self.wanted(tf) and tf.key is not None:
                complete.setdefault(tf.key, tf)
        missing = [k for k in self.expected if k not in complete]
        files = sorted(self.files.values(), key=lambda t: t.path.name)
        return WaitResult(complete=complete, missing=missing, files=files, timed_out=timed_out,
                          elapsed_s=elapsed_s)

    def done(self) -> bool:
        return not self.result(False, 0.0).missing

    def pending_note(self) -> str:
        """A short note on files that exist but are not complete yet."""
        notes = []
        for tf in self.files.values():
            if self.wanted(tf) and not tf.complete:
                notes.append(f"{tf.path.name}: {tf.problem or 'still being written'}")
        return "; ".join(notes)


Progress = Callable[[int, int, str], None]


def wait_for_ranks(watcher: RankWatcher, timeout_s: float, poll_s: float = 0.25,
                   progress: Progress | None = None,
                   should_stop: Callable[[], str | None] | None = None) -> WaitResult:
    """Poll until every expected rank file is complete or ``timeout_s`` passes.

    ``progress(done, total, note)`` is called after each poll; ``should_stop()`` may return a reason
    to give up early (e.g. the load generator died).
    """
    t0 = time.monotonic()
    total = len(watcher.expected)
    while True:
        now = time.monotonic()
        watcher.poll(now)
        res = watcher.result(False, now - t0)
        if progress is not None:
            missing = ", ".join(k.label for k in res.missing[:8]) + (" ..." if len(res.missing) > 8 else "")
            progress(total - len(res.missing), total, f"waiting for {missing}" if res.missing else "done")
        if not res.missing:
            return res
        if now - t0 >= timeout_s:
            return watcher.result(True, now - t0)
        if should_stop is not None and should_stop():
            return watcher.result(True, now - t0)
        time.sleep(poll_s)
