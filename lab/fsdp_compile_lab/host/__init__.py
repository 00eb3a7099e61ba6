"""The host-CPU model: what ranks computing on CPU cores and a CPU communication backend (gloo)
add to a step, behind one seam.

The planner's cost model (:mod:`fsdp_compile.planning.cost`) and simulator
(:mod:`fsdp_compile.planning.simulate`) are a GPU's: kernels at a roofline, collectives on links,
one compute stream and a stream per link. A cluster whose ranks share CPU cores carries a
:class:`HostCPU` (``Cluster.host``, the planner's host model hook, filled in by
``Cluster.measure(host=HostCPU)`` on a CPU), and the GPU model asks it, at one hook each, what a
node costs on this host (:mod:`.model`), what it adds to one rank's timeline (:mod:`.timeline`),
and, where the ranks outnumber the cores, what the step is with every rank played together
(:mod:`.shared_cores`).
"""

from .model import HOST_NUMBERS, HostCPU

__all__ = ["HOST_NUMBERS", "HostCPU"]
