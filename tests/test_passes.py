"""Joint-graph passes on small hand-made graphs (no communication: the markers are traced fake)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import fsdp_compile  # noqa: F401  (registers the markers)
from fsdp_compile.graphinfo import marker_counts, saved_gathered_parameters
from fsdp_compile.passes.reshard import elide_trivial_unshard, tag_reshard_policy
from fsdp_compile.runtime.collectives import CommSpec


def spec(**overrides) -> CommSpec:
    fields = dict(shard_group="g", shard_size=2, dim0_sharded=True, replicate_group="", replicate_size=1,
                  param_dtype=None, reduce_dtype=None, reshard_after_forward=True)
    fields.update(overrides)
    return CommSpec(**fields)


def linear_graph(comm: CommSpec) -> torch.fx.GraphModule:
    """x @ W.t() where W (8 x 4) is gathered from a 4 x 4 shard."""
    def f(shard, x):
        weight = torch.ops.fsdp_compile.unshard(shard, "w", "", 8, *comm.op_args())
        return x @ weight.t()
    return make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(3, 4))


def node_by_target(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_resharding_gather_and_its_views_become_must_recompute() -> None:
    gm = linear_graph(spec(reshard_after_forward=True))
    assert tag_reshard_policy(gm.graph) == 1
    (unshard,) = node_by_target(gm, "unshard")
    (transpose,) = node_by_target(gm, "aten.t")
    (matmul,) = node_by_target(gm, "aten.mm")
    assert unshard.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
    assert transpose.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in matmul.meta  # compute is left to the partitioner


def test_kept_gather_becomes_must_save() -> None:
    gm = linear_graph(spec(reshard_after_forward=False))
    assert tag_reshard_policy(gm.graph) == 0
    (unshard,) = node_by_target(gm, "unshard")
    (transpose,) = node_by_target(gm, "aten.t")
    assert unshard.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert "recompute" not in transpose.meta


def test_marker_that_neither_gathers_nor_casts_is_removed() -> None:
    gm = linear_graph(spec(shard_group="", shard_size=1, dim0_sharded=False, replicate_group="w", replicate_size=2))
    # A 4 x 4 "shard" that is whole: the marker's output is the input itself.
    assert elide_trivial_unshard(gm.graph) == 1
    gm.recompile()
    assert marker_counts(gm)["unshard"] == 0
    (transpose,) = node_by_target(gm, "aten.t")
    assert transpose.args[0].op == "placeholder"


def test_marker_that_gathers_or_casts_is_kept() -> None:
    gathers = linear_graph(spec())
    assert elide_trivial_unshard(gathers.graph) == 0
    casts = linear_graph(spec(shard_size=1, dim0_sharded=False, param_dtype=torch.bfloat16))
    assert elide_trivial_unshard(casts.graph) == 0


def test_saved_gathered_parameters_sees_through_views() -> None:
    def f(shard, x):
        weight = torch.ops.fsdp_compile.unshard(shard, "w", "", 8, *spec().op_args())
        transposed = weight.t()
        return x @ transposed, transposed, x
    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(3, 4))
    assert saved_gathered_parameters(gm) == ["t"]
