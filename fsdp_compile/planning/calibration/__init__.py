"""The calibrations behind :meth:`Cluster.measure`, grouped by what they measure.

:mod:`.calibrate` runs them on every rank and builds the cluster (and explains the method);
:mod:`.compute`, :mod:`.outside_graphs`, :mod:`.collectives` and :mod:`.memory` hold them.
"""
