"""Atomic file writes: every output goes through a temporary file in the target directory and a
rename, so a reader never sees half a file and a failed run leaves nothing that looks complete. And the
one SHA-256 of a file (:func:`sha256_of`) that rank files and captures are identified by."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without an error (written to a temporary
    file in the same directory and renamed); on an error nothing is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are made to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory."""
    with atomic_output(path) as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, doc: Any) -> None:
    """Write a strict JSON document (no NaN) atomically."""
    write_text_atomic(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a dict; raise ConfigError (exit 2) naming the file and why it is unusable."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    from traceinspect.errors import ConfigError

    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError("config file not found", path) from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file: {e}", path) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML: {e}", path) from e


def sha256_of(f: BinaryIO, size: int = 1 << 20) -> str:
    """SHA-256 (hex) of an open binary file from its position to the end: a regular file of
    :data:`MAP_MIN` bytes or more through memory mappings of :data:`MAP_WINDOW` bytes at a time (the hash
    reads the page cache itself: reading the file into a buffer first costs more than the hash on a
    virtual machine), else or where mapping fails through one reused buffer of ``size`` bytes."""
    h = hashlib.sha256()
    try:
        at = f.tell()
    except OSError:  # (a pipe)
        at = -1
    if at < 0 or not _sha256_mapped(f.fileno(), at, h):  # (the mappings leave the file's position as it is)
        buf = bytearray(size)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


MAP_MIN = 16 << 20  # files at least this large are hashed from memory mappings
MAP_WINDOW = 64 << 20  # bytes mapped at a time (peak memory stays the tables', not the file's)


def _sha256_mapped(fd: int, at: int, h: Any) -> bool:
    """Feed ``h`` the bytes of the regular file ``fd`` from ``at`` to its end through memory mappings, a
    window at a time; False (``h`` untouched) when the file is small or not a regular file, or cannot
    be mapped."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size - at < MAP_MIN or not hasattr(mmap, "MADV_SEQUENTIAL"):
        return False
    end, first = st.st_size, True
    while at < end:
        base = at - at % mmap.ALLOCATIONGRANULARITY
        try:
            m = mmap.mmap(fd, min(MAP_WINDOW, end - base), prot=mmap.PROT_READ, offset=base)
        except (OSError, ValueError) as e:
            if first:  # (nothing hashed yet: the caller reads the file instead)
                return False
            raise OSError(f"cannot map the file: {e}") from None
        first = False
        with m:
            m.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(m) as v:
                h.update(v[at - base:])  # (the interpreter lock is released while it hashes)
            at = base + len(m)
    return True
