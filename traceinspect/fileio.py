"""Atomic file writes: every output goes through a temporary file in the target directory and a
rename, so a reader never sees half a file and a failed run leaves nothing that looks complete."""

from __future__ import annotations

import contextlib
import json
import os
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
