"""Rewrite the stored golden outputs from the code as it is (``python tests/golden/update.py [SET ...]``).

Run it only for a change meant to alter output, and say why in the commit."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden import fixture_sets, render, set_name, store  # noqa: E402


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in fixture_sets():
            if names and set_name(fixture) not in names:
                continue
            store(fixture, render(fixture, Path(tmp) / set_name(fixture)))
            print("stored", set_name(fixture))


if __name__ == "__main__":
    main(sys.argv[1:])
