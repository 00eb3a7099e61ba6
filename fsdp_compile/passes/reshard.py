"""Joint-graph passes that turn a strategy's reshard policy into partitioner decisions.

AOTAutograd's partitioner decides which forward values the backward graph receives. By default
it saves the full parameter an ``unshard`` produced (ZeRO-2 behaviour). For FULL_SHARD and
HYBRID_SHARD the full parameter must be dropped after forward and gathered again in backward,
so the marker and the views or casts of it are tagged must-recompute: the partitioner then
saves the (already resident) shard and re-runs the gather in the backward graph.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.markers import UNSHARD_TARGETS, decode
from .context import PassContext
from .graph import VIEW_LIKE, tag_parameter_input


def unshard_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in UNSHARD_TARGETS]


def elide_trivial_unshard(graph: fx.Graph) -> int:
    """Replace markers that neither gather nor cast by their input; returns how many.

    NO_SHARD parameters (and 0-d ones) are whole on every rank: their marker is a copy that
    exists only so the eager runtime never aliases a parameter. In a functional graph the copy
    is useless, and saving it for backward would double the parameter memory.
    """
    count = 0
    for node in unshard_nodes(graph):
        spec = decode(node).spec
        source = node.args[0]
        source_dtype = source.meta["val"].dtype if "val" in source.meta else None
        if spec.gathers or (spec.param_dtype is not None and spec.param_dtype != source_dtype):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        tag_parameter_input(source)
        count += 1
    return count


def tag_reshard_policy(graph: fx.Graph) -> int:
    """Tag each gather with its strategy's policy; returns how many gathers reshard.

    Resharding gathers (and their view chains) become must-recompute. The others become
    must-save, so ZeRO-2 behaviour is stated rather than left to the min-cut partitioner's
    cost model (which keeps custom ops today only because they are not on its recompute
    allowlist; re-running a gather there would silently double backward communication).
    """
    count = 0
    for node in unshard_nodes(graph):
        spec = decode(node).spec
        if not spec.gathers:
            continue
        if not spec.reshard_after_forward:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        count += 1
        pending = [node]
        while pending:
            current = pending.pop()
            current.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            pending.extend(u for u in current.users if u.op == "call_function" and u.target in VIEW_LIKE)
    return count


def elide_trivial_unshard_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pipeline entry of :func:`elide_trivial_unshard` (joint graph, and every graph after)."""
    return elide_trivial_unshard(gm.graph)


def tag_reshard_policy_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pipeline entry of :func:`tag_reshard_policy` (joint graph)."""
    return tag_reshard_policy(gm.graph)
