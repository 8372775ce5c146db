"""On-disk cache of parsed rank tables (Parquet), keyed by the file's content hash.

Re-analysing a stored trace set (``gate`` on a baseline, a second ``report``) then skips JSON
decoding entirely. The key includes the parser version, so a changed parser never reads stale
tables.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from traceinspect.load.parse import ParsedRank
from traceinspect.model import DeviceInfo

PARSER_VERSION = "1"
TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")


def cache_dir() -> Path | None:
    """The cache root: ``$TRACEINSPECT_CACHE`` (empty or ``off`` disables it), else ``~/.cache/traceinspect``."""
    env = os.environ.get("TRACEINSPECT_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    return Path.home() / ".cache" / "traceinspect"


def _entry(root: Path, sha256: str) -> Path:
    return root / f"v{PARSER_VERSION}" / sha256[:2] / sha256


def load(root: Path, sha256: str) -> ParsedRank | None:
    """The cached tables of a file with this hash, or None when absent or unreadable."""
    d = _entry(root, sha256)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        tables = {t: pd.read_parquet(d / f"{t}.parquet") for t in TABLES}
    except Exception:  # a damaged entry is only a cache miss
        return None
    if "kind" in tables["kernels"]:
        tables["kernels"]["kind"] = pd.Categorical(tables["kernels"]["kind"], categories=["kernel", "memcpy", "memset"])
    return ParsedRank(
        **tables,
        devices=[DeviceInfo(**d) for d in meta["devices"]],
        distributed_info=meta["distributed_info"],
        cuda_runtime_version=meta["cuda_runtime_version"],
        cuda_driver_version=meta["cuda_driver_version"],
        trace_id=meta["trace_id"],
        n_events=meta["n_events"],
        dropped=meta["dropped"],
    )


def store(root: Path, sha256: str, parsed: ParsedRank) -> None:
    """Write an entry atomically (a temporary directory renamed into place); failures are ignored."""
    final = _entry(root, sha256)
    if final.exists():
        return
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        for t in TABLES:
            df = getattr(parsed, t).copy()
            if "kind" in df:
                df["kind"] = df["kind"].astype(str)
            df.to_parquet(tmp / f"{t}.parquet", index=False)
        meta = {
            "devices": [asdict(d) for d in parsed.devices],
            "distributed_info": parsed.distributed_info,
            "cuda_runtime_version": parsed.cuda_runtime_version,
            "cuda_driver_version": parsed.cuda_driver_version,
            "trace_id": parsed.trace_id,
            "n_events": parsed.n_events,
            "dropped": parsed.dropped,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(final)
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError, TypeError):
        return
