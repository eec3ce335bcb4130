"""The error a flag value that cannot work raises (args.py and the config parsers it calls): a leaf, so the
parsers need not import args.py for it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A flag value that cannot work; the CLI prints it and exits 2."""
