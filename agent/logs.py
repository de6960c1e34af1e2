"""Bounded logging of refusals: a client that is refused over and over must not fill the agent's log.

Usage: ``rl = RefusalLog(log); rl.note("user_limit", logging.WARNING, "refused %s", who); rl.flush()``
"""
from __future__ import annotations

import logging
import time


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
