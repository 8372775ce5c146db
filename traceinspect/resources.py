"""Where the data files shipped with traceinspect live."""

from __future__ import annotations

from pathlib import Path


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
