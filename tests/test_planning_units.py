"""Unit tests of the planner's pieces: Cluster, the cost model, the two-stream simulator."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_compile.planning import Cluster, ClusterError
from fsdp_compile.planning.cost import Group, collective_cost, graph_costs, node_cost
from fsdp_compile.planning.simulate import simulate_events
from fsdp_compile.planning.vocabulary import MeasuredCollective
from fsdp_compile_lab.host import HOST_NUMBERS, HostCPU

H100 = Cluster.preset("h100-sxm", nodes=2)
LOCKSTEP = HostCPU()  # a host model that adds nothing of its own: events carry its numbers


def small_cluster(**changes) -> Cluster:
    """A toy cluster; the host model's numbers among ``changes`` go to its host model."""
    fields = {"name": "toy", "nodes": 2, "devices_per_node": 4, "device_memory": 1e9,
                  "peak_flops": {torch.float32: 1e12}, "memory_bandwidth": 1e11,
                  "intra_node_bandwidth": 1e10, "inter_node_bandwidth": 1e9,
                  "intra_node_latency": 1e-6, "inter_node_latency": 1e-5, "collective_latency": 0.0}
    host = {name: changes.pop(name) for name in HOST_NUMBERS if name in changes}
    fields.update(changes)
    return Cluster(**fields, host=HostCPU(**host) if host else None)


# ---------------------------------------------------------------- Cluster
@pytest.mark.parametrize("name", ["h100-sxm", "a100-80gb", "a10g"])
def test_presets_are_complete_and_sourced(name):
    cluster = Cluster.preset(name, nodes=3)
    assert cluster.world_size == 3 * 8
    assert cluster.device_type == "cuda"
    for key in ("device_memory", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                "inter_node_bandwidth", "latency"):
        assert cluster.sources.get(key), f"{name}: no source for {key}"
    assert torch.bfloat16 in cluster.peak_flops and torch.float32 in cluster.peak_flops


def test_preset_numbers_are_the_data_sheets():
    h100 = Cluster.preset("h100-sxm")
    assert h100.peak_flops[torch.bfloat16] == 989e12 and h100.memory_bandwidth == 3.35e12
    assert h100.inter_node_bandwidth == 50e9  # 400 Gb/s per GPU
    a10g = Cluster.preset("a10g")
    assert a10g.device_memory == 24e9 and a10g.inter_node_bandwidth == pytest.approx(100e9 / 8 / 8)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ClusterError, match="h100-sxm"):
        Cluster.preset("tpu-v5")


@pytest.mark.parametrize("change, message", [
    ({"memory_bandwidth": None}, "memory_bandwidth is missing"),
    ({"memory_bandwidth": -1.0}, "memory_bandwidth=-1.0 must be > 0"),
    ({"peak_flops": {}}, "peak_flops is missing"),
    ({"peak_flops": {torch.int8: 1e12}}, "floating-point"),
    ({"nodes": 0}, "nodes=0 must be > 0"),
    ({"devices_per_node": 2.5}, "whole number"),
    ({"inter_node_bandwidth": None}, "inter_node_bandwidth is missing"),
    ({"comm_overlap": 1.5}, "comm_overlap=1.5 must be <= 1.0"),
    ({"runtime_per_tensor": -1e-6}, "runtime_per_tensor=-1e-06 must be >= 0"),
    ({"copy_kernels": {"copy": (1e-6, 1e-10)}}, r"copy_kernels\['copy'\]: keys are copy_in, copy_out, chunk_cat"),
    ({"copy_kernels": {"copy_out": (1e-6,)}}, r"copy_kernels\['copy_out'\]=\(1e-06,\) must be \(seconds per parameter"),
    ({"collective_issue": {"all_gather": (-1.0, 0.0)}}, r"collective_issue\['all_gather'\]=\(-1.0, 0.0\) must be"),
    ({"collective_cpu": {"broadcast": (0.0, 1e-9)}}, r"collective_cpu\['broadcast'\]: keys are all_gather"),
    ({"compute_scale": 0.0}, "compute_scale=0.0 must be > 0"),
    ({"attention_flops": {torch.float32: -1.0}}, r"attention_flops\[torch.float32\]=-1.0 must be > 0"),
    ({"attention_flops": {"fp32": 1e12}}, "attention_flops key 'fp32' must be a floating-point torch.dtype"),
    ({"intra_node_latency": float("nan")}, "finite"),
    ({"reserved_memory": 2e9}, "leaves nothing"),
    ({"device_type": "tpu"}, "device_type"),
])
def test_missing_or_impossible_numbers_are_named(change, message):
    with pytest.raises(ClusterError, match=message):
        small_cluster(**change)


def test_one_node_needs_no_inter_node_link():
    cluster = small_cluster(nodes=1, inter_node_bandwidth=None, inter_node_latency=None)
    assert cluster.world_size == 4


def test_world_larger_than_the_cluster_is_refused():
    with pytest.raises(ClusterError, match="world_size=24 does not fit.*nodes=6"):
        small_cluster().check_world(24)
    small_cluster().check_world(8)


def test_missing_dtype_says_how_to_add_it():
    with pytest.raises(ClusterError, match="no peak FLOP/s for torch.bfloat16"):
        small_cluster().flops_for(torch.bfloat16)


# ---------------------------------------------------------------- collectives
def test_ring_collective_within_a_node_uses_the_intra_node_link():
    cluster = small_cluster()
    cost = collective_cost("all_gather", 4_000_000, Group(4, 1), cluster)
    wire = 4_000_000 * 3 / 4
    assert cost.link == "intra" and cost.wire_bytes == wire
    assert cost.seconds == pytest.approx(3 * 1e-6 + wire / 1e10)


def test_flat_group_spanning_nodes_is_bound_by_the_inter_node_link():
    cluster = small_cluster()
    cost = collective_cost("reduce_scatter", 8_000_000, Group(8, 2), cluster)
    wire = 8_000_000 * 7 / 8
    # 7 ring steps, one of which crosses nodes
    assert cost.link == "inter"
    assert cost.seconds == pytest.approx(6 * 1e-6 + 1 * 1e-5 + wire / 1e9)


def test_a_group_spanning_nodes_uses_the_inter_node_fit_where_one_was_measured():
    intra = MeasuredCollective(step_latency=1e-6, bandwidth=1e9, group_size=2)
    inter = MeasuredCollective(step_latency=1e-5, bandwidth=1e8, group_size=2)
    cluster = small_cluster().replace(measured_collectives={"all_reduce": intra},
                                      measured_inter_collectives={"all_reduce": inter})
    across = collective_cost("all_reduce", 10**6, Group(2, 2), cluster)
    within = collective_cost("all_reduce", 10**6, Group(2, 1), cluster)
    assert across.seconds == pytest.approx(2 * 1e-5 + 10**6 / 1e8)
    assert within.seconds == pytest.approx(2 * 1e-6 + 10**6 / 1e9)
    # Without an inter-node fit, the intra-node one serves both (one node measured).
    flat = cluster.replace(measured_inter_collectives={})
    assert collective_cost("all_reduce", 10**6, Group(2, 2), flat).seconds == pytest.approx(within.seconds)


def test_all_reduce_moves_twice_the_bytes():
    cluster = small_cluster()
    ar = collective_cost("all_reduce", 1_000_000, Group(4, 1), cluster)
    ag = collective_cost("all_gather", 1_000_000, Group(4, 1), cluster)
    assert ar.wire_bytes == 2 * ag.wire_bytes


def test_group_of_one_costs_nothing():
    assert collective_cost("all_gather", 10**6, Group(1, 1), small_cluster()).seconds == 0.0


def test_issuing_a_collective_takes_the_compute_stream_first():
    from fsdp_compile.planning.cost import NodeCost
    from fsdp_compile.planning.simulate import simulate_graph
    from fsdp_compile_lab.host.model import CollectiveOnHost

    issued = small_cluster(collective_issue={"reduce_scatter": (1e-4, 1e-9)})
    cost = collective_cost("reduce_scatter", 1_000_000, Group(4, 1), issued)
    assert cost.host.issue_seconds == pytest.approx(1e-4 + 1e6 * 1e-9)
    assert cost.seconds == collective_cost("reduce_scatter", 1_000_000, Group(4, 1), small_cluster()).seconds
    assert collective_cost("all_gather", 1_000_000, Group(4, 1), issued).host.issue_seconds == 0.0  # not measured
    # the collective starts after its issue: a wait right after it exposes the whole collective
    class Node:  # what the simulator reads of an fx node: its arguments (a wait's is its collective)
        def __init__(self, *args):
            self.args = args

    rs = Node()
    costs = [(rs, NodeCost("collective", 1.0, link="intra", host=CollectiveOnHost(issue_seconds=0.5))),
             (Node(rs), NodeCost("wait"))]
    t = simulate_graph(costs, host=LOCKSTEP)
    assert t.seconds == 1.5 and t.compute_seconds == 0.5 and t.exposed_comm_seconds == 1.0


# ---------------------------------------------------------------- compute roofline
def _graph(fn, *shapes, dtype=torch.float32):
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(s, dtype=dtype) for s in shapes]
        return make_fx(fn)(*args)


def test_matmul_is_compute_bound_and_counts_torch_flops():
    gm = _graph(lambda a, b: a @ b, (512, 512), (512, 512))
    cluster = small_cluster(peak_flops={torch.float32: 1e9})
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    cost = node_cost(mm, cluster, {})
    assert cost.flops == 2 * 512 ** 3
    assert cost.bytes == 3 * 512 * 512 * 4
    assert cost.seconds == pytest.approx(2 * 512 ** 3 / 1e9)


def test_elementwise_is_memory_bound_and_views_cost_only_the_call():
    gm = _graph(lambda a: (a * 2).view(-1), (1024, 1024))
    cluster = small_cluster(op_overhead=1e-6)
    costs = {n.target: c for n, c in graph_costs(gm, cluster)}
    mul = costs[torch.ops.aten.mul.Tensor]
    assert mul.kind == "compute" and mul.flops == 0
    assert mul.seconds == pytest.approx(2 * 1024 * 1024 * 4 / 1e11 + 1e-6)
    # a view moves no bytes, but a graph run as Python still calls it; on a GPU (no overhead) it is free
    view = costs[torch.ops.aten.view.default]
    assert view.bytes == 0 and view.seconds == pytest.approx(1e-6)
    no_overhead = {n.target: c for n, c in graph_costs(gm, small_cluster())}
    assert no_overhead[torch.ops.aten.view.default].kind == "free"


def _copy_out_node() -> torch.fx.Node:
    """The copy-out of a gathered 20-element bucket into two parameters of 12 and 8 elements
    (chunks of 6 and 4 at world 2)."""
    from fsdp_compile.runtime import kernels

    dims, ranks = kernels.flatten_shapes([(3, 4), (2, 4)])
    gm = _graph(lambda g: kernels.copy_out(g, 2, [6, 4], dims, ranks), (20,))
    return next(n for n in gm.graph.nodes if n.target is torch.ops.fsdp_compile.copy_out.default)


def test_bucket_copies_are_priced_by_their_measured_fit():
    node = _copy_out_node()
    moved = 20 * 4 + (12 + 8) * 4  # the gathered buffer in, one tensor per parameter out
    roofline = node_cost(node, small_cluster(op_overhead=1e-6), {})
    assert roofline.seconds == pytest.approx(moved / 1e11 + 1e-6)  # without a fit: a memory-bound op
    fitted = node_cost(node, small_cluster(op_overhead=1e-6, copy_kernels={"copy_out": (1e-5, 1e-9)}), {})
    assert fitted.bytes == moved
    assert fitted.seconds == pytest.approx(2 * 1e-5 + moved * 1e-9 + 1e-6)  # per parameter, per byte, the call
    # another copy's fit does not apply to this one
    other = node_cost(node, small_cluster(op_overhead=1e-6, copy_kernels={"copy_in": (1e-5, 1e-9)}), {})
    assert other.seconds == roofline.seconds


def test_compute_scale_multiplies_what_the_roofline_prices_but_not_measured_copies():
    gm = _graph(lambda a, b: (a @ b).view(-1), (512, 512), (512, 512))
    base = small_cluster(peak_flops={torch.float32: 1e9}, op_overhead=1e-6)
    scaled = base.with_host(compute_scale=1.5)
    for (node, plain), (_, more) in zip(graph_costs(gm, base), graph_costs(gm, scaled)):
        if plain.kind == "compute":
            assert more.seconds == pytest.approx(1.5 * plain.seconds), node
    node = _copy_out_node()
    fit = {"copy_out": (1e-5, 1e-9)}
    assert (node_cost(node, scaled.with_host(copy_kernels=fit), {}).seconds
            == node_cost(node, base.with_host(copy_kernels=fit), {}).seconds)


def test_compute_scale_is_a_reference_graphs_measured_time_over_its_priced_cost():
    from fsdp_compile_lab.calibration.reference import compute_scale, timed_reference

    seconds, graphs = timed_reference(1, torch.device("cpu"), sync=False)
    assert seconds > 0 and len(graphs) == 2  # the reference's forward and backward, run for real
    assert any(n.target is torch.ops.aten.addmm.default for n in graphs[0].graph.nodes)
    cluster = small_cluster(op_overhead=1e-6)
    priced = sum(c.seconds for gm in graphs for _, c in graph_costs(gm, cluster) if c.kind == "compute")
    # the cluster's own scale is left out of the pricing, so measuring again gives the same scale
    assert compute_scale(2 * priced, graphs, cluster.with_host(compute_scale=5.0)) == pytest.approx(2.0)
    assert compute_scale(1.0, [], cluster) == 1.0  # nothing timed (a GPU): no correction
    assert timed_reference(1, torch.device("meta")) == (0.0, [])


def test_compare_prices_the_models_own_step_as_its_reference():
    # compare's reference beside the steps is the compared model with the user's loss, on this
    # rank's batch: its graphs hold that model's layers and loss, and the step keeps no gradient
    from fsdp_compile_lab.calibration.beside_steps import model_reference_step
    from fsdp_compile_lab.calibration.reference import compute_scale

    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    inputs, targets = (torch.randn(16, 24),), torch.randn(16, 8)
    graphs, step = model_reference_step(model, inputs, targets, torch.nn.functional.mse_loss)
    forward, backward = graphs
    weights = [tuple(n.meta["val"].shape) for n in forward.graph.find_nodes(op="placeholder")]
    assert (40, 24) in weights and (8, 40) in weights
    assert forward.graph.find_nodes(op="call_function", target=torch.ops.aten.mse_loss.default)
    assert backward.graph.find_nodes(op="call_function", target=torch.ops.aten.mse_loss_backward.default)
    step()
    assert all(p.grad is None for p in model.parameters())
    cluster = small_cluster(op_overhead=1e-6)
    priced = sum(c.seconds for gm in graphs for _, c in graph_costs(gm, cluster) if c.kind == "compute")
    assert compute_scale(3 * priced, graphs, cluster) == pytest.approx(3.0)


def beside_steps_worker(rank: int, world: int) -> dict:
    from fsdp_compile_lab.calibration.beside_steps import BesideSteps

    fits = {}
    for optimizer in ("adamw", "sgd"):
        probe = BesideSteps(None, torch.device("cpu"), optimizer)
        before = probe.fits()
        for _ in range(3):
            probe.sample()
        fits[optimizer] = (before, probe.fits())
        probe.reset()
        assert probe.fits() is None
    return fits


def test_optimizer_and_runtime_fits_are_timed_again_beside_the_steps():
    # compare times the calibration's optimizer and runtime workloads after every step; the
    # fits through their medians are of the workload timed (AdamW does more per tensor than SGD)
    from distributed import run_workers

    for fits in run_workers(beside_steps_worker, 2):
        (no_adamw, adamw), (no_sgd, sgd) = fits["adamw"], fits["sgd"]
        assert no_adamw is None and no_sgd is None  # nothing sampled, nothing to replace the calibration with
        assert list(adamw["optimizer_step"]) == ["adamw"] and list(sgd["optimizer_step"]) == ["sgd"]
        assert adamw["optimizer_step"]["adamw"][0] > sgd["optimizer_step"]["sgd"][0] > 0
        assert adamw["runtime_per_tensor"] > 0 and sgd["runtime_per_tensor"] > 0


def test_compare_plans_each_strategy_on_the_numbers_timed_beside_its_steps():
    from fsdp_compile.planning.compare import beside_steps
    from fsdp_compile.planning.cost import optimizer_seconds

    cluster = small_cluster(optimizer_step={"adamw": (2e-4, 1e-9), "sgd": (1e-5, 1e-10)}, runtime_per_tensor=5e-5,
                            compute_scale=1.1)  # a host model's number: compute_scale is the host's
    moved = beside_steps(cluster, {"compute_scale": 1.3, "optimizer_step": {"adamw": [4e-4, 2e-9]},
                                   "runtime_per_tensor": 8e-5})
    assert moved.host.compute_scale == 1.3 and moved.runtime_per_tensor == 8e-5
    assert moved.optimizer_step == {"adamw": (4e-4, 2e-9), "sgd": (1e-5, 1e-10)}  # SGD was not timed there
    assert optimizer_seconds("adamw", 10**6, 4e6, 10, moved) == pytest.approx(10 * 4e-4 + 4e6 * 2e-9)
    # a job without the timings (a GPU) keeps the calibration's numbers
    assert beside_steps(cluster, {}) == cluster


def rank_skew_worker(rank: int, world: int) -> float:
    from fsdp_compile_lab.calibration.host_collectives import _rank_skew

    return _rank_skew(None, torch.device("cpu"), 3)


def test_rank_skew_is_measured_only_where_ranks_time_slice_the_cores(monkeypatch):
    from distributed import run_workers

    from fsdp_compile_lab.calibration import cores, host_collectives

    # a core per rank: no skew to measure, and nothing runs (no process group here)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_collectives._rank_skew(None, torch.device("cpu"), 3) == 0.0
    monkeypatch.undo()
    # 4 ranks on this machine's cores: measured, the same (slowest) figure on every rank
    skews = run_workers(rank_skew_worker, 4)
    assert len(set(skews)) == 1 and 0.0 <= skews[0] < 1.0, skews


def test_each_collective_waits_the_rank_skew_for_the_last_rank():
    from fsdp_compile.planning.cost import collective_cost

    fair = small_cluster().replace(host=LOCKSTEP)
    skewed = fair.with_host(rank_skew=4e-3)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        base = collective_cost(kind, 1 << 20, Group(2, 1), fair.with_host())
        cost = collective_cost(kind, 1 << 20, Group(2, 1), skewed)
        assert cost.seconds == base.seconds and cost.host.skew_seconds == 4e-3 and base.host.skew_seconds == 0.0
    # a group of one rank waits for nobody
    assert collective_cost("all_reduce", 1 << 20, Group(1, 1), skewed).host is None
    # the collective starts when the last rank issues it: a wait right after exposes the skew ...
    assert simulate_events([("issue", "x", 1.0, "intra", 0, 0.5), ("wait", "x")], host=LOCKSTEP).seconds == 1.5
    # ... compute until the wait hides it, and a collective queued behind a busy link loses nothing
    assert simulate_events([("issue", "x", 1.0, "intra", 0, 0.5), ("compute", 2.0), ("wait", "x")],
                           host=LOCKSTEP).seconds == 2.0
    queued = [("issue", "a", 3.0, "intra", 0, 0.5), ("issue", "b", 3.0, "intra", 0, 0.5), ("wait", "b")]
    assert simulate_events(queued, host=LOCKSTEP).seconds == 6.5
    with pytest.raises(ClusterError, match="rank_skew"):
        fair.with_host(rank_skew=-1e-3)


def test_attention_runs_at_its_own_measured_rate():
    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = _graph(attention, (1, 2, 512, 64), (1, 2, 512, 64), (1, 2, 512, 64))
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    at_peak = node_cost(node, small_cluster(), {})
    measured = node_cost(node, small_cluster(attention_flops={torch.float32: 1e11}), {})
    assert at_peak.flops == measured.flops == 4 * 2 * 512 * 512 * 64  # torch's formula: QK^T and PV
    assert at_peak.seconds == pytest.approx(at_peak.flops / 1e12)  # no measurement: the matmul peak
    assert measured.seconds == pytest.approx(measured.flops / 1e11)
    # another dtype than the measured one falls back to that dtype's peak
    assert small_cluster(attention_flops={torch.bfloat16: 1e11}).attention_flops_for(torch.float32) == 1e12


def test_measured_optimizer_step_replaces_the_bandwidth_formula():
    from fsdp_compile.planning.cost import optimizer_seconds

    formula = small_cluster(op_overhead=1e-6)
    expected = 7 * 4e6 / 1e11 + 12 * 10 * 1e-6  # seven passes over the shards, a dozen ops per tensor
    assert optimizer_seconds("adamw", 1_000_000, 4_000_000, 10, formula) == pytest.approx(expected)
    measured = formula.replace(optimizer_step={"adamw": (2e-4, 1e-9), "sgd": (1e-5, 1e-10)})
    # per tensor and per byte, as measured; "adam" is timed as AdamW, "none" costs nothing
    assert optimizer_seconds("adamw", 1_000_000, 4_000_000, 10, measured) == pytest.approx(10 * 2e-4 + 4e6 * 1e-9)
    assert optimizer_seconds("adam", 1_000_000, 4_000_000, 10, measured) == pytest.approx(10 * 2e-4 + 4e6 * 1e-9)
    assert optimizer_seconds("sgd", 1_000_000, 4_000_000, 10, measured) == pytest.approx(10 * 1e-5 + 4e6 * 1e-10)
    assert optimizer_seconds("none", 1_000_000, 4_000_000, 10, measured) == 0.0
    with pytest.raises(ClusterError, match=r"optimizer_step\['adamw'\]"):
        small_cluster(optimizer_step={"adamw": (-1.0, 0.0)})


def test_runtime_work_per_parameter_is_added_outside_the_graphs():
    from fsdp_compile.planning.cost import optimizer_seconds, outside_graph_seconds

    cluster = small_cluster(optimizer_step={"adamw": (2e-4, 1e-9)}, runtime_per_tensor=3e-4)
    optimizer = optimizer_seconds("adamw", 1_000_000, 4_000_000, 10, cluster)
    assert outside_graph_seconds("adamw", 1_000_000, 4_000_000, 10, cluster) == pytest.approx(optimizer + 10 * 3e-4)
    assert outside_graph_seconds("none", 1_000_000, 4_000_000, 10, cluster) == pytest.approx(10 * 3e-4)


def test_compute_calibrations_take_turns_when_ranks_outnumber_cores(monkeypatch):
    from fsdp_compile_lab.calibration import cores as measure

    cpu = torch.device("cpu")
    barriers: list = []
    monkeypatch.setattr(measure.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(measure.dist, "barrier", lambda group=None: barriers.append(group))
    monkeypatch.setattr(measure.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(measure.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(measure.torch, "get_num_threads", lambda: 1)
    calls: list = []

    def calibrate(share: float) -> float:
        calls.append(share)
        return 1.0

    # every rank has a core: side by side, the calibration barriers itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert measure.in_turns(calibrate, None, cpu) == 1.0 and calls == [1.0] and barriers == []
    # 4 ranks on 2 cores: two turns, this rank (local rank 3) in the second, without inner barriers
    calls.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert measure.in_turns(calibrate, "g", cpu) == 1.0 and calls == [0.5] and barriers == ["g", "g"]


def test_the_reference_graph_runs_on_every_rank_at_once_when_operators_take_turns(monkeypatch):
    """4 ranks on 2 cores: each operator's calibration takes turns, but the reference step, whose
    measured-over-priced ratio carries what time-slicing ranks cost each other into
    ``compute_scale``, runs with every rank at once (timed in turns, world 4 under-predicted its
    plain-gloo steps by 13-16%)."""
    from fsdp_compile.planning.calibration import calibrate as measure
    from fsdp_compile_lab.calibration import calibrate as host_measure
    from fsdp_compile_lab.calibration import cores

    monkeypatch.setattr(measure.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(measure.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(measure.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(measure.torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(measure, "_slowest", lambda value, group: value)
    monkeypatch.setattr(host_measure, "_slowest", lambda value, group: value)
    synced: dict[str, bool] = {}

    def recorded(name, result):
        def calibration(*args, sync=None, **kwargs):
            synced[name] = (args[-1] >= 1.0) if sync is None else sync  # a share of a core below 1: in turns
            return result
        return calibration

    fit = {"all_gather": (1e-4, 1e-9)}
    monkeypatch.setattr(measure, "measure_matmul_flops", recorded("matmul", 1e11))
    monkeypatch.setattr(measure, "measure_attention_flops", recorded("attention", 1e11))
    monkeypatch.setattr(measure, "measure_memory_bandwidth", recorded("bandwidth", 1e10))
    monkeypatch.setattr(host_measure, "time_op_overhead", lambda device, repeats: 1e-6)
    monkeypatch.setattr(measure, "_optimizer_step", recorded("optimizer", (1e-4, 1e-9)))
    monkeypatch.setattr(measure, "_runtime_per_tensor", recorded("runtime", 1e-5))
    monkeypatch.setattr(host_measure, "_copy_kernels", recorded("copies", {}))
    monkeypatch.setattr(host_measure, "timed_reference", recorded("reference", (0.0, [])))
    ring = MeasuredCollective(step_latency=1e-5, bandwidth=1e9, group_size=4)
    links_on: list = []

    def collectives_per_link(groups, device, sizes, repeats, network=None, beside=None):
        links_on.append(network)
        return {k: ring for k in fit}, {}

    monkeypatch.setattr(measure, "_collectives_per_link", collectives_per_link)
    monkeypatch.setattr(measure, "_emulated_network", lambda group: "the network")
    monkeypatch.setattr(host_measure, "_backend_collectives", lambda *a: ({}, {}))
    monkeypatch.setattr(host_measure, "_issue_seconds", lambda *a: {})
    monkeypatch.setattr(measure, "_collective_workspace", lambda *a: {})
    monkeypatch.setattr(host_measure, "_collective_cpu", lambda *a: fit)
    monkeypatch.setattr(host_measure, "_rank_skew", lambda *a: 0.0)
    monkeypatch.setattr(host_measure, "rank_drift", lambda *a: 0.03)
    cluster = measure.measure_cluster(Cluster, group=None, sizes=None, repeats=1, dtypes=(torch.float32,), nodes=1,
                                      device="cpu", device_memory=1e9, host=HostCPU)
    assert synced.pop("reference") is True
    assert (cluster.host.core_sharing, cluster.host.rank_drift) == ((4, 2), 0.03)  # its step is played on every rank
    assert synced and not any(synced.values()), synced  # local rank 1's turn: no inner barriers
    # the links' fits read an emulated network's own account of its links (_modeled_seconds)
    assert links_on == ["the network"]
    assert "rank_drift" in cluster.sources and "compute_scale" in cluster.sources  # the host's numbers, sourced
    # without a host model the package measures the device's own numbers only
    synced.clear()
    plain = measure.measure_cluster(Cluster, group=None, sizes=None, repeats=1, dtypes=(torch.float32,), nodes=1,
                                    device="cpu", device_memory=1e9)
    assert plain.host is None and "op_overhead" not in plain.sources and "copies" not in synced
    assert plain.replace(host=cluster.host) == cluster.replace(sources=plain.sources)


def test_cpu_communication_takes_no_compute_with_a_core_to_spare(monkeypatch):
    from fsdp_compile_lab.calibration import cores, host_collectives

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_collectives._collective_cpu(None, torch.device("cpu"), (1 << 16,), 1) == {}


def test_cpu_share_stretches_compute_when_ranks_outnumber_cores(monkeypatch):
    from fsdp_compile.planning.calibration import compute as measure
    from fsdp_compile_lab.calibration import cores

    cpu = torch.device("cpu")
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(measure.torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores._cpu_share(cpu) == 1.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a 2 x 2 hybrid world on 2 cores: half a core each
    assert cores._cpu_share(cpu) == 0.5
    assert cores._cpu_share(torch.device("cuda")) == 1.0
    # the thread's CPU time is stretched by the share; a wall-clock timing already holds it
    monkeypatch.setattr(measure, "_samples", lambda fn, repeats, device, clock: [0.01])
    assert measure._compute_seconds(lambda: None, 1, cpu, share=cores._cpu_share(cpu)) == pytest.approx(0.02)


def test_matmul_calibration_is_the_median_pass_over_every_shape(monkeypatch):
    from fsdp_compile.planning.calibration import compute as measure

    monkeypatch.setattr(measure, "_CPU_MATMULS", ((8, 8, 8), (16, 8, 4)))
    monkeypatch.setattr(measure, "_samples", lambda fn, repeats, device, clock: [1.0, 3.0, 2.0])
    flops = 3 * 2 * (8 * 8 * 8 + 16 * 8 * 4)  # three layouts of each shape, in one pass
    assert measure.measure_matmul_flops(torch.float32, torch.device("cpu"), 3) == pytest.approx(flops / 2.0)


def _collectives_calibrated_in_a_world_of_two(monkeypatch, measure) -> None:
    """``measure._collectives`` without a process group: two ranks, no barriers, this rank's
    timings as the slowest."""
    from types import SimpleNamespace

    monkeypatch.setattr(measure.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(measure.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(measure.dist, "group", SimpleNamespace(WORLD=SimpleNamespace(group_name="world")))
    monkeypatch.setattr(measure, "_slowest", lambda value, group: value)


def test_collective_calibration_keeps_the_typical_run_not_the_fastest(monkeypatch):
    import collections
    import time

    from fsdp_compile.planning.calibration import collective_fits as measure

    _collectives_calibrated_in_a_world_of_two(monkeypatch, measure)
    runs: collections.Counter = collections.Counter()

    def run_burst(kind, buffers, n, name):
        buffer = buffers[0]
        runs[kind, buffer.numel()] += 1
        buffer_bytes = buffer.numel() * buffer.element_size() * (n if kind == "all_gather" else 1)
        typical = (2e-3 + buffer_bytes / 1e9) * len(buffers)  # a burst: its collectives back to back
        # one run in three is ten times faster than the others (a collective's own spread)
        time.sleep(typical / 10 if runs[kind, buffer.numel()] % 3 == 0 else typical)

    monkeypatch.setattr(measure, "_run_burst", run_burst)
    fits = measure._collectives(None, torch.device("cpu"), (1 << 18, 1 << 20, 1 << 22), repeats=3)
    assert set(fits) == {"all_gather", "reduce_scatter", "all_reduce"}
    for kind, fit in fits.items():
        wire_per_buffer_byte = 0.5 * (2 if kind == "all_reduce" else 1)
        typical_bandwidth = 1e9 * wire_per_buffer_byte
        assert 0.6 * typical_bandwidth < fit.bandwidth < 1.2 * typical_bandwidth, (kind, fit)
        assert len(fit.samples) == 3


@pytest.mark.parametrize("cores_per_thread, beside", [(1.0, True), (2.0, False), (0.5, False)])
def test_collectives_are_timed_beside_compute_where_ranks_fill_the_cores(monkeypatch, cores_per_thread, beside):
    """A step's collectives run beside its compute; on a CPU whose ranks fill the cores gloo's
    threads then wait for a core, so the fit is timed beside a computing thread there, and
    alone where a core is spare (the step's compute does not take it) or where the ranks
    outnumber the cores (computing threads there turned the timings into noise on some hosts)."""
    import threading
    import time

    from fsdp_compile.planning.calibration import collective_fits as measure
    from fsdp_compile_lab.calibration import cores

    _collectives_calibrated_in_a_world_of_two(monkeypatch, measure)
    monkeypatch.setattr(cores, "_cores_per_thread", lambda: cores_per_thread)
    seen = []

    def run_burst(kind, buffers, n, name):
        time.sleep(0.001)
        seen.append(any(t.name == "calibration-compute" and t.is_alive() for t in threading.enumerate()))

    monkeypatch.setattr(measure, "_run_burst", run_burst)
    measure._collectives(None, torch.device("cpu"), (1 << 16, 1 << 18), repeats=1, beside=HostCPU.beside_collectives)
    assert seen and all(running == beside for running in seen), seen
    assert not any(t.name == "calibration-compute" for t in threading.enumerate())  # stopped after


def test_allocator_peak_counts_a_reused_address_once():
    from fsdp_compile.planning.calibration.allocator import allocator_peak

    MiB = 1 << 20
    records = [
        (1, 0xA, 4 * MiB),
        (2, 0xB, 2 * MiB),
        (3, 0xA, 4 * MiB),  # 0xA handed out again: its free (another thread's) is recorded late
        (4, 0xA, -4 * MiB),
        (5, 0xC, -1 * MiB),  # memory allocated before the profile began
        (6, 0xD, 1 * MiB),
    ]
    # at most 0xA and 0xB are live at once: 6 MiB, not the 10 MiB of the records' naive sum
    assert allocator_peak(records) == 6 * MiB
    assert allocator_peak([(1, 0xA, MiB), (2, 0xA, -MiB), (3, 0xA, 3 * MiB)]) == 3 * MiB


def test_compare_collects_garbage_between_steps_not_inside_them():
    import gc

    from fsdp_compile.planning.compare import _collector_between_steps

    assert gc.isenabled()
    with _collector_between_steps(True):
        assert not gc.isenabled()
    assert gc.isenabled()
    with _collector_between_steps(False):
        assert gc.isenabled()
    gc.disable()  # a caller that runs without the automatic collector keeps it off
    try:
        with _collector_between_steps(True):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


# ---------------------------------------------------------------- simulator
def test_fully_hidden_collective_exposes_nothing():
    events = [("issue", "ag", 1.0, "intra", 10), ("compute", 3.0), ("wait", "ag"), ("compute", 1.0)]
    t = simulate_events(events)
    assert t.seconds == 4.0 and t.exposed_comm_seconds == 0.0
    assert t.compute_seconds == 4.0 and t.comm_seconds == 1.0 and t.wire_bytes["intra"] == 10


def test_collective_waited_at_once_is_fully_exposed():
    events = [("compute", 2.0), ("issue", "ag", 1.5, "inter", 7), ("wait", "ag"), ("compute", 1.0)]
    t = simulate_events(events)
    assert t.seconds == 4.5 and t.exposed_comm_seconds == 1.5 and t.wire_bytes["inter"] == 7


def test_collectives_on_one_link_take_turns_in_issue_order():
    # two collectives issued together: the second starts when the first ends
    events = [("issue", "a", 2.0, "intra", 0), ("issue", "b", 2.0, "intra", 0), ("compute", 3.0),
              ("wait", "a"), ("wait", "b")]
    t = simulate_events(events)
    assert t.seconds == 4.0 and t.exposed_comm_seconds == 1.0


def test_the_trace_says_when_each_collective_ran_and_blocked():
    # "b" queues behind "a" on the link; "a" is hidden under compute, "b" is waited at once
    events = [("issue", "a", 2.0, "intra", 0), ("compute", 1.0), ("issue", "b", 2.0, "intra", 0),
              ("compute", 2.0), ("wait", "a"), ("wait", "b"), ("issue", "never_waited", 1.0, "inter", 0)]
    trace: list[dict] = []
    t = simulate_events(events, trace=trace)
    assert [r["key"] for r in trace] == ["a", "b", "never_waited"]
    a, b, last = trace
    assert (a["issued"], a["start"], a["end"], a["wait_called"], a["wait_returned"]) == (0.0, 0.0, 2.0, 3.0, 3.0)
    assert (b["issued"], b["start"], b["end"], b["wait_called"], b["wait_returned"]) == (1.0, 2.0, 4.0, 3.0, 4.0)
    # a collective never waited for is waited at the graph's end, as the timeline counts it
    assert (last["link"], last["start"], last["wait_called"], last["wait_returned"]) == ("inter", 4.0, 4.0, 5.0)
    blocked = sum(r["wait_returned"] - r["wait_called"] for r in trace)
    assert blocked == t.exposed_comm_seconds == 2.0 and t.seconds == 5.0
    assert simulate_events(events).seconds == t.seconds  # tracing changes nothing


def test_each_link_runs_its_own_collectives():
    # A hybrid step's reduce-scatter in the node and all-reduce across nodes: separate links
    # (FSDP2 runs the all-reduce on a stream of its own; the emulated network has one link of
    # each kind per rank), so they overlap; two on one link still take turns.
    events = [("issue", "rs", 2.0, "intra", 0), ("issue", "ar", 2.0, "inter", 0), ("compute", 1.0),
              ("wait", "rs"), ("wait", "ar")]
    assert simulate_events(events).seconds == 2.0
    events = [("issue", "ar0", 2.0, "inter", 0), ("issue", "ar1", 2.0, "inter", 0), ("compute", 1.0),
              ("wait", "ar0"), ("wait", "ar1")]
    assert simulate_events(events).seconds == 4.0


def test_partial_overlap_and_contention():
    events = [("issue", "x", 3.0, "intra", 0), ("compute", 2.0), ("wait", "x")]
    assert simulate_events(events).exposed_comm_seconds == 1.0
    # communication that takes CPU time from compute: the hidden 2 s cost half of it
    slowed = simulate_events(events, comm_overlap=0.5)
    assert slowed.seconds == 4.0 and slowed.exposed_comm_seconds == 2.0


def test_backend_threads_take_their_cpu_from_the_compute_after_the_issue():
    # gloo's threads spend 1 s of CPU on a collective: where compute is the bottleneck the step
    # grows by all of it, even though the collective hides (it is no share of the link's time)
    compute_bound = [("issue", "x", 2.0, "intra", 0), ("backend_cpu", 1.0), ("compute", 4.0), ("wait", "x")]
    t = simulate_events(compute_bound, host=LOCKSTEP)
    assert t.seconds == 5.0 and t.compute_seconds == 4.0 and t.exposed_comm_seconds == 1.0
    # of the exposed time, the backend's CPU is told apart from waits, and steps add it up
    assert t.backend_cpu_seconds == 1.0 and (t + t).backend_cpu_seconds == 2.0
    # where the link is, the wait absorbs it: the collective ends when it ends
    link_bound = [("issue", "x", 8.0, "intra", 0), ("backend_cpu", 1.0), ("compute", 4.0), ("wait", "x")]
    assert simulate_events(link_bound, host=LOCKSTEP).seconds == 8.0


def test_collective_cost_carries_the_backends_cpu_per_wire_byte():
    from fsdp_compile.planning.simulate import graph_events

    timed = small_cluster(collective_cpu={"all_gather": (1e-4, 2e-9)})
    cost = collective_cost("all_gather", 1_000_000, Group(4, 1), timed)
    assert cost.host.cpu_seconds == pytest.approx(1e-4 + 2e-9 * cost.wire_bytes)
    assert collective_cost("all_reduce", 1_000_000, Group(4, 1), timed).host.cpu_seconds == 0.0  # not measured
    assert graph_events([("ag", cost)])[1:] == [("backend_cpu", cost.host.cpu_seconds)]


def test_the_backends_own_work_runs_at_its_share_while_the_rank_computes():
    half = HostCPU(backend_share=(0.5, 1.0))
    # plain gloo (the link is the backend): 1 s of gloo under 1 s of compute gets half done,
    # the rest at full speed once the rank waits
    events = [("issue", "x", 1.0, "intra", 0, 0.0, 1.0), ("compute", 1.0), ("wait", "x")]
    assert simulate_events(events, host=LOCKSTEP).seconds == 1.0
    shared = simulate_events(events, host=half)
    assert shared.seconds == 1.5 and shared.exposed_comm_seconds == 0.5 and shared.comm_seconds == 1.0
    # a link slower than the backend sets the end; the backend's share does not add to it
    slow_link = [("issue", "x", 3.0, "intra", 0, 0.0, 1.0), ("compute", 1.0), ("wait", "x")]
    assert simulate_events(slow_link, host=half).seconds == 3.0
    # one queue for the rank's backend, across links, in issue order: the second waits for the first
    two = [("issue", "rs", 1.0, "intra", 0, 0.0, 1.0), ("issue", "ar", 1.0, "inter", 0, 0.0, 1.0),
           ("wait", "ar")]
    assert simulate_events(two, host=LOCKSTEP).seconds == 1.0 and simulate_events(two, host=half).seconds == 2.0
    # a collective its group's last rank issues later starts later; compute before that costs it nothing
    skewed = [("issue", "x", 1.0, "intra", 0, 2.0, 1.0), ("compute", 2.0), ("wait", "x")]
    assert simulate_events(skewed, host=half).seconds == 3.0
    # the backend goes on with the next collective while the rank waits for a slow link
    behind = [("issue", "a", 4.0, "intra", 0, 0.0, 1.0), ("issue", "b", 0.0, "inter", 0, 0.0, 2.0),
              ("wait", "a"), ("compute", 1.0), ("wait", "b")]
    assert simulate_events(behind, host=half).seconds == 5.0
    # the backend's CPU taken from compute is compute time for the queue too
    cpu = [("issue", "x", 1.0, "intra", 0, 0.0, 1.0), ("backend_cpu", 1.0), ("wait", "x")]
    assert simulate_events(cpu, host=half).seconds == 1.5


def test_symbolic_steps_leave_the_backends_share_out():
    import sympy

    b = sympy.Symbol("batch", positive=True)
    events = [("issue", "x", 1.0, "intra", 0, 0.0, 1.0), ("compute", b), ("wait", "x")]
    t = simulate_events(events, host=HostCPU(backend_share=(0.5, 1.0)))
    assert float(t.seconds.subs(b, 1)) == 1.0 and float(t.seconds.subs(b, 3)) == 3.0


def test_collective_cost_carries_the_backends_own_time_on_a_cpu():
    fit = MeasuredCollective(1e-4, 1e8, 2)
    plain = small_cluster(device_type="cpu", devices_per_node=2, measured_collectives={"all_gather": fit}).replace(
        host=LOCKSTEP)
    cost = collective_cost("all_gather", 1 << 20, Group(2, 1), plain)
    assert cost.host.backend_seconds == cost.seconds  # plain gloo: the link's fit is gloo's own
    own = MeasuredCollective(1e-5, 1e9, 2)
    emulated = plain.with_host(backend_collectives={"all_gather": own},
                               backend_inter_collectives={"all_gather": MeasuredCollective(2e-5, 5e8, 2)})
    cost = collective_cost("all_gather", 1 << 20, Group(2, 1), emulated)
    assert cost.host.backend_seconds == pytest.approx(1e-5 + (1 << 19) / 1e9) and cost.seconds > cost.host.backend_seconds
    across = collective_cost("all_gather", 1 << 20, Group(2, 2), emulated)
    assert across.host.backend_seconds == pytest.approx(2e-5 + (1 << 19) / 5e8)
    on_gpu = collective_cost("all_gather", 1 << 20, Group(2, 1), emulated.replace(device_type="cuda"))
    assert on_gpu.host.backend_seconds == 0.0


def test_backend_share_follows_the_cores_per_thread():
    from fsdp_compile_lab.calibration.host_collectives import backend_share

    assert backend_share(1.0) == (0.5, 1.0)  # world 2 on 2 cores
    assert backend_share(0.5) == (0.5, 1.0)  # world 4 on 2 cores: the fit already shared the cores
    assert backend_share(2.0) == (1.0, 1.0) and backend_share(1.5) == (0.75, 1.0)
    for bad in ((0.0, 1.0), (0.5, 1.5), (0.5,), "half"):
        with pytest.raises(ClusterError, match="backend_share="):
            small_cluster(backend_share=bad)


def test_unwaited_collective_is_waited_at_the_end():
    t = simulate_events([("issue", "x", 5.0, "intra", 0), ("compute", 1.0)])
    assert t.seconds == 5.0 and t.exposed_comm_seconds == 4.0


def test_symbolic_durations_give_expressions():
    import sympy

    b = sympy.Symbol("batch", positive=True)
    t = simulate_events([("issue", "x", 3.0, "intra", 0), ("compute", 2 * b), ("wait", "x")])
    assert float(t.seconds.subs(b, 1)) == 3.0 and float(t.seconds.subs(b, 4)) == 8.0
    assert not math.isnan(float(t.exposed_comm_seconds.subs(b, 1)))


def test_quiet_steps_leave_out_steps_that_waited_for_a_core():
    from fsdp_compile_lab.calibration.beside_steps import quiet_step_seconds

    times, waits = [1.0, 5.0, 1.2, 4.0], [0.01, 0.6, 0.04, 0.3]
    assert quiet_step_seconds(times, waits) == pytest.approx(1.1)  # the steps another job slowed are left out
    assert quiet_step_seconds(times[:2], waits[:2]) is None  # one quiet step is not a measurement
    # four ranks on two cores wait about half the time for each other: that is the job's own
    assert quiet_step_seconds([2.0, 2.2, 9.0], [0.5, 0.52, 0.8], cpu_share=0.5) == pytest.approx(2.1)


def test_collective_workspace_is_live_from_the_collective_to_its_wait():
    """gloo gathers into a temporary of the output's size: the peak must count it while the
    gather is in flight, and not after its wait."""
    from torch import fx

    from fsdp_compile.passes.graph import ALL_GATHER, WAIT
    from fsdp_compile.planning.simulate import memory_timeline

    mode = FakeTensorMode()
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    gathered = graph.call_function(ALL_GATHER, (shard, 2, "0"))
    waited = graph.call_function(WAIT, (gathered,))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (waited, 2))
    graph.output(doubled)
    with mode:
        shard.meta["val"] = torch.empty(1024)
        gathered.meta["val"] = waited.meta["val"] = torch.empty(2048)
        doubled.meta["val"] = torch.empty(2048)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    plain = [sum(live.values()) for live in memory_timeline(gm)]
    with_workspace = [sum(live.values()) for live in memory_timeline(gm, workspace={"all_gather": 1.0})]
    extra = [b - a for a, b in zip(plain, with_workspace)]
    assert extra == [0, 2048 * 4, 2048 * 4, 0, 0]  # placeholder, gather, wait, mul, output
    assert small_cluster(collective_workspace={"all_gather": 1.0}).collective_workspace == {"all_gather": 1.0}
    with pytest.raises(ClusterError, match=r"collective_workspace\['broadcast'\]"):
        small_cluster(collective_workspace={"broadcast": 1.0})
