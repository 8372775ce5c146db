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
from typing import TYPE_CHECKING, Any

from traceinspect.load.parse import GPU_KINDS, ParsedRank
from traceinspect.model import DeviceInfo

if TYPE_CHECKING:
    import pandas as pd

PARSER_VERSION = "4"
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
        tables = {t: _read_table(d / f"{t}.parquet") for t in TABLES}
    except Exception:  # a damaged entry is only a cache miss
        return None
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
            "devices": [asdict(d) for d in parsed.devices],
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
