"""The planner's seam: this backend's own pipeline run on fake tensors, in a fake world.

The planner (:mod:`fsdp_compile.planning`) prices a strategy by tracing what the backend would
compile for it: :func:`trace_for_planning` runs Dynamo, AOTAutograd, the reshard policy, the
partitioner and our passes on fake inputs; :func:`replay_for_planning` reuses a joint graph
another backend traced for the same model, with this backend's markers. These two functions
are all the planner uses of the compile pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..passes.graph import copy_graph_module
from ..runtime.markers import REDUCE_GRAD, UNSHARD, decode
from ..sharding.sharded_param import ShardedParamInfo
from .records import CompiledGraph, JointCapture

if TYPE_CHECKING:
    from .compiler import Compiler


def trace_for_planning(
    compiler: Compiler, fn: Callable, example_inputs: Sequence[Any], *, keep_joint: bool = False,
    dynamo_pass: Callable[[fx.GraphModule], None] | None = None, fake_mode: Any = None,
) -> tuple[list[CompiledGraph], list[JointCapture]]:
    """Run ``fn(*example_inputs)`` through ``torch.compile`` with this backend: Dynamo capture,
    AOTAutograd, the reshard policy, partitioning and our passes, backward included.

    Nothing is compiled for a device (the inner compiler is ``aot_eager``) and with fake
    inputs and a model sharded by ``shard(model, materialize=False)`` nothing is allocated.
    ``dynamo_pass`` may rewrite each Dynamo graph first (the planner maps attention to the
    kernel the target device dispatches to). With ``keep_joint`` the joint graph of each
    Dynamo graph is kept, before our joint passes, for :func:`replay_for_planning`.
    ``fake_mode``: the FakeTensorMode of fake inputs; the compiled graphs run under it, so
    tensors they create (``arange``) are fake too. Returns the records of the graphs
    compiled by this call and the joints.
    """
    if compiler.options.compiler != "aot_eager":
        raise ValueError("planning traces with compiler='aot_eager' (nothing is compiled for a device)")
    start = len(compiler.graphs)
    captures: list[JointCapture] = []
    compiler.joint_captures = captures if keep_joint else None

    def capture(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        if dynamo_pass is not None:
            dynamo_pass(gm)
            gm.recompile()
        compiled = compiler(gm, inputs)
        if fake_mode is None:
            return compiled

        def run(*args: Any) -> Any:
            with fake_mode:
                return compiled(*args)
        return run

    functorch_patches = {}
    if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        functorch_patches["force_non_lazy_backward_lowering"] = True  # lower backward now, not at .backward()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    dynamo_patches = {limit: 1 << 20, "accumulated_" + limit: 1 << 20, "automatic_dynamic_shapes": False}
    try:
        with torch._functorch.config.patch(**functorch_patches), torch._dynamo.config.patch(**dynamo_patches):
            output = torch.compile(fn, backend=capture)(*example_inputs)
            records = compiler.graphs[start:]
            if any(r.backward is None and not r.inference for r in records):
                # A torch whose AOTAutograd lowers backward lazily: run it (on fake tensors).
                loss = [t for t in torch.utils._pytree.tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                if loss:
                    torch.autograd.backward(loss, [torch.ones_like(t) for t in loss])
    finally:
        compiler.joint_captures = None
    return compiler.graphs[start:], captures


def replay_for_planning(
    compiler: Compiler, capture: JointCapture, partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None,
) -> tuple[CompiledGraph, tuple[fx.GraphModule, fx.GraphModule]]:
    """What this backend's pipeline makes of a joint graph another backend captured.

    Valid when both sharded the same model with the same shard shapes, so the joint graphs
    differ only in the markers' arguments (groups, reshard flag, bucket unit): they are
    rewritten to this backend's, then partitioned under this backend's reshard policy (or
    ``partitioned`` reused, when the caller knows the policy is the same) and our passes
    run. Returns the record and the partitioned graphs, before our passes.
    """
    record = CompiledGraph(index=len(compiler.graphs), dynamo=capture.record.dynamo, compiler="aot_eager")
    compiler.graphs.append(record)
    if partitioned is None:
        from torch._guards import detect_fake_mode

        joint = copy_graph_module(capture.joint)
        rewrite_markers(compiler.state.params, joint.graph)
        # The partitioner may make fake tensors (RNG states of checkpointed regions) in the
        # fake mode AOTAutograd traced with, which is no longer active here.
        fake_mode = detect_fake_mode(capture.inputs)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            partitioned = compiler.partition(joint, capture.inputs, record, **capture.kwargs)
    for phase, gm in zip(("forward", "backward"), partitioned):
        # Our passes rewrite the graph they are given in place, and the partitioned graphs
        # are shared between candidates: a copy carrying this backend's markers gets them.
        previous = rewrite_markers(compiler.state.params, gm.graph)
        try:
            mine = copy_graph_module(gm)
        finally:
            for node, args in previous.items():
                node.args = args
        compiler.graph_passes(mine, phase, record)
    return record, partitioned


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
