"""Where Kiln keeps what outlives a process on this machine: the user's data directory (XDG's rule)."""

from __future__ import annotations

import os
from pathlib import Path


def data_directory() -> Path:
    """$XDG_DATA_HOME/kiln, else ~/.local/share/kiln: servers' instance directories
    (kiln/snapshots/instance.py) and the models directory (kiln/models/catalog.py) lie under it."""
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "kiln"
