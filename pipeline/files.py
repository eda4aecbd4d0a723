"""Durable files: what a write-then-rename needs before anyone may rely on it (recordings, `fs://` weights)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to stable storage: a rename is durable only
    once the directory holding it has been flushed as well (Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
