"""Subcommands of the ``traceinspect`` CLI, one module each."""
