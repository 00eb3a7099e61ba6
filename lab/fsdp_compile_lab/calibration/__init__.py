"""The host-CPU model's calibrations, run by ``Cluster.measure(host=HostCPU)`` after the device's
own (:mod:`fsdp_compile.planning.calibration`): :mod:`.calibrate` runs them in order;
:mod:`.copies`, :mod:`.host_collectives` and :mod:`.drift` hold them.
"""
