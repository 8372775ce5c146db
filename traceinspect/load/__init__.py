"""Stage 1, load: rank files -> a :class:`~traceinspect.model.TraceSet` of typed tables.

Inputs: rank files (a directory, files or globs), the server_info.json beside them, the cache.
Outputs: a :class:`~traceinspect.model.TraceSet` of typed tables, each rank linked where it was parsed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceinspect.errors import TraceInputError
from traceinspect.load.discover import RankFile, discover, read_capture_json, read_server_info
from traceinspect.load.raw import (
    Digest,
    _open,
    _sha256,
    hash_later,
    hex_digest,
    parse_processes,
    read_scan,
)

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from traceinspect.load.parse import ParsedRank
    from traceinspect.model import RankInfo, TraceSet

# the heavy modules (numpy, pandas, msgspec) load on first use: the commands set the memory settings
# (:func:`memory_settings`) from here before numpy is imported
__all__ = ["load_trace_set", "memory_settings", "parse_file", "discover"]

PROGRESS_MIN_BYTES = 50_000_000  # show a progress bar for trace sets larger than this (on a terminal)


def parse_file(path: str | Path) -> ParsedRank:
    """Read and decode one rank file (:func:`traceinspect.load.parse.parse_file`)."""
    from traceinspect.load import parse

    return parse.parse_file(path)


def load_rank_file(path: str | Path, use_cache: bool = True,
                   prepare: Callable[[ParsedRank], None] | None = None,
                   defer_digest: bool = False) -> tuple[Digest, int, ParsedRank]:
    """Hash, then read one rank file from the cache or parse it (and cache the tables).

    This is the unit of work a parse process runs: it touches only the file and the
    cache of the machine it runs on and returns the content hash, the file size and the compact tables,
    after ``prepare`` (the pipeline passes the link stage's per-rank linking: kernel -> runtime event ->
    CPU op is per rank). With ``defer_digest`` and the cache off, the hash may still be under way on
    return (a future, computed beside what the caller does next); otherwise the digest is the hex text.
    """
    from traceinspect.load import cache, parse

    path = Path(path)
    root = cache.cache_dir() if use_cache else None
    if parse.native_available():
        digest, size, res = _read_native(path, root)  # res None: the cache holds the tables
    else:  # the msgspec path
        digest, size, res = _sha256(path), path.stat().st_size, None
    parsed = cache.load(root, digest) if root is not None and res is None else None
    if parsed is None:
        parsed = parse.tables_native(res, path) if res is not None else parse_file(path)
        del res  # its buffers, before linking allocates more
        if root is not None:
            cache.store(root, digest, parsed)  # the parsed tables: linking is cheap and redone
    if prepare is not None:
        prepare(parsed)
    vars(parsed).pop("_name_codes", None)  # what prepare did not use stays here
    return (digest if defer_digest else hex_digest(digest)), size, parsed


def _read_native(path: Path, root: Path | None) -> tuple[Digest, int, dict[str, Any] | None]:
    """The native read of one rank file before its tables are built, for cache root ``root`` (None: no
    cache): with the cache on, the file is hashed first and not scanned when the cache holds its tables
    (the scan None); without it, the file is hashed on a thread of its own begun once the scan is over
    (:func:`~traceinspect.load.raw.hash_later`)."""
    from traceinspect.load import cache

    if root is None:
        f = _open(path)
        try:
            res = read_scan(path)
        except BaseException:
            f.close()
            raise
        return hash_later(f, path), path.stat().st_size, res
    digest = _sha256(path)
    size = path.stat().st_size
    if cache.has_entry(root, digest):
        return digest, size, None
    return digest, size, read_scan(path)


def memory_settings() -> None:
    """Memory settings for a command's one large read and the analysis of its tables (a short-lived
    process whose large arrays are mostly written once and read a few times); called before numpy is
    imported. On Linux, glibc's allocator gets:

    * one arena: glibc gives a thread that allocates its own arena, and the scanner's column buffers,
      grown on the read thread and freed once the tables are built, would stay mapped there beside the
      main thread's heap (about 150 MB more peak memory for a 1 GB rank file). With one arena the main
      thread reuses them.
    * blocks under 32 MB (the most glibc allows) from the heap, and freed heap memory kept up to 512 MB:
      by default a freed block of a few MB is given back to the kernel and the next one is mapped and
      zeroed page by page again (a 1 GB rank file's read blocks, column buffers and table columns took
      about 150,000 page faults; a third fewer with these settings, for the same peak memory).

    and numpy does not ask for transparent huge pages for its arrays (``NUMPY_MADVISE_HUGEPAGE=0``, unless
    set): each new array of 4 MB or more is then faulted in 2 MB at a time, which made the analysis of a
    1 GB rank file's tables about 0.2 s slower than with 4 kB pages. Huge pages pay off for arrays that
    live long and are read many times, which these are not."""
    import contextlib

    if "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
        np = sys.modules.get("numpy")
        if np is None:
            os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read once, when numpy is imported
        else:
            with contextlib.suppress(AttributeError):  # another numpy layout: left as it is
                np._core.multiarray._set_madvise_hugepage(False)
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, 1)  # M_ARENA_MAX (glibc); other C libraries have no mallopt
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _progress(paths: list[Path], quiet: bool | None) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(advance(file index), close()) of a per-file progress bar on stderr, or no-ops: the bar shows
    only on a terminal and for trace sets of more than PROGRESS_MIN_BYTES."""
    def noop(*_: Any) -> None:
        return None

    if quiet or not sys.stderr.isatty():
        return noop, noop
    try:
        sizes = [p.stat().st_size for p in paths]
    except OSError:
        return noop, noop
    if sum(sizes) < PROGRESS_MIN_BYTES:
        return noop, noop
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    # no refresh thread (auto_refresh off): worker processes are forked while the bar is shown
    bar = Progress(TextColumn("parsing {task.fields[done]}/{task.fields[n]} rank files"), BarColumn(),
                   DownloadColumn(), TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                   auto_refresh=False)
    task = bar.add_task("parse", total=sum(sizes), done=0, n=len(paths))
    bar.start()
    bar.refresh()
    done = [0]

    def advance(i: int) -> None:
        done[0] += 1
        bar.update(task, advance=sizes[i], done=done[0])
        bar.refresh()

    return advance, bar.stop


def _parse_local(paths: list[Path], jobs: int | None, use_cache: bool, advance: Callable[[int], None],
                 prepare: Callable[[ParsedRank], None] | None = None) -> list[tuple[Digest, int, ParsedRank]]:
    import sys

    jobs = parse_processes(len(paths), jobs)
    mp = sys.modules.get("multiprocessing")  # (not imported: this is no pool worker)
    if mp is not None and mp.current_process().daemon:  # a daemon (a pool worker, say) may not start processes
        jobs = 1
    if jobs <= 1 or len(paths) <= 1:
        out = []
        for i, p in enumerate(paths):
            out.append(load_rank_file(p, use_cache, prepare, defer_digest=True))
            advance(i)
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    results: list[Any] = [None] * len(paths)
    # largest files first, so that the last one to finish is a small one
    order = sorted(range(len(paths)), key=lambda i: -_size(paths[i]))
    with ProcessPoolExecutor(max_workers=min(jobs, len(paths)), mp_context=ctx) as pool:
        futures = {pool.submit(load_rank_file, paths[i], use_cache, prepare): i for i in order}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            advance(i)
    return results


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _parse_all(paths: list[Path], jobs: int | None, use_cache: bool, quiet: bool | None = None,
               prepare: Callable[[ParsedRank], None] | None = None) -> list[tuple[Digest, int, ParsedRank]]:
    advance, close = _progress(paths, quiet)
    try:
        return _parse_local(paths, jobs, use_cache, advance, prepare)
    finally:
        close()


def _assign_ranks(files: list[RankFile], parsed: list[ParsedRank], hashes: list[Digest], fsizes: list[int],
                  warnings: list[str]) -> list[RankInfo]:
    from traceinspect.model import RankInfo

    infos: list[RankInfo] = []
    named = all(f.tp is not None for f in files)
    dist_ranks = [p.distributed_info.get("rank") for p in parsed]
    from_dist = all(isinstance(r, int) for r in dist_ranks)
    if named:
        keys = [(f.dp or 0, f.pp or 0, f.tp or 0) for f in files]
        order = sorted(range(len(files)), key=lambda i: keys[i])
        source = "filename"
    elif from_dist:
        order = sorted(range(len(files)), key=lambda i: dist_ranks[i])
        source = "distributedInfo"
    else:
        order = list(range(len(files)))
        source = "order"
        if len(files) > 1:
            warnings.append("rank numbers guessed from file order: names carry no -TP-<r> and traces no "
                            "distributedInfo.rank")
    claimed: dict[tuple[int, ...] | int, Path] = {}
    for idx in order:
        f, p = files[idx], parsed[idx]
        if source == "filename":
            key: tuple[int, ...] | int = (f.dp or 0, f.pp or 0, f.tp or 0)
            rank = int(f.tp or 0) if not (f.dp or f.pp) else len(infos)
            label = "TP" + str(f.tp) + (f"-DP{f.dp}" if f.dp is not None else "") + (
                f"-PP{f.pp}" if f.pp is not None else "")
        elif source == "distributedInfo":
            key = rank = int(dist_ranks[idx])
            label = f"R{rank}"
        else:
            key = rank = len(infos)
            label = f"R{rank}"
        if key in claimed:
            raise TraceInputError(f"two files claim the same rank ({label}): {claimed[key]} and {f.path}", f.path)
        claimed[key] = f.path
        infos.append(RankInfo(
            rank=rank, label=label, path=f.path, rank_source=source,
            tp=f.tp, dp=f.dp, pp=f.pp, ep=f.ep, stage=f.stage, profile_id=f.profile_id,
            devices=p.devices, distributed_info=p.distributed_info,
            cuda_runtime_version=p.cuda_runtime_version, cuda_driver_version=p.cuda_driver_version,
            trace_id=p.trace_id, size_bytes=fsizes[idx], digest=hashes[idx],
            n_events=p.n_events,
        ))
    if source == "filename" and len({i.rank for i in infos}) != len(infos):
        for n, info in enumerate(infos):  # several DP/PP groups: number ranks by position
            info.rank = n
    return infos


def _concat(frames: list[pd.DataFrame], ranks: list[int],
            offsets: dict[str, list[pd.DataFrame]] | None = None) -> pd.DataFrame:
    """Stack the ranks' tables with a leading ``rank`` column (column by column, one copy). Columns
    named in ``offsets`` hold row numbers (-1: none) of another per-rank table: they are shifted by the
    rows of that table's earlier ranks."""
    import numpy as np
    import pandas as pd

    from traceinspect.load.raw import GPU_KINDS

    cols: dict[str, Any] = {"rank": np.repeat(np.asarray(ranks, dtype=np.int64), [len(f) for f in frames])}
    for c in frames[0].columns:
        parts = [f[c] for f in frames]
        if offsets and c in offsets:
            start = np.cumsum([0] + [len(t) for t in offsets[c]])[:-1]
            cols[c] = np.concatenate([np.where(p.to_numpy() >= 0, p.to_numpy() + o, -1)
                                      for p, o in zip(parts, start.tolist(), strict=True)])
        elif c == "kind":
            codes = np.concatenate([p.cat.codes.to_numpy() for p in parts])
            cols[c] = pd.Categorical.from_codes(codes, categories=GPU_KINDS)
        elif isinstance(parts[0].dtype, pd.CategoricalDtype):  # the link columns: union of the ranks' strings
            from pandas.api.types import union_categoricals

            cols[c] = union_categoricals([p.array for p in parts], sort_categories=True) if len(parts) > 1 \
                else parts[0].array
        elif isinstance(parts[0].dtype, np.dtype):
            arr = np.concatenate([p.to_numpy() for p in parts]) if len(parts) > 1 else parts[0].to_numpy()
            # a Series keeps object columns object (a bare array of str would be converted to str dtype)
            cols[c] = pd.Series(arr, dtype=object, copy=False) if arr.dtype == object else arr
        else:  # extension dtypes (str) keep their type
            cols[c] = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0].reset_index(drop=True)
    return pd.DataFrame(cols, copy=False)


def _stacked_codes(coded: list[tuple[np.ndarray, np.ndarray] | None]) -> tuple[np.ndarray, np.ndarray] | None:
    """The ranks' (codes, texts) of a name column, stacked as :func:`_concat` stacks the column (each rank's
    codes shifted past the earlier ranks' texts); None unless every rank has them."""
    import numpy as np

    if not coded or any(c is None for c in coded):
        return None
    if len(coded) == 1:
        return coded[0]
    shift = np.cumsum([0] + [len(t) for _, t in coded])[:-1].tolist()
    return (np.concatenate([c + s for (c, _), s in zip(coded, shift, strict=True)]),
            np.concatenate([t for _, t in coded]))


def duplicate_warning(n_dup: int) -> str:
    """The warning for runtime events that reuse a correlation id."""
    return f"{n_dup} runtime events reuse a correlation id; the first one is used"


def load_trace_set(
    paths: Sequence[str | Path] | str | Path,
    *,
    phase: str = "decode",
    server_info: str | Path | None = None,
    jobs: int | None = None,
    require_kernels: bool = True,
    use_cache: bool = True,
    prepare: Callable[[ParsedRank], None] | None = None,
    allow_mismatch: bool = False,
) -> TraceSet:
    """Load every rank file under ``paths`` (a directory, files, or globs) into one TraceSet.

    Raises :class:`TraceInputError` for a missing path, a corrupt or truncated file, a file
    that is not a Kineto trace, two files claiming one rank, or (unless ``require_kernels`` is
    false) a trace with no GPU kernels. Rank files parse in ``jobs`` processes (by default one per two
    CPUs: :func:`~traceinspect.load.raw.parse_processes`); parsed tables are cached by content hash unless ``use_cache``
    is false or ``$TRACEINSPECT_CACHE`` is ``off``. ``prepare`` runs on each rank's tables where they were
    parsed (the pipeline passes :func:`traceinspect.link.link_parsed`). Files that are not the ranks of one
    run (:func:`~traceinspect.load.consistency.mismatch_reasons`) raise :class:`TraceInputError` naming
    them and why, unless ``allow_mismatch`` (then a warning says so).
    """
    from traceinspect.load.consistency import mismatch_reasons, rank_set_warnings
    from traceinspect.load.parse import drop_summary
    from traceinspect.model import TraceSet

    if isinstance(paths, (str, Path)):
        paths = [paths]
    found = discover(list(paths), phase=phase)
    warnings = list(found.notes)
    files = found.files
    loaded = _parse_all([f.path for f in files], jobs, use_cache, prepare=prepare)
    hashes = [h for h, _, _ in loaded]
    fsizes = [n for _, n, _ in loaded]
    parsed = [p for _, _, p in loaded]
    del loaded
    for f, p in zip(files, parsed, strict=True):
        if require_kernels and not (p.kernels["kind"] == "kernel").any():
            raise TraceInputError(
                "trace has no GPU kernel events (CUPTI may have failed to start, or the profile ran "
                "without the CUDA activity)", f.path)
        if p.dropped:
            warnings.append(f"{f.path}: dropped {p.dropped} of {p.n_events} events as unusable "
                            f"({drop_summary(p.drops)}; {p.gpu_dropped} of them GPU events)")
    reasons = mismatch_reasons([f.path for f in files], parsed)
    if reasons:
        where = f"{len(files)} files" + (f" under {paths[0]}" if len(paths) == 1 else "")
        what = f"{where} are not the ranks of one run: " + "; ".join(reasons)
        if not allow_mismatch:
            raise TraceInputError(what + " (analyse them one at a time, or pass --allow-mismatch)")
        warnings.append(what + "; analysed together as --allow-mismatch asks")
    infos = _assign_ranks(files, parsed, hashes, fsizes, warnings)
    ranks = [i.rank for i in infos]
    by_path = {f.path: p for f, p in zip(files, parsed, strict=True)}
    ordered = [by_path[i.path] for i in infos]

    # (Kineto gives every rank its own trace_id: it cannot tell captures apart; profile ids can)
    si_path = Path(server_info) if server_info else found.server_info_path
    si = read_server_info(si_path) if si_path else None
    cap = read_capture_json(found.capture_json_path, warnings) if found.capture_json_path else None

    rts, ops = [p.runtime for p in ordered], [p.cpu_ops for p in ordered]
    linked = all(p.linked for p in ordered)
    n_dup = sum(p.link_dups for p in ordered)
    if linked and n_dup:
        warnings.append(duplicate_warning(n_dup))
    ts = TraceSet(
        ranks=infos,
        kernels=_concat([p.kernels for p in ordered], ranks, {"rt_idx": rts, "op_idx": ops} if linked else None),
        runtime=_concat(rts, ranks),
        cpu_ops=_concat(ops, ranks, {"parent": ops} if linked else None),
        annotations=_concat([p.annotations for p in ordered], ranks),
        gpu_annotations=_concat([p.gpu_annotations for p in ordered], ranks),
        server_info=si,
        server_info_path=si_path,
        capture=cap,
        capture_traces=found.capture_traces,
        warnings=warnings,
        sources=[str(p) for p in paths],
        linked=linked,
        op_name_codes=_stacked_codes([getattr(p, "op_name_codes", None) for p in ordered]),
    )
    ts.warnings += rank_set_warnings(ts)  # captures that differ, ranks missing, clocks apart
    return ts
