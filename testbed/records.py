"""Ownership records of testbeds: ``/run/tensorlane-testbed/{name}.json`` lists the namespaces a testbed made.

A namespace is added to the record *before* it is created, so a crash never leaves an unlisted namespace; tear
down removes only listed namespaces that also carry the testbed's prefix. A per-name ``flock`` (``{name}.lock``,
left in place on purpose: unlinking a lock file races with its waiters) serialises ``up`` and ``down`` of one name.
The record names its builder by pid and start time, so that a dead builder's leftover can be told from a testbed in
use (``builder_alive``).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator

STATE_DIR = "/run/tensorlane-testbed"
NAME_RE = re.compile(r"[a-z0-9]{1,8}")
LOCK_TIMEOUT_S = 30.0


def record_path(name: str) -> str:
    """Path of the ownership record of testbed ``name``."""
    return os.path.join(STATE_DIR, f"{name}.json")


def owned_netns_re(name: str) -> re.Pattern[str]:
    """Pattern that every namespace of testbed ``name`` matches: ``{name}-sw`` or ``{name}-h{index}``."""
    return re.compile(rf"{re.escape(name)}-(sw|h[1-9][0-9]?)")


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), None if it has none.

    A pid is reused after its process ends; the pair (pid, start) names one process for as long as the host runs.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": field 3 onwards; comm may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def builder_alive(record: dict) -> int | None:
    """The pid that built the testbed of ``record`` if that very process still runs (and is not this one), else None.

    A record with ``pid_start`` names its builder exactly; an older record only by pid, so a reused pid reads as alive
    (the safe side: a testbed is never taken from a running builder).
    """
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1 or pid == os.getpid():
        return None
    start = process_start(pid)
    if start is None:
        return None
    expected = record.get("pid_start")
    if isinstance(expected, int) and expected != start:
        return None
    return pid


def read_record(name: str) -> dict | None:
    """The record of ``name`` as a dict, or None if there is none (an unreadable record reads as an empty one)."""
    try:
        with open(record_path(name), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"name": name, "netns": []}
    return data if isinstance(data, dict) else {"name": name, "netns": []}


def write_record(name: str, data: dict) -> None:
    """Write the record of ``name`` atomically (temporary file, fsync, rename)."""
    os.makedirs(STATE_DIR, mode=0o755, exist_ok=True)
    path = record_path(name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_record(name: str) -> None:
    """Delete the record of ``name`` if present."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(name))


def recorded_names() -> list[str]:
    """Names of all testbeds that have a record, sorted."""
    try:
        entries = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return []
    names = (e[: -len(".json")] for e in entries if e.endswith(".json"))
    return sorted(n for n in names if NAME_RE.fullmatch(n))


@contextlib.contextmanager
def name_lock(name: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive per-name lock for the block; raise TimeoutError after ``timeout`` seconds of waiting."""
    os.makedirs(STATE_DIR, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(STATE_DIR, f"{name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    lock = os.path.join(STATE_DIR, f"{name}.lock")
                    raise TimeoutError(f"testbed {name!r} is locked by another process ({lock})") from e
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
