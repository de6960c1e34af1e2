"""tc-style rates: ``"200mbit"``, ``"10gbit"``, ``"5000kbit"`` or bits per second as an int.

One parser for the agent's config, the testbed and the benchmarks; each caller states its own bounds.
Usage: ``parse_rate("200mbit") == 200_000_000``
"""
from __future__ import annotations

import re

_RATE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(value: int | str, low: int = 8_000, high: int = 4 * 10**12) -> int:
    """Bits per second of ``value``; ValueError (naming the accepted forms and bounds) when it is not a rate
    within ``low..high``."""
    if isinstance(value, int) and not isinstance(value, bool):
        bps = value
    elif isinstance(value, str) and (m := _RATE_RE.fullmatch(value)):
        bps = int(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()])
    else:
        raise ValueError(f"expected a rate such as '200mbit' or '10gbit' (bits per second), got {value!r}")
    if not low <= bps <= high:
        raise ValueError(f"rate {value!r} is {bps} bit/s, outside {fmt_rate(low)}..{fmt_rate(high)}")
    return bps


def fmt_rate(bps: int) -> str:
    """The shortest exact tc-style spelling: ``fmt_rate(200_000_000) == "200mbit"``."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bps >= scale and bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"
