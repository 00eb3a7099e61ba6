"""A captured joint graph's markers, given another backend's arguments.

Backends that shard the same model with the same shard shapes trace the same joint graph but
for the markers' arguments (their groups, the reshard flag, the bucket unit): rewritten to
another backend's, the graph is that backend's (``Compiler.replay``), without tracing again.
"""

from __future__ import annotations

import torch.fx as fx

from ..runtime.markers import REDUCE_GRAD, UNSHARD, decode
from ..sharding.sharded_param import ShardedParamInfo


def rewrite_markers(params: dict[str, ShardedParamInfo], graph: fx.Graph) -> dict[fx.Node, tuple]:
    """Give every marker of ``graph`` this backend's arguments for its parameter; returns
    the previous arguments by node."""
    previous = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (UNSHARD, REDUCE_GRAD):
            continue
        marker = decode(node)
        previous[node] = node.args
        info = params.get(marker.fqn)
        if info is None:
            raise ValueError(f"replaying a graph of parameter {marker.fqn!r}, which this backend did not shard")
        if node.target is UNSHARD:
            node.args = (marker.input, *info.unshard_args)
        else:
            node.args = (marker.input, info.fqn, info.unit, marker.rows, marker.grad_dtype, *info.comm.op_args())
        if decode(node).spec.shard_size != marker.spec.shard_size:
            raise ValueError(f"replaying a graph sharded over {marker.spec.shard_size} ranks with a backend "
                             f"that shards over {info.comm.shard_size}: trace this layout instead")
    return previous
