"""Priority levels, DSCP code points and switch queues.

Level 0 is the most urgent. Each level gets a distinct DSCP value; the default table follows common switch
practice (trust DSCP, 8 queues, queue = DSCP >> 3, CS6/CS7 reserved for network control), so that every level
lands in its own strict-priority switch queue above best effort (queue 0):

    level  DSCP        switch queue
    0      EF   (46)   5
    1      AF41 (34)   4
    2      AF31 (26)   3
    3      AF21 (18)   2
    4      AF11 (10)   1
    (unregistered traffic keeps its DSCP; normally 0 -> queue 0)
"""
from __future__ import annotations

DSCP_NAMES: dict[str, int] = {
    "CS0": 0, "BE": 0, "CS1": 8, "AF11": 10, "AF12": 12, "AF13": 14,
    "CS2": 16, "AF21": 18, "AF22": 20, "AF23": 22, "CS3": 24, "AF31": 26, "AF32": 28, "AF33": 30,
    "CS4": 32, "AF41": 34, "AF42": 36, "AF43": 38, "CS5": 40, "VA": 44, "EF": 46, "CS6": 48, "CS7": 56,
}
DEFAULT_DSCP_TABLE: tuple[int, ...] = (46, 34, 26, 18, 10)
MAX_LEVELS = len(DEFAULT_DSCP_TABLE)  # distinct levels a DSCP-trusting switch tells apart here
DEFAULT_LEVELS = 4  # the agent's ``levels`` and the shim's ``levels=`` when none is given
SWITCH_QUEUES = 8
RESERVED_QUEUES = frozenset({6, 7})  # CS6 / CS7: network control


def parse_dscp(value: int | str) -> int:
    """Return the DSCP number for an int or a name such as "EF" or "af41"; raise ValueError otherwise.

    Usage: ``parse_dscp("AF41") == 34``
    """
    if isinstance(value, bool):
        raise ValueError(f"DSCP must be a number 0..63 or a name, not {value!r}")
    if isinstance(value, int):
        dscp = value
    elif isinstance(value, str) and value.strip().upper() in DSCP_NAMES:
        dscp = DSCP_NAMES[value.strip().upper()]
    elif isinstance(value, str) and value.strip().isdigit():
        dscp = int(value.strip())
    else:
        raise ValueError(f"DSCP must be a number 0..63 or one of {sorted(DSCP_NAMES)}, not {value!r}")
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP {dscp} out of range 0..63")
    return dscp


def switch_queue(dscp: int) -> int:
    """Strict-priority switch queue that a DSCP-trusting switch uses for ``dscp`` (7 is served first).

    Usage: ``switch_queue(46) == 5``
    """
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP {dscp} out of range 0..63")
    return dscp >> 3


def dscp_table(levels: int, overrides: dict[int, int | str] | None = None) -> tuple[int, ...]:
    """DSCP value for each level ``0..levels-1``: the default table, with per-level ``overrides``.

    Raises ValueError when the levels would not be told apart by a switch (two levels in one queue), when a level
    would use a reserved network-control queue, or when levels are out of order (a more urgent level in a lower
    queue). Usage: ``dscp_table(3) == (46, 34, 26)``
    """
    if not 1 <= levels <= len(DEFAULT_DSCP_TABLE):
        raise ValueError(f"levels must be 1..{len(DEFAULT_DSCP_TABLE)}, not {levels}")
    table = list(DEFAULT_DSCP_TABLE[:levels])
    for level, value in (overrides or {}).items():
        if not isinstance(level, int) or not 0 <= level < levels:
            raise ValueError(f"dscp override for level {level!r}: levels are 0..{levels - 1}")
        table[level] = parse_dscp(value)
    queues = [switch_queue(d) for d in table]
    for level, q in enumerate(queues):
        if q in RESERVED_QUEUES:
            raise ValueError(f"level {level}: DSCP {table[level]} maps to reserved switch queue {q}")
        if q == 0:
            raise ValueError(f"level {level}: DSCP {table[level]} maps to best-effort queue 0")
    for level in range(1, levels):
        if queues[level] >= queues[level - 1]:
            raise ValueError(
                f"levels {level - 1} and {level}: DSCP {table[level - 1]} and {table[level]} map to switch queues "
                f"{queues[level - 1]} and {queues[level]}; each level needs a lower queue than the one before"
            )
    return tuple(table)
