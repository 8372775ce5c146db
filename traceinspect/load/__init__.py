"""Stage 1, load: rank files -> a :class:`~traceinspect.model.TraceSet` of typed tables."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd

from traceinspect.errors import TraceInputError
from traceinspect.load import cache
from traceinspect.load.discover import RankFile, discover, read_server_info
from traceinspect.load.parse import ParsedRank, parse_file
from traceinspect.model import RankInfo, TraceSet

__all__ = ["load_trace_set", "parse_file", "discover"]

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _parse_local(paths: list[Path], jobs: int | None) -> list[ParsedRank]:
    jobs = jobs if jobs is not None else min(len(paths), os.cpu_count() or 1)
    if jobs <= 1 or len(paths) <= 1:
        return [parse_file(p) for p in paths]
    import multiprocessing as mp

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(parse_file, paths))


def _parse_dask(paths: list[Path], executor: str, jobs: int | None) -> list[ParsedRank]:
    """Parse rank files on dask.distributed workers; only the compact tables travel back."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise TraceInputError("the dask executor needs the optional extra: pip install 'traceinspect[dask]'") \
            from None
    address = executor.split("://", 1)[1] if "://" in executor else None
    if address:
        with Client(address) as client:
            futures = client.map(parse_file, [str(p) for p in paths], pure=False)
            return client.gather(futures)
    workers = jobs or min(len(paths), os.cpu_count() or 1)
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        futures = client.map(parse_file, [str(p) for p in paths], pure=False)
        return client.gather(futures)


def _parse_all(paths: list[Path], hashes: list[str], jobs: int | None, executor: str,
               use_cache: bool) -> list[ParsedRank]:
    root = cache.cache_dir() if use_cache else None
    results: dict[int, ParsedRank] = {}
    if root is not None:
        for i, h in enumerate(hashes):
            hit = cache.load(root, h)
            if hit is not None:
                results[i] = hit
    todo = [i for i in range(len(paths)) if i not in results]
    if todo:
        miss = [paths[i] for i in todo]
        if executor == "local":
            parsed = _parse_local(miss, jobs)
        elif executor == "dask" or executor.startswith("dask://"):
            parsed = _parse_dask(miss, executor, jobs)
        else:
            raise TraceInputError(f"unknown executor {executor!r} (use local, dask or dask://HOST:PORT)")
        for i, p in zip(todo, parsed, strict=True):
            results[i] = p
            if root is not None:
                cache.store(root, hashes[i], p)
    return [results[i] for i in range(len(paths))]


def _assign_ranks(files: list[RankFile], parsed: list[ParsedRank], hashes: list[str],
                  warnings: list[str]) -> list[RankInfo]:
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
            trace_id=p.trace_id, size_bytes=f.path.stat().st_size, sha256=hashes[idx],
            n_events=p.n_events,
        ))
    if source == "filename" and len({i.rank for i in infos}) != len(infos):
        for n, info in enumerate(infos):  # several DP/PP groups: number ranks by position
            info.rank = n
    return infos


def _concat(frames: list[pd.DataFrame], ranks: list[int]) -> pd.DataFrame:
    parts = []
    for df, r in zip(frames, ranks, strict=True):
        df = df.copy()
        df.insert(0, "rank", r)
        parts.append(df)
    out = pd.concat(parts, ignore_index=True)
    if "kind" in out:
        out["kind"] = pd.Categorical(out["kind"], categories=["kernel", "memcpy", "memset"])
    return out


def load_trace_set(
    paths: Sequence[str | Path] | str | Path,
    *,
    phase: str = "decode",
    server_info: str | Path | None = None,
    jobs: int | None = None,
    require_kernels: bool = True,
    executor: str = "local",
    use_cache: bool = True,
) -> TraceSet:
    """Load every rank file under ``paths`` (a directory, files, or globs) into one TraceSet.

    Raises :class:`TraceInputError` for a missing path, a corrupt or truncated file, a file
    that is not a Kineto trace, two files claiming one rank, or (unless ``require_kernels`` is
    false) a trace with no GPU kernels. ``executor`` is ``local`` (a process per rank file),
    ``dask`` (a local dask.distributed cluster) or ``dask://HOST:PORT`` (an existing scheduler whose
    workers can read the same paths); parsed tables are cached by content hash unless ``use_cache``
    is false or ``$TRACEINSPECT_CACHE`` is ``off``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found = discover(list(paths), phase=phase)
    warnings = list(found.notes)
    files = found.files
    hashes = [_sha256(f.path) for f in files]
    parsed = _parse_all([f.path for f in files], hashes, jobs, executor, use_cache)
    for f, p in zip(files, parsed, strict=True):
        if require_kernels and not (p.kernels["kind"] == "kernel").any():
            raise TraceInputError(
                "trace has no GPU kernel events (CUPTI may have failed to start, or the profile ran "
                "without the CUDA activity)", f.path)
        if p.dropped:
            warnings.append(f"{f.path.name}: dropped {p.dropped} events with non-finite or negative times")
    infos = _assign_ranks(files, parsed, hashes, warnings)
    ranks = [i.rank for i in infos]
    by_path = {f.path: p for f, p in zip(files, parsed, strict=True)}
    ordered = [by_path[i.path] for i in infos]

    trace_ids = {i.trace_id for i in infos if i.trace_id}
    pids = {i.profile_id for i in infos if i.profile_id}
    if len(pids) > 1:
        warnings.append(f"rank files come from different captures (profile ids {sorted(pids)}); "
                        "analysed together as given")
    del trace_ids  # Kineto gives every rank its own trace_id; it cannot tell captures apart

    si_path = Path(server_info) if server_info else found.server_info_path
    si = read_server_info(si_path) if si_path else None
    if si is not None:
        tp_size = si.get("tp_size")
        if isinstance(tp_size, int) and tp_size * int(si.get("dp_size") or 1) * int(si.get("pp_size") or 1) \
                != len(infos) and not (isinstance(si.get("dp_size"), int) and si.get("enable_dp_attention")):
            warnings.append(f"server_info says tp_size={tp_size} but {len(infos)} rank file(s) were found: "
                            "ranks are missing")

    return TraceSet(
        ranks=infos,
        kernels=_concat([p.kernels for p in ordered], ranks),
        runtime=_concat([p.runtime for p in ordered], ranks),
        cpu_ops=_concat([p.cpu_ops for p in ordered], ranks),
        annotations=_concat([p.annotations for p in ordered], ranks),
        gpu_annotations=_concat([p.gpu_annotations for p in ordered], ranks),
        server_info=si,
        server_info_path=si_path,
        capture_traces=found.capture_traces,
        warnings=warnings,
        sources=[str(p) for p in paths],
    )
