"""An emulated cluster network on one machine: :class:`EmulatedNetwork`, a testing tool.

It stands in for a cluster's links on a laptop or a CPU machine, to try strategies and their
overlap before a GPU job. It is separate from the product: no module of the package imports it to
do its own work (``import fsdp_compile`` does not load it; ``fsdp_compile.EmulatedNetwork`` and
``compare --emulate`` hand it to a user who asks). The planner measures its links through the
process group's own ``network`` attribute, and a group's timeout comes from the group, whatever
its class (:func:`fsdp_compile.sharding.groups.world_timeout`).

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
