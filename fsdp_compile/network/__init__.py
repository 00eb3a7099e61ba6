"""An emulated cluster network on one machine: :class:`EmulatedNetwork`, a testing tool.

It stands in for a cluster's links on a CPU machine, to try strategies and their overlap before
a GPU job. No module of the package imports it to do its own work: ``fsdp_compile.EmulatedNetwork``
and ``compare --emulate`` load it for a user who asks, and the planner reaches its links through
the process group's ``network`` attribute.
"""

from .emulated import EmulatedNetwork, EmulatedProcessGroup, EmulatedWork
from .lateness import LatenessCauses, lateness_causes
from .links import Link, parse_bandwidth, parse_latency, wire_bytes
from .stats import LinkUsage, NetworkStats, Overruns

__all__ = ["EmulatedNetwork", "EmulatedProcessGroup", "EmulatedWork", "LatenessCauses", "Link", "LinkUsage",
           "NetworkStats", "Overruns", "lateness_causes", "parse_bandwidth", "parse_latency", "wire_bytes"]
