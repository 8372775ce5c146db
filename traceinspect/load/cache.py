"""On-disk cache of parsed rank tables (Parquet), keyed by the file's content hash.

Re-analysing a stored trace set (``gate`` on a baseline, a second ``report``) then skips JSON
decoding entirely. The key includes the parser version, so a changed parser never reads stale
tables. The cache is bounded: after each store, the least recently used entries (and every entry of
another parser version) are removed until it is within ``$TRACEINSPECT_CACHE_MAX`` (bytes, or with a
unit: ``500MB``, ``4GB``; default 2 GB). ``traceinspect cache info|clear`` shows and empties it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceinspect.load.raw import GPU_KINDS

if TYPE_CHECKING:
    import pandas as pd

    from traceinspect.load.columns import ParsedRank

PARSER_VERSION = "5"
TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")
# columns of Python objects (str or bytes or None): read back as dictionaries so that equal values
# share one object, as they do after a parse
OBJECT_COLUMNS = ("kind", "name", "grid", "block", "input_dims", "input_types", "concrete")
BINARY_COLUMNS = ("input_dims", "input_types", "concrete")


def cache_dir() -> Path | None:
    """The cache root: ``$TRACEINSPECT_CACHE`` (empty or ``off`` disables it), else ``~/.cache/traceinspect``."""
    env = os.environ.get("TRACEINSPECT_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    return Path.home() / ".cache" / "traceinspect"


DEFAULT_MAX_BYTES = 2 * 10**9
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def max_bytes() -> int:
    """The size limit: ``$TRACEINSPECT_CACHE_MAX`` (``2GB``, ``500MB``, a byte count), else 2 GB."""
    env = os.environ.get("TRACEINSPECT_CACHE_MAX", "").strip().lower()
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", env)
    if not m or m.group(2) not in _UNITS:
        return DEFAULT_MAX_BYTES
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _entry(root: Path, sha256: str) -> Path:
    return root / f"v{PARSER_VERSION}" / sha256[:2] / sha256


def has_entry(root: Path, sha256: str) -> bool:
    """Whether an entry for this hash is stored (it may still prove unreadable to :func:`load`)."""
    return (_entry(root, sha256) / "meta.json").is_file()


def load(root: Path, sha256: str) -> ParsedRank | None:
    """The cached tables of a file with this hash, or None when absent or unreadable."""
    from traceinspect.load.columns import ParsedRank
    from traceinspect.model import DeviceInfo

    d = _entry(root, sha256)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        tables = {t: _read_table(d / f"{t}.parquet") for t in TABLES}
    except Exception:  # a damaged entry is only a cache miss
        return None
    with contextlib.suppress(OSError):  # last use, for eviction
        os.utime(meta_path)
    return ParsedRank(
        **tables,
        devices=[DeviceInfo(**d) for d in meta["devices"]],
        distributed_info=meta["distributed_info"],
        cuda_runtime_version=meta["cuda_runtime_version"],
        cuda_driver_version=meta["cuda_driver_version"],
        trace_id=meta["trace_id"],
        n_events=meta["n_events"],
        drops=meta["drops"],
        gpu_dropped=meta["gpu_dropped"],
    )


def _read_table(path: Path) -> pd.DataFrame:
    """One cached table with the dtypes a parse gives: object columns, ``kind`` categorical."""
    import numpy as np
    import pandas as pd
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    dict_cols = [c for c in OBJECT_COLUMNS if c in schema.names]
    table = pq.read_table(path, read_dictionary=dict_cols)
    data: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name)
        if name not in dict_cols:
            data[name] = col.to_numpy()
            continue
        parts = []
        for chunk in col.chunks:
            values = np.empty(len(chunk.dictionary) + 1, dtype=object)  # the last slot: null
            values[:-1] = chunk.dictionary.to_pylist()
            values[-1] = None
            idx = chunk.indices.fill_null(len(chunk.dictionary)).to_numpy(zero_copy_only=False)
            parts.append(values[idx])
        arr = np.concatenate(parts) if parts else np.empty(0, dtype=object)
        if name == "kind":
            data[name] = pd.Categorical(arr, categories=GPU_KINDS)
        else:  # a Series keeps it object (a bare array of str would be converted to str dtype)
            data[name] = pd.Series(arr, dtype=object, copy=False)
    return pd.DataFrame(data, copy=False)


def store(root: Path, sha256: str, parsed: ParsedRank) -> None:
    """Write an entry atomically (a temporary directory renamed into place); failures are ignored."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from msgspec import structs

    final = _entry(root, sha256)
    if final.exists():
        return
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        for t in TABLES:
            df = getattr(parsed, t)
            cols = {}
            for c in df.columns:
                v = df[c]
                if c in BINARY_COLUMNS:
                    cols[c] = pa.array(v.to_numpy(dtype=object), type=pa.binary())
                elif c in OBJECT_COLUMNS:
                    cols[c] = pa.array(v.astype(str).to_numpy(dtype=object), type=pa.string())
                else:
                    cols[c] = pa.array(v.to_numpy())
            pq.write_table(pa.table(cols), tmp / f"{t}.parquet")
        meta = {
            "devices": [structs.asdict(d) for d in parsed.devices],
            "distributed_info": parsed.distributed_info,
            "cuda_runtime_version": parsed.cuda_runtime_version,
            "cuda_driver_version": parsed.cuda_driver_version,
            "trace_id": parsed.trace_id,
            "n_events": parsed.n_events,
            "drops": parsed.drops,
            "gpu_dropped": parsed.gpu_dropped,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(final)
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError, TypeError, ImportError, pa.ArrowException):
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    evict(root)


# ---------------------------------------------------------------------------------------------
# size limit


def _dir_bytes(d: Path) -> int:
    n = 0
    for dirpath, _, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, f)).st_size
    return n


def entries(root: Path) -> list[tuple[Path, int, float, bool]]:
    """(directory, bytes, last use, current parser version) of every entry, least recently used first."""
    out = []
    for vdir in root.glob("v*"):
        if not vdir.is_dir() or not re.fullmatch(r"v[0-9A-Za-z.]+", vdir.name):
            continue
        current = vdir.name == f"v{PARSER_VERSION}"
        for d in vdir.glob("*/*"):
            if not d.is_dir() or d.name.startswith(".tmp-"):
                continue
            try:
                used = (d / "meta.json").stat().st_mtime
            except OSError:
                used = 0.0  # incomplete or damaged: first to go
            out.append((d, _dir_bytes(d), used, current))
    out.sort(key=lambda e: (e[3], e[2]))  # other versions first, then by last use
    return out


def evict(root: Path, limit: int | None = None) -> int:
    """Remove least recently used entries (entries of other parser versions first) until the cache
    holds at most ``limit`` bytes (default :func:`max_bytes`); returns the bytes removed."""
    limit = max_bytes() if limit is None else limit
    ents = entries(root)
    total = sum(e[1] for e in ents)
    removed = 0
    for d, n, _, current in ents:
        if total <= limit and current:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= n
        removed += n
    for vdir in root.glob("v*"):  # empty directories left behind
        for sub in [*vdir.glob("*"), vdir]:
            with contextlib.suppress(OSError):
                sub.rmdir()
    return removed


def info(root: Path) -> dict[str, Any]:
    """What the cache holds: root, entries, bytes, limit, oldest and newest last use (UTC)."""
    ents = entries(root) if root.is_dir() else []
    used = [e[2] for e in ents if e[2]]

    def iso(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    return {"root": str(root), "entries": len(ents), "bytes": sum(e[1] for e in ents),
            "limit_bytes": max_bytes(), "stale_entries": sum(1 for e in ents if not e[3]),
            "oldest_use": iso(min(used)) if used else None, "newest_use": iso(max(used)) if used else None}


def clear(root: Path) -> int:
    """Remove every entry (only the cache's own ``v*`` directories); returns the bytes removed."""
    return evict(root, limit=-1) if root.is_dir() else 0
