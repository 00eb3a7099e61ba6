"""The link model of an emulated network: a link moves one collective at a time, in
``latency + wire_bytes / bandwidth`` seconds; wire bytes follow the ring model every part shares
(:mod:`fsdp_compile.runtime.ring`), extended to the other collectives a process group carries.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..runtime import ring

RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The kinds a process group can issue; "barrier" moves no data.
KINDS = (*RING_KINDS, "broadcast", "reduce", "gather", "scatter", "all_to_all", "send", "recv", "barrier")

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2.0 ** 10, "mi": 2.0 ** 20, "gi": 2.0 ** 30, "ti": 2.0 ** 40}
_NUMBER = r"^\s*(?P<number>[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*"
_BANDWIDTH = re.compile(_NUMBER + r"(?P<prefix>[kmgt]i?)?(?P<unit>B|b|bit|bits)(?:/s|ps)\s*$", re.IGNORECASE)
_LATENCY = re.compile(_NUMBER + r"(?P<unit>s|ms|us|µs|ns)\s*$", re.IGNORECASE)
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

BANDWIDTH_FORMS = ('a number of bytes per second (2e9, float("inf") for an unlimited link) or a string such as '
                   '"2GB/s", "200MB/s", "1.5GiB/s" (bytes; k, M, G, T decimal, Ki, Mi, Gi, Ti binary) or '
                   '"10Gbit/s", "100Gb/s", "25Gbps" (bits)')
LATENCY_FORMS = 'a number of seconds (2e-5) or a string such as "20us", "0.5ms", "1e-5s", "800ns"'


def _matched(value: Any, argument: str, what: str, pattern: re.Pattern, forms: str) -> re.Match | float:
    """A number as a float (True is an int to Python, but never a quantity), else the string's match."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        raise TypeError(f"{argument}= must be {forms}; got {type(value).__name__} {value!r}")
    match = pattern.match(value)
    if match is None:
        raise ValueError(f"{argument}={value!r} is not a {what} this understands; pass {forms}")
    return match


def parse_bandwidth(value: Any, argument: str = "bandwidth") -> float:
    """Bytes per second from a number (bytes/s) or a string with a unit; ``argument`` names the
    parameter in errors."""
    number = _matched(value, argument, "bandwidth", _BANDWIDTH, BANDWIDTH_FORMS)
    if isinstance(number, re.Match):
        bits = number["unit"].lower().startswith("bit") or number["unit"] == "b"
        number = float(number["number"]) * _PREFIXES[(number["prefix"] or "").lower()] / (8 if bits else 1)
    if math.isnan(number) or number <= 0:
        raise ValueError(f"{argument}={value!r}: a bandwidth must be positive; pass {BANDWIDTH_FORMS}")
    return number


def parse_latency(value: Any, argument: str = "latency") -> float:
    """Seconds from a number (seconds) or a string with a unit; ``argument`` names the parameter
    in errors."""
    number = _matched(value, argument, "latency", _LATENCY, LATENCY_FORMS)
    if isinstance(number, re.Match):
        number = float(number["number"]) * _SECONDS[number["unit"].lower()]
    # No real link answers in no time: a latency of 0 is a mistake for a unit (20 with no "us").
    if math.isnan(number) or math.isinf(number) or number <= 0:
        raise ValueError(f"{argument}={value!r}: a latency must be a positive, finite number of seconds; "
                         f"pass {LATENCY_FORMS}")
    return number


def wire_bytes(kind: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes each rank sends for one collective on ``group_size`` ranks, ``buffer_bytes`` being
    the whole the collective moves (gathered, scattered, reduced or sent). Beyond the ring kinds,
    gather, scatter and all-to-all send all but one's own share; a pipelined broadcast or reduce
    passes the buffer along the chain once; a barrier moves nothing."""
    if kind in RING_KINDS:
        return ring.wire_bytes(kind, buffer_bytes, group_size)
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(KINDS)}")
    if kind in ("send", "recv") or (group_size > 1 and kind in ("broadcast", "reduce")):
        return float(buffer_bytes)
    if group_size <= 1 or kind == "barrier":
        return 0.0
    return (group_size - 1) / group_size * buffer_bytes


# Links that add nothing to gloo's own time: a step run on them costs its compute plus gloo's.
UNLIMITED_LINKS: dict[str, float] = {"intra_node": math.inf, "inter_node": math.inf, "latency": 1e-9}


@contextlib.contextmanager
def unlimited_links(network: Any) -> Iterator[None]:
    """``network``'s links add nothing to gloo's time while open (on every rank, between steps)."""
    links = network.links()
    network.set_links(**UNLIMITED_LINKS)
    try:
        yield
    finally:
        network.set_links(intra_node=links["intra"].bandwidth, inter_node=links["inter"].bandwidth,
                          latency=links["intra"].latency)


@dataclass(frozen=True)
class Link:
    """One rank's link of a kind ("intra": within a node, "inter": between nodes)."""

    name: str
    bandwidth: float  # bytes per second (inf: unlimited)
    latency: float  # seconds per collective

    def seconds(self, kind: str, buffer_bytes: float, group_size: int) -> float:
        """``latency + wire bytes / bandwidth``; 0 for a group of one rank (a message always pays)."""
        if group_size <= 1 and kind not in ("send", "recv"):
            return 0.0
        wire = wire_bytes(kind, buffer_bytes, group_size)
        return self.latency + (wire / self.bandwidth if wire else 0.0)


def format_bandwidth(bytes_per_second: float) -> str:
    if math.isinf(bytes_per_second):
        return "unlimited"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:.4g}{unit}"
    return f"{bytes_per_second:.4g}B/s"


def format_seconds(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g}{unit}"
    return f"{seconds / 1e-9:.4g}ns"
