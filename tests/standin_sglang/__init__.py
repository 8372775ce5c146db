"""A stand-in SGLang server for tests: same HTTP API and trace file layout, tiny CPU model, no GPU."""

from .server import StandinConfig, serve

__all__ = ["StandinConfig", "serve"]
