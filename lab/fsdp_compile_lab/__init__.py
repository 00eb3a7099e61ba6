"""fsdp_compile's measuring lab: what exists only to measure or predict the CPU machine the
project's figures are produced on. Not installed with the package: the tests and the benchmarks
put ``lab/`` on ``sys.path``.

It plugs into the planner through the planner's one extension point, a host model
(``Cluster(host=...)``, :mod:`fsdp_compile.planning.host_model`): :class:`HostCPU` is the model
of ranks computing on CPU cores and communicating through gloo (:mod:`.host`), measured with
``Cluster.measure(host=HostCPU)`` (:mod:`.calibration`).
"""

from .calibration.calibrate import backend_links
from .host import HOST_NUMBERS, HostCPU

__all__ = ["HOST_NUMBERS", "HostCPU", "backend_links"]
