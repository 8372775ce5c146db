"""YAML with line numbers: rule files are composed with PyYAML's safe loader (libyaml's, where PyYAML
has it) and turned into plain Python values that remember where each one was written, so errors can
name file and line. A file is parsed once per process for as long as it is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traceinspect.errors import RuleError
from traceinspect.resources import lazy_module, safe_loader

yaml = lazy_module("yaml")

MAX_FILE_BYTES = 1 << 20  # a rule file larger than 1 MiB is not a rule file
MAX_NODES = 20000
_PARSED: dict[tuple[str, int, int, int], Any] = {}  # (path, inode, size, mtime) -> converted document


_ALLOWED_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


class LDict(dict):
    """A mapping that knows the line of the mapping and of each key's value."""

    line: int
    lines: dict[str, int]


class LList(list):
    """A sequence that knows its line and the line of each item."""

    line: int
    lines: list[int]


class LStr(str):
    """A string scalar that knows its line."""

    line: int


def read_yaml(path: Path) -> Any:
    """Parse one YAML file into LDict / LList / LStr / scalars. Raises RuleError(path:line) on
    unreadable files, syntax errors, anchors/aliases and non-string keys. The result is shared by
    every caller that reads the same unchanged file (callers only read it)."""
    if not path.is_file():  # regular files only: no devices, FIFOs or directories
        raise RuleError("rule file not found (or not a regular file)", path)
    try:
        st = path.stat()
        key: tuple[str, int, int, int] | None = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _PARSED:
        return _PARSED[key]
    doc = _read_yaml(path)
    if key is not None:
        if len(_PARSED) > 256:
            _PARSED.clear()
        _PARSED[key] = doc
    return doc


def _read_yaml(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RuleError(f"cannot read rule file: {e.strerror or e}", path) from None
    if len(data) > MAX_FILE_BYTES:
        raise RuleError(f"rule file is larger than {MAX_FILE_BYTES} bytes", path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RuleError(f"rule file is not UTF-8 ({e.reason} at byte {e.start})", path) from None
    loader = safe_loader()(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise RuleError(f"invalid YAML: {e.problem or e.context}", f"{path}{line}") from None
    except yaml.YAMLError as e:
        raise RuleError(f"invalid YAML: {e}", path) from None
    finally:
        loader.dispose()
    if node is None:
        return None
    conv = _Converter(path, yaml.SafeLoader(""))
    return conv.convert(node)


class _Converter:
    def __init__(self, path: Path, loader: yaml.SafeLoader) -> None:
        self.path = path
        self.loader = loader
        self.seen: set[int] = set()
        self.count = 0

    def where(self, node: yaml.Node) -> str:
        return f"{self.path}:{node.start_mark.line + 1}"

    def convert(self, node: yaml.Node) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise RuleError(f"rule file has more than {MAX_NODES} YAML nodes", self.path)
        if id(node) in self.seen:
            # PyYAML resolves an alias to the same node object: refuse anchors/aliases outright
            # (they are the vehicle of "billion laughs" expansion and never needed in a rule)
            raise RuleError("YAML anchors/aliases are not allowed in rule files", self.where(node))
        self.seen.add(id(node))
        line = node.start_mark.line + 1
        if node.tag not in _ALLOWED_TAGS:
            raise RuleError(f"YAML tag {node.tag!r} is not allowed in rule files", self.where(node))
        if isinstance(node, yaml.MappingNode):
            out = LDict()
            out.line = line
            out.lines = {}
            for k_node, v_node in node.value:
                if isinstance(k_node, yaml.ScalarNode) and k_node.tag.endswith(":merge"):
                    raise RuleError("YAML merge keys ('<<') are not allowed in rule files", self.where(k_node))
                if not isinstance(k_node, yaml.ScalarNode):
                    raise RuleError("mapping keys must be plain strings", self.where(k_node))
                key = self.loader.construct_object(k_node)
                if not isinstance(key, str):
                    raise RuleError(f"mapping key {key!r} must be a string", self.where(k_node))
                if key in out:
                    raise RuleError(f"duplicate key {key!r}", self.where(k_node))
                out[key] = self.convert(v_node)
                out.lines[key] = v_node.start_mark.line + 1
            return out
        if isinstance(node, yaml.SequenceNode):
            seq = LList()
            seq.line = line
            seq.lines = []
            for item in node.value:
                seq.append(self.convert(item))
                seq.lines.append(item.start_mark.line + 1)
            return seq
        try:
            value = self.loader.construct_object(node)
        except yaml.YAMLError as e:
            raise RuleError(f"invalid YAML value: {e}", self.where(node)) from None
        if isinstance(value, str):
            s = LStr(value)
            s.line = line
            return s
        return value


def line_of(obj: Any, key: str | int | None = None, default: int = 0) -> int:
    """Line of ``obj`` (or of its key/item), 0 if unknown."""
    if key is not None:
        lines = getattr(obj, "lines", None)
        if isinstance(lines, dict) and key in lines:
            return lines[key]
        if isinstance(lines, list) and isinstance(key, int) and 0 <= key < len(lines):
            return lines[key]
    return getattr(obj, "line", default)
