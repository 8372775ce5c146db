"""The package version (its own module so that any module can name it without importing the package's
lazy public API)."""

__version__ = "0.1.0"
