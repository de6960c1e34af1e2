"""The agent's files in ``state_dir``, written whole or not at all: a device's record (agent/daemon.py) and a
hand-over's flow table (agent/handover.py).
Usage: ``write_json_atomically(Path("/run/tensorlane/agent-eth0.json"), {"ifindex": 2}, 0o644)``
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomically(path: Path, doc: object, mode: int) -> None:
    """Write ``doc`` as JSON to ``path`` atomically and durably (a temporary file made afresh through no link, with
    ``mode``, synced to disk, then a rename, then the directory synced: a ``state_dir`` on disk holds the old file or
    the new one after a power loss, never an empty one). Raises OSError; a failure leaves no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.unlink(missing_ok=True)  # (made afresh, through no link: the agent writes it as root)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode),
                       "w") as fh:
            fh.write(json.dumps(doc))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
