"""The planner: which strategy for a model on a cluster, predicted from the graphs a real run executes.

``plan()`` traces the backend's own pipeline on fake tensors in a fake world of the target
size, costs every node against a :class:`Cluster` and simulates the schedule; see
:mod:`.plan` and docs/planning.md.
"""

from .cluster import Cluster
from .plan import Plan, PlanError, PlanRow, plan
from .vocabulary import ClusterError, MeasuredCollective

__all__ = ["Cluster", "ClusterError", "MeasuredCollective", "Plan", "PlanError", "PlanRow", "plan"]
