"""Where converted and generated model files live: `$SPECPLAY_CACHE` or the user's cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("SPECPLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specplay"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
