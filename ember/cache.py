"""The user cache folder: downloaded models, their load caches, built kernels."""
from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_path


def cache_dir() -> Path:
    root = os.environ.get("EMBER_CACHE_DIR")
    return Path(root) if root else user_cache_path("ember", appauthor=False)
