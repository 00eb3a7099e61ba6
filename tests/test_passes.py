"""Joint-graph passes on small hand-made graphs (no communication: the markers are traced fake)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import fsdp_compile  # noqa: F401  (registers the markers)
from fsdp_compile.inspection.graphinfo import marker_counts, saved_gathered_parameters
from fsdp_compile.passes.save_or_regather import elide_trivial_unshard, tag_reshard_policy
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


def test_everything_computed_from_resharded_gathers_alone_becomes_must_recompute() -> None:
    """A float8 weight's cast chain (amax, scale, saturating cast) and a sum of two gathered
    weights are functions of the parameters only: saving any of them would keep a full-size
    copy of a resharded parameter from forward to backward."""
    comm = spec(reshard_after_forward=True)

    def f(shard_a, shard_b, x):
        a = torch.ops.fsdp_compile.unshard(shard_a, "a", "", 8, *comm.op_args())
        b = torch.ops.fsdp_compile.unshard(shard_b, "b", "", 8, *comm.op_args())
        scale = 448.0 / a.abs().amax().clamp(min=1e-12)
        a8 = (a * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        dequantized = a8.to(torch.float32) / scale
        return (x * scale) @ dequantized.t() + x @ (a + b).t()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4), torch.randn(3, 4))
    assert tag_reshard_policy(gm.graph) == 2
    tagged = {n.name for n in gm.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE}
    parameter_only = [n for n in gm.graph.nodes if n.op == "call_function" and not _reads_an_input(n)]
    assert {n.name for n in parameter_only} == tagged
    assert any(n.target is torch.ops.aten.amax.default for n in parameter_only)
    assert any(n.target is torch.ops.aten.add.Tensor and n.name in tagged for n in parameter_only)
    reads_x = [n for n in gm.graph.nodes if n.op == "call_function" and _reads_an_input(n)]
    assert reads_x and not tagged & {n.name for n in reads_x}


def test_a_random_function_of_a_gathered_weight_is_not_recomputed() -> None:
    """Dropout on a weight, run again in backward, would draw another mask."""
    comm = spec(reshard_after_forward=True)

    def f(shard, x):
        w = torch.ops.fsdp_compile.unshard(shard, "w", "", 8, *comm.op_args())
        return x @ torch.nn.functional.dropout(w, 0.5).t()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(3, 4))
    tag_reshard_policy(gm.graph)
    random = [n for n in gm.graph.nodes if n.op == "call_function" and "bernoulli" in str(n.target)]
    assert random and "recompute" not in random[0].meta
    masked = [n for n in gm.graph.nodes if n.op == "call_function" and random[0] in n.all_input_nodes]
    assert masked and not any("recompute" in n.meta for n in masked)


def _reads_an_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` depends on the graph input ``x`` (the third placeholder)."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current.op == "placeholder":
            if current.name == "x_1":
                return True
            continue
        if current not in seen:
            seen.add(current)
            pending.extend(current.all_input_nodes)
    return False


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


def rng_graphs(misplaced: bool) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A forward that saves (tensor, DeviceMesh-like object[, RNG state]) for backward, in the
    order the partitioner leaves them when an activation-checkpointed region holds a random op,
    and its backward's inputs in the same order."""
    import operator

    from torch._prims.rng_prims import run_and_save_rng_state

    forward = torch.fx.Graph()
    x = forward.placeholder("x")
    x.meta["val"] = torch.empty(2)
    opaque = forward.placeholder("mesh")
    opaque.meta["val"] = object()  # not a tensor: what the runtime expects after the tensors
    y = forward.call_function(torch.ops.aten.sin.default, (x,))
    y.meta["val"] = torch.empty(2)
    outputs = [y, x, opaque]
    if misplaced:
        both = forward.call_function(run_and_save_rng_state, (torch.ops.aten.rand.default, [2]))
        state = forward.call_function(operator.getitem, (both, 0))
        state.meta["val"] = torch.empty(16, dtype=torch.uint8)
        outputs.append(state)
    forward.output(tuple(outputs))
    backward = torch.fx.Graph()
    names = ["x", "mesh"] + (["rng_state_output_0"] if misplaced else []) + ["tangents_1"]
    inputs = [backward.placeholder(n) for n in names]
    for node in inputs:
        node.meta["val"] = object() if node.name == "mesh" else torch.empty(2)
    backward.output((inputs[0],))
    return torch.fx.GraphModule({}, forward), torch.fx.GraphModule({}, backward)


def test_saved_rng_states_move_before_the_opaque_values() -> None:
    from fsdp_compile.passes.rng_state_order import order_rng_states_before_opaque

    forward, backward = rng_graphs(misplaced=True)
    assert order_rng_states_before_opaque(forward, backward)
    (output,) = forward.graph.find_nodes(op="output")
    assert [n.name for n in output.args[0]] == ["sin_default", "x", "getitem", "mesh"]
    placeholders = [n.name for n in backward.graph.find_nodes(op="placeholder")]
    assert placeholders == ["x", "rng_state_output_0", "mesh", "tangents_1"]


def test_graphs_without_rng_states_are_left_alone() -> None:
    from fsdp_compile.passes.rng_state_order import order_rng_states_before_opaque

    forward, backward = rng_graphs(misplaced=False)
    before = forward.code, backward.code
    assert not order_rng_states_before_opaque(forward, backward)
    assert (forward.code, backward.code) == before
