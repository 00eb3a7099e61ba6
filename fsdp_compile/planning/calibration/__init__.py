"""The calibrations behind :meth:`Cluster.measure`, grouped by what they measure.

:mod:`.calibrate` runs them on every rank and builds the cluster (and explains the method);
:mod:`.compute`, :mod:`.outside_graphs`, :mod:`.collective_fits` and :mod:`.allocator` hold them.
"""
