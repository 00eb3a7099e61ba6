"""An emulated cluster network on one machine: :class:`EmulatedNetwork`.

``links``: units, the link model and the ring model of wire bytes; ``emulated``: the
process-group backend and its work; ``stats``: what the links carried and where gloo overran
the model; ``lateness``: how much of that a late peer explains, and how much gloo itself.
"""

from .emulated import EmulatedNetwork, EmulatedProcessGroup, EmulatedWork
from .lateness import LatenessCauses, lateness_causes
from .links import Link, parse_bandwidth, parse_latency, wire_bytes
from .stats import LinkUsage, NetworkStats, Overruns

__all__ = ["EmulatedNetwork", "EmulatedProcessGroup", "EmulatedWork", "LatenessCauses", "Link", "LinkUsage",
           "NetworkStats", "Overruns", "lateness_causes", "parse_bandwidth", "parse_latency", "wire_bytes"]
