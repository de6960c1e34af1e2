"""The agent's log: journald priorities, and bounded logging of refusals.

When stderr is the journal (``$JOURNAL_STREAM`` names it), each line starts with its syslog priority (``<4>``),
which journald strips and keeps, so ``journalctl -p warning`` filters; elsewhere lines carry a time stamp. A client
that is refused over and over must not fill the log: ``RefusalLog`` bounds those lines.
Usage: ``configure_logging("info")``; ``rl = RefusalLog(log); rl.note("user_limit", logging.WARNING, "refused %s",
who); rl.flush()``
"""
from __future__ import annotations

import logging
import os
import sys
import time

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"  # journald time-stamps each line itself


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level: 2 critical, 3 error, 4 warning, 6 info, 7 debug."""
    for threshold, prio in ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6)):
        if levelno >= threshold:
            return prio
    return 7


def stderr_is_journal(stream=None, env=None) -> bool:
    """True if ``stream`` (stderr) is the journal's stream: ``$JOURNAL_STREAM`` is its ``DEVICE:INODE``."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    try:
        st = os.fstat((sys.stderr if stream is None else stream).fileno())
        dev, ino = (int(x) for x in value.split(":"))
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class JournalFormatter(logging.Formatter):
    """Each line (each line of a multi-line record too) prefixed with the record's ``<priority>``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as the plain formatter writes it, every line prefixed with ``<N>``."""
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def journal_prefix(levelno: int, stream=None) -> str:
    """``<N>`` for a line written straight to ``stream`` (stderr) at ``levelno`` when it is the journal, else ''."""
    return f"<{syslog_priority(levelno)}>" if stderr_is_journal(stream) else ""


def configure_logging(level: str) -> None:
    """The agent's logging: ``level`` (debug, info, ...) to stderr, with journald priorities when it is the
    journal; pyroute2 and asyncio only from warnings."""
    handler = logging.StreamHandler()
    handler.setFormatter(JournalFormatter(JOURNAL_FORMAT) if stderr_is_journal() else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    logging.getLogger("pyroute2").setLevel(logging.WARNING)
    logging.getLogger("asyncio").setLevel(logging.WARNING)


class RefusalLog:
    """At most one log line per reason every ``every_s`` seconds; the lines left out are counted and reported by
    the next line of that reason, or by ``flush`` once ``every_s`` has passed without one."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0, clock=time.monotonic):
        """Log through ``logger``, at most one line per reason per ``every_s`` seconds of ``clock``."""
        self.log = logger
        self.every_s = every_s
        self.clock = clock
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}
        self.levels: dict[str, int] = {}
        self.lines = 0

    def note(self, reason: str, level: int, msg: str, *args) -> bool:
        """Log ``msg % args`` unless a line of ``reason`` was logged in the last ``every_s``; True if logged."""
        now = self.clock()
        last = self.last.get(reason)
        if last is not None and now - last < self.every_s:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1
            return False
        self.last[reason] = now
        self.levels[reason] = level
        n = self.suppressed.pop(reason, 0)
        if n:
            msg, args = msg + " (and %d more %s since the last such line)", (*args, n, reason)
        self.log.log(level, msg, *args)
        self.lines += 1
        return True

    def flush(self, force: bool = False) -> None:
        """Report the lines left out of a reason whose last line is ``every_s`` old (``force``: all of them, as the
        server stops). Cheap: one entry per reason."""
        if not self.suppressed:
            return
        now = self.clock()
        for reason, n in list(self.suppressed.items()):
            last = self.last[reason]
            if force or now - last >= self.every_s:
                del self.suppressed[reason]
                self.last[reason] = now
                self.log.log(self.levels.get(reason, logging.WARNING), "%d more %s since the last such line, %.1f "
                             "s ago (one line per %.0f s)", n, reason, now - last, self.every_s)
                self.lines += 1
