"""The agent's files in ``state_dir``, written whole or not at all: a device's record (agent/daemon.py) and a
hand-over's flow table (agent/handover.py); read back only as the agent wrote them (:func:`read_own_file`, one
reader for both), and judged by whether the agent that wrote them still runs (:func:`writer_runs`, one rule for both).
Usage: ``write_json_atomically(Path("/run/tensorlane/agent-eth0.json"), {"ifindex": 2}, 0o644)``;
``read_own_file(path)`` -> ``(text, mtime)`` or None
"""
from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from tensorlane.agent.peers import process_start

MAX_FILE_BYTES = 256 << 20  # read of one of these files at most (10,000 flows: 1.7 MB; max_flows bounds it)


def write_json_atomically(path: Path, doc: object, mode: int) -> None:
    """Write ``doc`` as JSON to ``path`` atomically and durably (:func:`write_atomically`). Raises OSError; a failure
    leaves no temporary file."""
    write_atomically(path, (json.dumps(doc),), mode)


def write_atomically(path: Path, parts: Iterable[str], mode: int) -> None:
    """Write the text ``parts`` (an iterable, consumed as it is written: a large document need not be one string)
    to ``path`` atomically and durably (a temporary file made afresh through no link, with ``mode``, synced to disk,
    then a rename, then the directory synced: a ``state_dir`` on disk holds the old file or the new one after a power
    loss, never an empty one). Raises OSError, or what ``parts`` raises; a failure leaves no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.unlink(missing_ok=True)  # (made afresh, through no link: the agent writes it as root)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode),
                       "w") as fh:
            for part in parts:
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_own_file(path: Path, limit: int = MAX_FILE_BYTES) -> tuple[str, float] | None:
    """The text and modification time of ``path``, a file the agent wrote itself (None: no such file), opened
    through no link (``O_NOFOLLOW``, and ``O_NONBLOCK``: a FIFO planted there does not block the agent) and read only
    when it is a plain file of the agent's own user (root), with one link and written by no one else (not group or
    other writable): a local user who can make a file or a link in ``state_dir`` cannot hand the next agent flows
    or a device's tree of its own. Raises OSError (with the reason) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not the agent's file") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_mode & 0o022:
            raise OSError(errno.EPERM, f"not the agent's own file (a plain file of uid {os.geteuid()}, one link, "
                                       f"not group or other writable; found uid {st.st_uid}, mode "
                                       f"{stat.filemode(st.st_mode)}, {st.st_nlink} links)")
        return fh.read(limit).decode(), st.st_mtime


def writer_runs(pid: int, start: int | None, unstamped_root: bool) -> bool:
    """Whether the agent that wrote a file in ``state_dir`` (its ``pid`` and ``start``, :func:`process_start`) still
    runs; never this agent. A pid alone is not enough: an agent's pid is free once it exits (a hand-over restart),
    and any local user can fork until it holds it. A file without ``start`` (None) counts as running only with
    ``unstamped_root`` (a device's record written before 2026-11-28, when records had none) and only where the
    process is the agent's own user's (root's: another user cannot start one); a flow table file without one
    (``unstamped_root`` False) counts as not running. Usage: ``writer_runs(pid, started, unstamped_root=True)``"""
    if pid == os.getpid():
        return False
    now = process_start(pid)
    if now is None:
        return False
    if start is not None:
        return now == start
    if not unstamped_root:
        return False
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.geteuid()
    except OSError:
        return False
