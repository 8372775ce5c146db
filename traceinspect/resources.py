"""Where the data files shipped with traceinspect live, and the parsed YAML of the shipped settings tables."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def rules_dir() -> Path:
    """The shipped ``rules/`` directory: inside the package when installed, else the repo root's."""
    inside = Path(__file__).parent / "rules"
    if inside.is_dir():
        return inside
    return Path(__file__).parent.parent / "rules"


def tables_dir() -> Path:
    """The shipped data tables (kernel classes, GPU specs, step markers, collectives, replay and evidence
    settings): ``rules/tables/``, beside the rule files."""
    return rules_dir() / "tables"


class _Lazy(ModuleType):
    """A stand-in for a module not imported yet: the first attribute asked for imports it (under the import
    system's own lock, so threads that ask at once all get the whole module) and copies its attributes."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_module(name: str) -> ModuleType:
    """The module ``name`` if imported, else a stand-in that imports it when one of its attributes is first
    used.

    For PyYAML: its import (about 15 ms, mostly one large regex) is needed only where YAML is parsed."""
    return sys.modules.get(name) or _Lazy(name)


def safe_loader() -> Any:
    """PyYAML's safe loader class: libyaml's (C, about 10x faster) where PyYAML was built with it."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML with :func:`safe_loader`."""
    import yaml

    return yaml.load(text, Loader=safe_loader())


def settings_document(name: str, path: str | Path | None = None) -> Any:
    """The parsed YAML of the file ``path`` when given, else of the shipped settings table
    ``rules/tables/<name>`` (OSError, yaml.YAMLError)."""
    if path:
        return load_yaml(Path(path).read_text(encoding="utf-8"))
    return load_yaml((tables_dir() / name).read_text(encoding="utf-8"))

