"""The agent's local API: newline-delimited JSON over a Unix stream socket (documented in docs/protocol.md).

Requests are ``{"op": ..., "id": ...optional, ...}``; replies are ``{"id": ..., "ok": true, "result": {...}}`` or
``{"id": ..., "ok": false, "error": {"code": ..., "message": ...}}``. This module only parses and validates: it
does no I/O. Usage: ``req = parse_request(line)``
"""
from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass

from tensorlane.client import (
    JOB_ID_RE,
    JOB_ID_RULE,
    MAX_COMPUTE_S,
    MAX_FLOWS_PER_MESSAGE,
    MAX_MESSAGE_BYTES,
    MAX_RANK,
    MAX_REPORT_LEVELS,
    MAX_WINDOW_STEPS,
    OPS,
)
from tensorlane.flows import FlowKey

PROTOCOLS = {"tcp": 6, "udp": 17}


MAX_FD = 2**31 - 1  # a file descriptor number is a C int (RLIMIT_NOFILE allows up to about 2**30 today)


class ProtocolError(ValueError):
    """A request is malformed; ``code`` is a stable machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    op: str
    id: object = None
    job: str | None = None
    level: int | None = None
    rank: int | None = None
    flows: tuple[FlowKey, ...] = ()
    fds: tuple[int, ...] | None = None  # register: the fd of the client's process holding each flow's socket (order)
    session: str | None = None
    run: str | None = None  # register: one run of the job (the same on all its ranks), to tell two jobs apart
    counters: tuple[tuple[int, int, int, float], ...] = ()  # report: (level, allreduces, bytes, comm_s)
    step_bytes: int | None = None  # report: bytes one training step all-reduces (job_policy "shortest")
    compute_s: float | None = None  # report: compute seconds per training step, agreed by the job's ranks
    tail_bytes: int | None = None  # report: bytes of a step's last bucket, waited for after backward ("slowdown")
    window_start: float | None = None  # report: wall-clock time the job's window of steps began (job_policy "slowdown")
    window_steps: int | None = None  # report: the steps ended since window_start (job_policy "slowdown")
    after: FlowKey | None = None  # list: the page after this flow (the last one of the previous page)


def _port(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ProtocolError("bad_flow", f"{name} must be a port 1..65535, got {value!r}")
    return value


_LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def _host_address(addr, name: str):
    """``addr`` with an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) turned into IPv4 (compared and stored so);
    refused unless it can be one end of a unicast flow: not unspecified, multicast or the limited broadcast."""
    addr = getattr(addr, "ipv4_mapped", None) or addr
    if getattr(addr, "scope_id", None):  # "fe80::1%eth0": the kernel's tables and maps key by address alone
        raise ProtocolError("bad_flow", f"{name} {addr} has a scope id; give the address alone")
    if addr.is_unspecified or addr.is_multicast or addr == _LIMITED_BROADCAST:
        kind = ("unspecified" if addr.is_unspecified else "multicast" if addr.is_multicast
                else "the limited broadcast address")
        raise ProtocolError("bad_flow", f"{name} {addr} is {kind}, not a unicast host address")
    return addr


def parse_flow(obj) -> FlowKey:
    """Validate one flow object ``{"proto","src","sport","dst","dport"}``. Usage: ``parse_flow({...})``"""
    if not isinstance(obj, dict):
        raise ProtocolError("bad_flow", f"a flow must be an object, got {type(obj).__name__}")
    unknown = set(obj) - {"proto", "src", "sport", "dst", "dport"}
    if unknown:
        raise ProtocolError("bad_flow", f"unknown flow field {sorted(unknown)[0]!r}")
    proto = obj.get("proto", "tcp")
    if not isinstance(proto, str) or proto not in PROTOCOLS:
        raise ProtocolError("bad_flow", f"proto must be one of {sorted(PROTOCOLS)}, got {proto!r}")
    try:
        src = ipaddress.ip_address(obj.get("src"))
        dst = ipaddress.ip_address(obj.get("dst"))
    except (ValueError, TypeError):
        raise ProtocolError("bad_flow", f"src and dst must be IP addresses, got {obj.get('src')!r}, "
                                        f"{obj.get('dst')!r}") from None
    src, dst = _host_address(src, "src"), _host_address(dst, "dst")
    if src.version != dst.version:
        raise ProtocolError("bad_flow", f"src {src} and dst {dst} are of different IP versions")
    return FlowKey(proto, str(src), _port(obj.get("sport"), "sport"), str(dst), _port(obj.get("dport"), "dport"))


def _count(obj: dict, name: str, kind: type) -> int | float:
    value = obj.get(name)
    ok = not isinstance(value, bool) and (isinstance(value, int) or kind is float and isinstance(value, float))
    if not ok or value < 0 or (isinstance(value, float) and not math.isfinite(value)) or value >= 2**63:
        raise ProtocolError("bad_request", f"{name} must be a non-negative {'number' if kind is float else 'integer'}"
                                           f", got {value!r}")
    return value


def parse_counters(raw) -> tuple[tuple[int, int, int, float], ...]:
    """Validate a report's ``levels``: 1..16 objects ``{level, allreduces, bytes, comm_s}``, each level once."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_REPORT_LEVELS:
        raise ProtocolError("bad_request", f"levels must be a list of 1..{MAX_REPORT_LEVELS} objects")
    out, seen = [], set()
    for obj in raw:
        if not isinstance(obj, dict):
            raise ProtocolError("bad_request", f"each entry of levels must be an object, got {type(obj).__name__}")
        unknown = set(obj) - {"level", "allreduces", "bytes", "comm_s"}
        if unknown:
            raise ProtocolError("bad_request", f"unknown field {sorted(unknown)[0]!r} in levels")
        level = obj.get("level")
        if isinstance(level, bool) or not isinstance(level, int) or level < 0:
            raise ProtocolError("bad_level", f"level must be a non-negative integer, got {level!r}")
        if level in seen:
            raise ProtocolError("bad_request", f"level {level} appears twice")
        seen.add(level)
        out.append((level, _count(obj, "allreduces", int), _count(obj, "bytes", int),
                    float(_count(obj, "comm_s", float))))
    return tuple(out)


def _parse_fds(raw, keys: list[FlowKey], flows: tuple[FlowKey, ...]) -> tuple[int, ...]:
    """``fds`` of a register: one file descriptor number (0..MAX_FD) per flow of ``flows`` as sent (``keys``), in
    order; a flow sent twice must name the same fd. Returned in the order of the deduplicated ``flows``."""
    if not isinstance(raw, list) or len(raw) != len(keys):
        raise ProtocolError("bad_request", f"fds must be a list of one file descriptor per flow ({len(keys)})")
    by_flow: dict[FlowKey, int] = {}
    for key, fd in zip(keys, raw, strict=True):
        if isinstance(fd, bool) or not isinstance(fd, int) or not 0 <= fd <= MAX_FD:
            raise ProtocolError("bad_request", f"fds must be integers 0..{MAX_FD}, got {fd!r:.40}")
        if by_flow.setdefault(key, fd) != fd:
            raise ProtocolError("bad_request", f"flow {key} is given two fds ({by_flow[key]} and {fd})")
    return tuple(by_flow[k] for k in flows)


def parse_request(line: bytes | str) -> Request:
    """Parse and validate one request line; raise ProtocolError with a precise reason."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"message of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad_json", "JSON nested too deeply") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_request", "a request must be a JSON object")
    op = msg.get("op")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op!r}; known: {', '.join(OPS)}")
    rid = msg.get("id")
    if rid is not None and not isinstance(rid, (int, str)) or isinstance(rid, bool):
        raise ProtocolError("bad_request", "id must be a string or an integer")
    allowed = {"op", "id"} | {
        "register": {"job", "level", "rank", "flows", "run", "fds"}, "unregister": {"job", "flows"},
        "list": {"job", "after"},
        "report": {"job", "session", "levels", "step_bytes", "compute_s", "tail_bytes", "window_start",
                   "window_steps"},
    }.get(op, set())
    unknown = set(msg) - allowed
    if unknown:
        raise ProtocolError("bad_request", f"unknown field {sorted(unknown)[0]!r} for op {op}")
    job = msg.get("job")
    if (op in ("register", "unregister", "report") or job is not None) and (
            not isinstance(job, str) or not JOB_ID_RE.match(job)):
            raise ProtocolError("bad_job", f"job must be {JOB_ID_RULE}; got {job!r}")
    level = msg.get("level")
    if op == "register" and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
        raise ProtocolError("bad_level", f"level must be a non-negative integer, got {level!r}")
    rank = msg.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK):
        # (bounded: listed with each of the job's flows, a 4,000-digit rank on a few hundred of one user's flows made
        # every page of root's list over the 1 MiB of unread replies, and its connection was closed)
        raise ProtocolError("bad_request", f"rank must be an integer 0..{MAX_RANK}, got {rank!r:.40}")
    flows_raw = msg.get("flows", [] if op == "unregister" else None)
    flows: tuple[FlowKey, ...] = ()
    if op in ("register", "unregister"):
        if not isinstance(flows_raw, list):
            raise ProtocolError("bad_flow", "flows must be a list of flow objects")
        if op == "register" and not flows_raw:
            raise ProtocolError("bad_flow", "register needs at least one flow")
        if len(flows_raw) > MAX_FLOWS_PER_MESSAGE:
            raise ProtocolError("too_large", f"{len(flows_raw)} flows exceed {MAX_FLOWS_PER_MESSAGE} per message")
        keys = [parse_flow(f) for f in flows_raw]
        flows = tuple(dict.fromkeys(keys))
    fds = None
    if op == "register" and msg.get("fds") is not None:
        fds = _parse_fds(msg["fds"], keys, flows)
    run = msg.get("run")
    if run is not None and (not isinstance(run, str) or not JOB_ID_RE.match(run)):
        raise ProtocolError("bad_request", f"run must be {JOB_ID_RULE}; got {run!r}")
    session, counters, step_bytes, compute_s, window_start, window_steps = None, (), None, None, None, None
    tail_bytes = None
    if op == "report":
        session = msg.get("session")
        if not isinstance(session, str) or not JOB_ID_RE.match(session):
            raise ProtocolError("bad_request", f"session must be {JOB_ID_RULE}; got {session!r}")
        counters = parse_counters(msg.get("levels"))
        if msg.get("step_bytes") is not None:
            step_bytes = _count(msg, "step_bytes", int)
        if msg.get("compute_s") is not None:
            compute_s = float(_count(msg, "compute_s", float))
            if compute_s > MAX_COMPUTE_S:
                raise ProtocolError("bad_request", f"compute_s must be at most {MAX_COMPUTE_S:g} seconds, "
                                                   f"got {compute_s!r}")
        if msg.get("tail_bytes") is not None:
            tail_bytes = _count(msg, "tail_bytes", int)
        if msg.get("window_start") is not None:
            window_start = float(_count(msg, "window_start", float))
        if msg.get("window_steps") is not None:
            window_steps = _count(msg, "window_steps", int)
            if window_steps > MAX_WINDOW_STEPS:
                raise ProtocolError("bad_request", f"window_steps must be at most {MAX_WINDOW_STEPS}, "
                                                   f"got {window_steps!r}")
    after = parse_flow(msg["after"]) if msg.get("after") is not None else None
    return Request(op=op, id=rid, job=job, level=level, rank=rank, flows=flows, fds=fds, session=session, run=run,
                   counters=counters, step_bytes=step_bytes, compute_s=compute_s, tail_bytes=tail_bytes,
                   window_start=window_start, window_steps=window_steps, after=after)


def ok(rid, result: dict) -> bytes:
    """Encode a success reply line."""
    return json.dumps({"id": rid, "ok": True, "result": result}, separators=(",", ":")).encode() + b"\n"


def error(rid, code: str, message: str) -> bytes:
    """Encode an error reply line."""
    return json.dumps({"id": rid, "ok": False, "error": {"code": code, "message": message}},
                      separators=(",", ":")).encode() + b"\n"
