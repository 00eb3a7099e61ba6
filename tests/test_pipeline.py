"""The pipeline as data: one pass signature, one runner, passes switched off by name, and a
package whose modules import each other without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_compile
from fsdp_compile.api import OPTIONAL_PASSES, parse_policy
from fsdp_compile.fsdp_backend import FSDPBackend
from fsdp_compile.inspection.graphinfo import marker_counts
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.passes.context import PassContext
from fsdp_compile.passes.scheduling import ScheduleOptions
from fsdp_compile.passes.stages import PIPELINE, PassFailure, run_stage, stage_passes
from fsdp_compile.runtime.collectives import CommSpec

SPEC = CommSpec("g", 2, True, "", 1, None, None, True)
PACKAGE = Path(fsdp_compile.__file__).parent


def two_layers():
    def f(x, s0, s1):
        for i, s in enumerate((s0, s1)):
            w = torch.ops.fsdp_compile.unshard(s, f"b{i}.w", f"b{i}", 8, *SPEC.op_args())
            x = torch.tanh(x @ w.t())
        return x
    return make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, 8))


def graph_context(schedule: bool = True) -> PassContext:
    return PassContext("forward", bucket_policy=parse_policy("module"),
                       schedule=ScheduleOptions(prefetch=1) if schedule else None)


def test_the_pipeline_is_declared_in_stage_order_with_one_signature() -> None:
    stages = [p.stage for p in PIPELINE]
    assert stages == sorted(stages, key=["captured", "joint", "partitioned", "graph"].index)
    assert [p.name for p in PIPELINE if p.stage == "captured"] == [
        "hoist_region_markers", "inline_mutating_regions", "inline_reordering_regions"]
    assert [p.name for p in PIPELINE if p.stage == "graph"] == [
        "unalias_region_outputs", "elide_trivial_unshard", "lower_markers", "schedule_collectives",
        "check_inflight_buffers"]
    for graph_pass in PIPELINE:
        assert list(graph_pass.fn.__code__.co_varnames[:2]) == ["gm", "ctx"], graph_pass.name
    assert set(OPTIONAL_PASSES) <= {p.name for p in PIPELINE}


def test_the_runner_runs_a_stage_in_order_and_keeps_each_result_by_name() -> None:
    gm = two_layers()
    ctx = graph_context()
    seen = []
    _, results = run_stage(gm, "graph", ctx, on_graph=lambda step, g: seen.append(step))
    assert [r.name for r in results] == ["unalias_region_outputs", "elide_trivial_unshard", "lower_markers",
                                         "schedule_collectives", "check_inflight_buffers"]
    assert seen == ["partitioned", "unalias_region_outputs", "elide_trivial_unshard", "lower_markers",
                    "schedule_collectives", "check_inflight_buffers"]
    assert ctx.results["check_inflight_buffers"] == 2  # one gather per block's bucket
    assert {b.key for b in ctx.results["lower_markers"]["unshard"]} == {"b0", "b1"}
    assert ctx.results["schedule_collectives"].collectives
    assert marker_counts(gm)["unshard"] == 0


def test_passes_are_switched_off_by_name_and_by_their_context() -> None:
    assert "schedule_collectives" not in [p.name for p in stage_passes("graph", graph_context(schedule=False))]
    gm = two_layers()
    _, results = run_stage(gm, "graph", graph_context(), disabled={"lower_markers", "schedule_collectives"})
    assert [r.name for r in results] == ["unalias_region_outputs", "elide_trivial_unshard", "check_inflight_buffers"]
    assert marker_counts(gm)["unshard"] == 2  # nothing lowered


def test_a_failing_pass_restores_the_graph_unless_its_stage_keeps_partial_work() -> None:
    def broken(gm):
        next(iter(gm.graph.nodes)).name = "renamed"
        raise RuntimeError("boom")

    gm = two_layers()
    before = gm.code
    with pytest.raises(PassFailure, match="pass 'broken' failed: RuntimeError: boom"):
        run_stage(gm, "graph", graph_context(), user_passes=[broken])
    assert gm.code == before and marker_counts(gm)["unshard"] == 2


def test_disable_passes_is_checked_and_names_the_passes_that_can_be_switched_off() -> None:
    with pytest.raises(ValueError, match="disable_passes= names 'order_rng_states'.*schedule_collectives"):
        fsdp_compile.backend("FULL_SHARD", disable_passes=("order_rng_states",))
    assert fsdp_compile.backend("FULL_SHARD", disable_passes="schedule_collectives").options.disable_passes == (
        "schedule_collectives",)


def _compiled_records(**options):
    from fsdp_compile.planning.world import fake_inputs, fake_model, fake_world

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32))
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    tokens = fake_inputs(mode, (torch.zeros(2, 16, dtype=torch.long),))
    with fake_world(2):
        backend = FSDPBackend("FULL_SHARD", compiler="aot_eager", **options)
        sharded = backend.shard(fake_model(model, mode), materialize=False)
        records, _ = backend.compiler.trace(lambda t: sharded(t).float().sum(), tokens, fake_mode=mode)
    return records


def test_a_backend_without_scheduling_or_lowering_compiles_what_is_left() -> None:
    full = _compiled_records()[0]
    assert full.forward_schedule is not None and full.pass_seconds["forward"].keys() == {
        "unalias_region_outputs", "elide_trivial_unshard", "lower_markers", "schedule_collectives",
        "check_inflight_buffers"}
    unscheduled = _compiled_records(disable_passes=("schedule_collectives",))[0]
    assert unscheduled.forward_schedule is None and "schedule_collectives" not in unscheduled.pass_seconds["forward"]
    unlowered = _compiled_records(disable_passes=("lower_markers", "schedule_collectives"))[0]
    assert marker_counts(unlowered.forward)["unshard"] > 0 and marker_counts(full.forward)["unshard"] == 0


def _module_imports() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Module -> fsdp_compile modules it imports at load time; and imports inside functions."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph, local = {m: set() for m in modules}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        type_only = {id(n) for block in tree.body if isinstance(block, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in type_only:
                continue
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            if not target.startswith("fsdp_compile"):
                continue
            found = {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
            if id(node) in top:
                graph[name] |= found & modules.keys()
            else:
                local.extend((name, node.lineno, t) for t in found)
    return graph, local


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return False


def test_no_import_cycles_and_no_function_level_import_hides_one() -> None:
    graph, local = _module_imports()
    cycles = [(a, b) for a, targets in graph.items() for b in targets if _reaches(graph, b, a)]
    assert not cycles, f"import cycles: {cycles}"
    # A deferred import hides a cycle when the imported module (at load time or deferred
    # itself) comes back to the importer.
    everything = {m: set(t) for m, t in graph.items()}
    for where, _, target in local:
        everything.setdefault(where, set()).add(target)
    hidden = [(where, line, target) for where, line, target in local if _reaches(everything, target, where)]
    assert not hidden, f"function-level imports that hide a cycle: {hidden}"


def test_a_misspelt_stage_is_an_error_not_an_empty_stage() -> None:
    with pytest.raises(ValueError, match="stage 'graphs' is not a pipeline stage; use one of captured, joint, partitioned, graph"):
        run_stage(two_layers(), "graphs", graph_context())


def test_saved_inputs_get_their_forward_roles_when_sizes_are_saved_too() -> None:
    # With a dynamic dimension AOTAutograd saves sizes as well: they are the forward's last
    # outputs but the backward's first inputs. A parameter saved for backward must still be
    # counted as a parameter (the planner's memory expression read one activation as a
    # parameter, and one parameter as an activation, before).
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fsdp_compile.compilation.roles import output_roles as _output_roles
    from fsdp_compile.compilation.roles import tag_saved_inputs
    from fsdp_compile.inspection.memory_estimate import output_storage_keys, storage_lifetimes
    from fsdp_compile.passes.graph import ROLE_META, SAVED_STORAGE_META

    size = ShapeEnv().create_unbacked_symint()
    forward = torch.fx.Graph()
    weight, x = forward.placeholder("primals_1"), forward.placeholder("primals_2")
    weight.meta.update(val=torch.empty(4, 4, device="meta"), **{ROLE_META: "param"})
    x.meta["val"] = torch.empty(2, 4, device="meta")
    mm = forward.call_function(torch.ops.aten.mm.default, (x, weight))
    mm.meta["val"] = torch.empty(2, 4, device="meta")
    sym = forward.call_function(torch.ops.aten.sym_size.int, (x, 0))
    sym.meta["val"] = size
    forward.output((mm, weight, x, sym))  # output, then saved: weight, x, then the saved size
    forward_gm = torch.fx.GraphModule(torch.nn.Module(), forward)
    roles, storages = _output_roles(forward_gm), output_storage_keys(storage_lifetimes(forward_gm))

    backward = torch.fx.Graph()
    nodes = [backward.placeholder(name) for name in ("sym_size_int", "primals_1", "primals_2", "tangents_1")]
    nodes[0].meta["val"] = size
    for node in nodes[1:]:
        node.meta["val"] = torch.empty(4, 4, device="meta")
    backward.output((nodes[3],))
    tag_saved_inputs(torch.fx.GraphModule(torch.nn.Module(), backward), roles, storages)
    assert [n.meta.get(ROLE_META) for n in nodes] == [None, "param", "activation", None]
    # Each saved input counts on the storage its forward output had (weight's, x's).
    assert [n.meta.get(SAVED_STORAGE_META) for n in nodes] == [None, *storages[1:3], None]
    assert storages[1] != storages[2]
    # Without storage keys (a forward whose keys were not recorded) the roles still go across.
    for node in nodes:
        node.meta.pop(ROLE_META, None)
    tag_saved_inputs(torch.fx.GraphModule(torch.nn.Module(), backward), roles, [])
    assert [n.meta.get(ROLE_META) for n in nodes] == [None, "param", "activation", None]
