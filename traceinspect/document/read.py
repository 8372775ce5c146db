"""Reading a stored analysis document: a JSON file (plain or gzipped) checked against the schema, or
told apart from a trace file by its first bytes. Unusable input raises TraceInputError (exit 2)."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any

from traceinspect.document import SCHEMA, SCHEMA_NAME, SCHEMA_VERSION
from traceinspect.errors import TraceInputError

_SCHEMA_RE = re.compile(rb'^\s*\{\s*"schema"\s*:')
_PEEK_BYTES = 1 << 16


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


def _peek(path: Path) -> bytes:
    try:
        with _open(path) as f:
            return f.read(_PEEK_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise TraceInputError(f"cannot read: {e}", path) from e


def is_analysis_file(path: Path) -> bool:
    """Whether a JSON file is an analysis document rather than a trace: decided from its first bytes
    (an analysis document starts with its ``schema`` key; Kineto traces have ``schemaVersion``)."""
    if not (path.name.endswith(".json") or path.name.endswith(".json.gz")):
        return False
    head = _peek(path).lstrip(b"\xef\xbb\xbf")
    if _SCHEMA_RE.match(head):
        return True
    return b"traceEvents" not in head and path.name.endswith(".json") and b"schemaVersion" not in head


def validate_document(doc: Any, source: str | Path | None = None) -> dict[str, Any]:
    """Check that ``doc`` is a usable ``traceinspect.analysis/1`` document; raise TraceInputError
    (exit 2) with the reason otherwise."""
    if not isinstance(doc, dict):
        raise TraceInputError(f"not an analysis document (top level is {type(doc).__name__}, not an object)",
                              source)
    schema = doc.get("schema")
    if not isinstance(schema, str):
        raise TraceInputError("not a traceinspect analysis JSON (no \"schema\" key); write one with "
                              "`traceinspect analyze TRACES --json FILE`", source)
    name, _, version = schema.partition("/")
    if name != SCHEMA_NAME:
        raise TraceInputError(f"unsupported schema {schema!r} (expected {SCHEMA!r})", source)
    if version != str(SCHEMA_VERSION):
        raise TraceInputError(f"unsupported schema version {version!r} of {SCHEMA_NAME} (this traceinspect "
                              f"reads version {SCHEMA_VERSION}); re-run `traceinspect analyze --json` with "
                              f"the same traceinspect version as the gate", source)
    steps = doc.get("steps")
    if not isinstance(steps, dict):
        raise TraceInputError("analysis JSON has no \"steps\" section", source)
    count = steps.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        raise TraceInputError(f"analysis JSON has no analysed {steps.get('phase') or ''} steps "
                              f"(steps.count = {count!r})", source)
    if not _is_number(steps.get("median_us")):
        raise TraceInputError("analysis JSON has no step time (steps.median_us missing or null)", source)
    for key in ("classes", "run"):
        if key in doc and not isinstance(doc[key], dict):
            raise TraceInputError(f"analysis JSON section {key!r} is not an object", source)
    for key in ("findings", "gemm"):
        if key in doc and doc[key] is not None and not isinstance(doc[key], list):
            raise TraceInputError(f"analysis JSON section {key!r} is not a list", source)
    samples = steps.get("samples")
    if samples is not None and not isinstance(samples, list):
        raise TraceInputError("analysis JSON steps.samples is not a list", source)
    return doc


def load_json_document(path: str | Path) -> dict[str, Any]:
    """Load and validate a stored analysis JSON file (plain or gzipped)."""
    p = Path(path)
    try:
        with _open(p) as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise TraceInputError("no such file", p) from e
    except (OSError, EOFError, zlib.error) as e:
        raise TraceInputError(f"cannot read: {e}", p) from e
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceInputError(f"corrupt or truncated JSON: {e}", p) from e
    return validate_document(doc, p)




def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")
