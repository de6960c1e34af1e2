"""The token bucket behind the agent's request rates: the socket server's per connection (``rate_limit_per_s``)
and per user (``requests_per_user_per_s``, a request taking one more token per KiB of its line, per 16 open files a
register without fds read and per 0.5 ms of the agent's CPU time on it; pieces of lines one each), the metrics
address's per peer. Time is ``time.monotonic``'s.
Usage: ``bucket = TokenBucket(2.0, burst=8)``; ``if not bucket.take(): refuse()``
"""
from __future__ import annotations

import time


class TokenBucket:
    """``rate`` tokens a second, up to ``burst`` (``rate`` when not given), full at ``now``; ``tokens`` (those at
    ``stamp``) may be taken below zero by hand, for a request's size."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float | None = None, now: float | None = None):
        """A full bucket of ``rate`` tokens a second, up to ``burst``, counted from ``now`` (monotonic)."""
        self.rate = rate
        self.burst = rate if burst is None else burst
        self.tokens = self.burst
        self.stamp = time.monotonic() if now is None else now

    def take(self, now: float | None = None) -> bool:
        """Refill up to ``now`` (monotonic), then take one token; False, nothing taken, with less than one."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def charge(self, n: float, now: float | None = None) -> float:
        """Refill up to ``now`` (monotonic), then take ``n`` tokens, below zero if need be; the tokens left."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        return self.tokens

    def full(self, now: float) -> bool:
        """Whether the bucket has refilled to ``burst`` by ``now`` (a new one would be the same)."""
        return self.tokens + (now - self.stamp) * self.rate >= self.burst

    def wait_s(self) -> float:
        """Seconds from the last count (``stamp``) until the bucket has one token."""
        return (1 - self.tokens) / self.rate
