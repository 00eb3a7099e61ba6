"""What a captured graph's inputs must be (shards this backend made), and the graph that is
nothing but one parameter read, which runs as Python instead of compiling."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.markers import UNSHARD
from ..sharding.backend_state import ShardingState
from ..sharding.sharded_class import gathered_parameter
from ..sharding.sharded_param import leaf_owner, sharded_name
from .guard import parameter_name
from .records import CompiledGraph


def check_inputs(state: ShardingState, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raise, naming the parameter, where a captured graph takes one this backend did not shard."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, nn.Parameter) or state.owns(value):
            continue
        owner = leaf_owner(value)
        if owner is not None and owner in state.local_shards:
            continue
        name = sharded_name(value) or parameter_name(node)
        if isinstance(value, DTensor) or owner is not None:
            what = "a DTensor" if isinstance(value, DTensor) else "the shard of a parameter"
            raise RuntimeError(f"parameter {name!r} is {what} that this backend did not shard; compile a "
                               "model with the backend whose shard() sharded it")
        raise RuntimeError(f"parameter {name!r} is not sharded: call backend.shard(model) before "
                           "torch.compile(model, backend=backend) (or use fsdp_compile.compile(model, ...))")


def lone_read(gm: fx.GraphModule) -> fx.Node | None:
    """The read, when a captured graph does nothing but read one sharded parameter (an
    ``unshard`` marker on an input, returned as the graph's only output); else None."""
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    if len(nodes) != 2 or nodes[0].op != "call_function" or nodes[0].target not in (UNSHARD, UNSHARD.overloadpacket):
        return None
    marker, output = nodes
    returned = output.args[0]
    if not (isinstance(returned, (tuple, list)) and list(returned) == [marker]) and returned is not marker:
        return None
    return marker if marker.args[0].op == "placeholder" else None


def read_as_python(state: ShardingState, record: CompiledGraph, read: fx.Node,
                   example_inputs: Sequence[Any]) -> Callable:
    """A lone read, a frame Dynamo compiled from code it runs as Python (after a graph break), runs
    as Python too, so that it gathers with its bucket (sharding/sharded_class.py: eager_read), not alone."""
    fqn, *_ = read.args[1:]
    placeholders = [n for n in record.dynamo.graph.nodes if n.op == "placeholder"]
    leaf = example_inputs[placeholders.index(read.args[0])]
    shards = next(s for s in state.local_shards if s.leaves.get(fqn) is leaf)
    marker_args = shards.read_args[fqn]
    record.python_read = fqn
    fallback = state.region_fallback

    def run(*args: Any) -> tuple[torch.Tensor]:
        fallback.graph_runs += 1
        return (gathered_parameter(fqn, marker_args, shards),)

    return run
