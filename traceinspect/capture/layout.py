"""Where a capture writes, what it names things, and how it keeps secrets and old files out.

A capture directory holds only files of one capture: the rank traces named
``{prefix}-{profile_id}-TP-{r}[...].trace.json.gz`` (written by the server), ``server_info.json``
and ``capture.json`` (written atomically by traceinspect) and, with ``--analyze``, the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from traceinspect.capture.errors import ConfigError

CAPTURE_JSON = "capture.json"
SERVER_INFO_JSON = "server_info.json"
CAPTURE_SCHEMA = "traceinspect.capture/1"
DEFAULT_PREFIX = "traceinspect"

# a file name component: no separators, no leading dot, nothing a shell or a regex would trip on
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TRACE_SUFFIXES = (".trace.json.gz", ".trace.json", ".json.gz", ".pickle")
_OURS = {CAPTURE_JSON, SERVER_INFO_JSON}

# server_args fields that hold secrets (SGLang reports api_key/admin_api_key in plain text)
_SECRET_KEY_RE = re.compile(r"(?i)(api[_-]?key|secret|password|passwd|credential|(^|_)token$|watermark_key)")
_SECRET_FLAG_RE = re.compile(
    r"(?i)(--[\w-]*(?:api-key|api_key|secret|password|token)[\w-]*)(=|\s+)(\"[^\"]*\"|'[^']*'|\S+)"
)
REDACTED = "<redacted>"


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a safe file-name component, else raise :class:`ConfigError`.

    The server joins ``output_dir`` and ``prefix`` itself, so a prefix with a path separator or
    ``..`` would make it write outside the capture directory.
    """
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError("profile prefix must be a non-empty name")
    if "/" in prefix or "\\" in prefix or os.sep in prefix or (os.altsep and os.altsep in prefix):
        raise ConfigError(f"profile prefix {prefix!r} contains a path separator; give a plain name")
    if ".." in prefix or prefix.startswith("."):
        raise ConfigError(f"profile prefix {prefix!r} could name a path outside the output directory")
    if not _PREFIX_RE.match(prefix):
        raise ConfigError(
            f"profile prefix {prefix!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit")
    return prefix


def new_profile_id() -> str:
    """A fresh profile id: SGLang's ``time.time()`` form plus a random tag, so no two captures share it."""
    return f"{time.time():.6f}_{secrets.token_hex(4)}"


def existing_capture_files(directory: Path) -> list[str]:
    """Names in ``directory`` that belong to an earlier capture (traces, server_info, capture.json)."""
    if not directory.is_dir():
        return []
    return sorted(
        p.name for p in directory.iterdir()
        if p.is_file() and (p.name in _OURS or p.name.endswith(_TRACE_SUFFIXES))
    )


def prepare_out_dir(out: str | Path) -> tuple[Path, list[str]]:
    """Create the capture directory; when ``out`` already holds traces use a fresh subdirectory.

    Returns the directory to write into and the names of the earlier files found (empty when
    ``out`` itself is used).
    """
    base = Path(out).expanduser()
    if base.exists() and not base.is_dir():
        raise ConfigError("output path exists and is not a directory", base)
    old = existing_capture_files(base)
    target = base
    if old:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = base / f"capture-{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = base / f"capture-{stamp}-{n}"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output directory: {e.strerror or e}", target) from None
    return target.resolve(), old


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename, so it is never seen half-written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def redact_text(text: str, secret_values: Iterable[str] = ()) -> str:
    """Blank secret flag values (``--api-key X``) and every occurrence of a known secret in ``text``."""
    out = _SECRET_FLAG_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    for s in secret_values:
        if s:
            out = out.replace(s, REDACTED)
    return out


def redact(obj: Any, secret_values: Iterable[str] = ()) -> Any:
    """A copy of ``obj`` with secret-named fields and known secret strings replaced by ``<redacted>``."""
    values = [s for s in secret_values if s]

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {
                k: (REDACTED if (isinstance(k, str) and _SECRET_KEY_RE.search(k) and v not in (None, "", False))
                    else walk(v))
                for k, v in x.items()
            }
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, str):
            return redact_text(x, values)
        return x

    return walk(obj)


def redact_argv(argv: list[str], secret_values: Iterable[str] = ()) -> list[str]:
    """A command line with the values of secret options blanked (``--api-key X`` and ``--api-key=X``)."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = a.partition("=")
        if flag.startswith("--") and _SECRET_KEY_RE.search(flag.lstrip("-").replace("-", "_")):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(redact_text(a, secret_values))
    return out
