"""``traceinspect cache info|clear``: the parsed-table cache (see :mod:`traceinspect.load.cache`)."""

from __future__ import annotations

import json

import click


def _root():  # noqa: ANN202 - a Path or None
    from traceinspect.load import cache

    return cache.cache_dir()


def _mb(n: int) -> str:
    from traceinspect.units import fmt_bytes

    return fmt_bytes(n)


@click.group("cache")
def cache_cmd() -> None:
    """The parsed-table cache ($TRACEINSPECT_CACHE; limit $TRACEINSPECT_CACHE_MAX, default 2GB)."""


@cache_cmd.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def info_cmd(as_json: bool) -> None:
    """Where the cache is, how many rank files it holds and how large it is."""
    from traceinspect.load import cache

    root = _root()
    doc = {"root": None, "enabled": False} if root is None else {**cache.info(root), "enabled": True}
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    if root is None:
        click.echo("cache: off ($TRACEINSPECT_CACHE disables it)")
        return
    click.echo(f"cache: {doc['root']}")
    click.echo(f"entries: {doc['entries']} rank files ({doc['stale_entries']} of an older parser)")
    click.echo(f"size: {_mb(doc['bytes'])} of {_mb(doc['limit_bytes'])} (least recently used entries go first)")
    if doc["entries"]:
        click.echo(f"last used: {doc['oldest_use']} .. {doc['newest_use']}")


@cache_cmd.command("clear")
def clear_cmd() -> None:
    """Remove every cached rank file."""
    from traceinspect.load import cache

    root = _root()
    if root is None:
        click.echo("cache: off, nothing to clear")
        return
    n = cache.clear(root)
    click.echo(f"cache: removed {_mb(n)} from {root}")
