"""Where vramshard keeps its files (profile, demo model): the user cache directory."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$VRAMSHARD_CACHE``, else ``$XDG_CACHE_HOME/vramshard``, else ``~/.cache/vramshard``."""
    if env := os.environ.get("VRAMSHARD_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vramshard"
