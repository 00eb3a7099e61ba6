"""Compile-time machinery: stamped lowerings equal fresh traces; the benchmark script runs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_compile  # also registers the markers
from fsdp_compile.api import parse_policy
from fsdp_compile.passes.lowering import TraceCache, lower_markers
from fsdp_compile.runtime.collectives import CommSpec

SPEC = CommSpec("g", 2, True, "", 1, None, None, True)


def blocks_graph(layers: int = 3) -> torch.fx.GraphModule:
    """Per block: a gathered 8x8 weight and 8 bias (one bucket), and the reductions of their
    gradients (another): the shape of a forward and a backward graph of repeated blocks."""
    def f(x, *shards):
        grads = []
        for i in range(layers):
            w_shard, b_shard = shards[2 * i], shards[2 * i + 1]
            w = torch.ops.fsdp_compile.unshard(w_shard, f"b{i}.w", f"b{i}", 8, *SPEC.op_args())
            b = torch.ops.fsdp_compile.unshard(b_shard, f"b{i}.b", f"b{i}", 8, *SPEC.op_args())
            x = torch.tanh(x @ w.t() + b)
            gw = torch.ops.fsdp_compile.reduce_grad(x.t() @ x, f"b{i}.w", f"b{i}", 4, torch.float32,
                                                    *SPEC.op_args())
            gb = torch.ops.fsdp_compile.reduce_grad(x.sum(0), f"b{i}.b", f"b{i}", 4, torch.float32,
                                                    *SPEC.op_args())
            grads += [gw, gb]
        return x, *grads
    shards = [t for _ in range(layers) for t in (torch.randn(4, 8), torch.randn(4))]
    return make_fx(f, tracing_mode="fake")(torch.randn(3, 8), *shards)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_describe(v) for v in value]
    return value


def _storage_classes(gm) -> list[list[str]]:
    """Which nodes' values share a storage, as groups of node names."""
    groups: dict[int, list[str]] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value.untyped_storage()), []).append(node.name)
    return sorted(groups.values())


def test_stamped_lowering_equals_a_fresh_trace_per_bucket() -> None:
    stamped, fresh = blocks_graph(), blocks_graph()
    lower_markers(stamped, parse_policy("module"))
    lower_markers(fresh, parse_policy("module"), reuse_traces=False)
    assert stamped.code == fresh.code
    for a, b in zip(stamped.graph.nodes, fresh.graph.nodes, strict=True):
        assert (a.name, a.op, a.target) == (b.name, b.op, b.target)
        assert sorted(a.meta) == sorted(b.meta), a.name
        assert _describe(a.meta.get("val")) == _describe(b.meta.get("val")), a.name
        assert a.meta.get("tensor_meta") == b.meta.get("tensor_meta"), a.name
        assert a.meta.get("fsdp_comm") == b.meta.get("fsdp_comm"), a.name
        if "eager_input_vals" in a.meta:
            assert _describe(a.meta["eager_input_vals"][0]) == _describe(b.meta["eager_input_vals"][0]), a.name
    # Every stamp has storages of its own, as a fresh trace has (the memory estimate and
    # Inductor's re-inplacing tell buffers apart by storage).
    assert _storage_classes(stamped) == _storage_classes(fresh)


def test_identical_buckets_are_traced_once() -> None:
    gm = blocks_graph(4)
    cache = TraceCache()
    lower_markers(gm, parse_policy("module"), trace_cache=cache)
    # One gather and one reduction signature; the other three blocks are stamps of them.
    assert (cache.traces, cache.stamps) == (2, 6)


def _relu_module() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))


def test_failed_pass_restores_the_graph_the_caller_gave() -> None:
    from fsdp_compile.passes.stages import PassFailure, run_passes

    gm = _relu_module()
    before = gm.code

    def drop_tanh(g):
        node = next(n for n in g.graph.nodes if n.op == "call_module" and n.target == "1")
        node.replace_all_uses_with(node.args[0])
        g.graph.erase_node(node)

    def broken(g):
        raise ValueError("deliberately broken")

    try:
        run_passes(gm, [("drop_tanh", drop_tanh), ("broken", broken)], graph_only={drop_tanh})
    except PassFailure as failure:
        assert failure.pass_name == "broken"
    else:
        raise AssertionError("the failing pass did not raise")
    assert gm.code == before
    x = torch.randn(4)
    assert torch.equal(gm(x), torch.tanh(torch.relu(x)))


def test_a_user_pass_sees_the_code_of_the_graph_so_far() -> None:
    from fsdp_compile.passes.stages import run_passes

    gm = _relu_module()
    seen = []

    def drop_tanh(g):
        node = next(n for n in g.graph.nodes if n.op == "call_module" and n.target == "1")
        node.replace_all_uses_with(node.args[0])
        g.graph.erase_node(node)

    def user_pass(g):  # runs the module: its code must reflect the graph-only pass before it
        seen.append(g(torch.tensor([-1.0, 2.0])))

    out, _ = run_passes(gm, [("drop_tanh", drop_tanh), ("user", user_pass)], graph_only={drop_tanh})
    assert torch.equal(seen[0], torch.tensor([0.0, 2.0]))
    assert torch.equal(out(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


# ---------------------------------------------------------------- what each parameter read costs the tracers
def test_a_marker_carries_its_spec_as_one_argument_that_round_trips() -> None:
    """Dynamo and AOTAutograd handle every argument of every marker; a deep model has one marker
    per parameter read, so the spec travels as one string, readable in a dumped graph."""
    specs = [SPEC, CommSpec("0", 2, False, "1", 2, torch.bfloat16, torch.float32, False, "cuda:0"),
             CommSpec("7", 4, True, "", 1, torch.float16, None, True, None),
             CommSpec("3", 2, True, "", 1, torch.bfloat16, None, True, float8=torch.float8_e4m3fn, float8_pow2_scale=True)]
    for spec in specs:
        args = spec.op_args()
        assert len(args) == 1 and isinstance(args[0], str)
        assert CommSpec.from_op_args(*args) == spec
    assert specs[1].op_args()[0] == ("shard_group=0;shard_size=2;dim0_sharded=False;replicate_group=1;"
                                     "replicate_size=2;param_dtype=bfloat16;reduce_dtype=float32;"
                                     "reshard_after_forward=False;compute_device=cuda:0;reshard_group=;reshard_size=0;"
                                     "float8=None;float8_pow2_scale=False")
    schema = torch.ops.fsdp_compile.unshard.default._schema
    assert [a.name for a in schema.arguments] == ["shard", "fqn", "unit", "full_rows", "spec"]


def test_a_spec_that_cannot_travel_is_an_error() -> None:
    with pytest.raises(ValueError, match="CommSpec.shard_group='a;b'"):
        CommSpec("a;b", 2, True, "", 1, None, None, True).op_args()
    with pytest.raises(ValueError, match="lacks shard_size"):
        CommSpec.from_op_args("shard_group=0")


def _collector_worker(rank: int, world: int) -> dict:
    import gc

    from helpers import TEST_CONFIG, batches, lm_loss, local_slice

    from fsdp_compile.models.gpt import GPT

    during = []
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager",
                                   passes={"forward": [lambda gm: during.append(gc.isenabled())]})
    backend.shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(torch.compile(model, backend=backend)(x), y).backward()
    return {"during": during, "after": gc.isenabled()}


def test_the_garbage_collector_is_paused_while_a_graph_compiles_and_restored_after() -> None:
    from distributed import run_workers

    for out in run_workers(_collector_worker, 2):
        assert out["during"] == [False]
        assert out["after"] is True
