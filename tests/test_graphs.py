"""What the compiled forward and backward graphs gather, keep, and reduce, per strategy.

The test GPT has B = 4 buckets under the default policy: blocks.0, blocks.1 and the root, which
forward reads at both ends and so is two buckets: ``<root>`` (embeddings) and ``<root>:tail``
(final norm and head). Backward reads the head first and the embeddings last.
"""

from __future__ import annotations

import pytest
from helpers import TEST_CONFIG, assert_inductor_keeps_the_order, inductor_orders_in_a_fake_world, parity_run

COMPILERS = ["aot_eager", "inductor"]
B = 4
BUCKETS = ["<root>", "<root>:tail", "blocks.0", "blocks.1"]


def facts(strategy: str, compiler: str) -> dict:
    """Facts of the graphs the parity run compiled (the same run the parity tests check)."""
    return parity_run(strategy)[compiler]["facts"]


def compiler_params(strategies):
    return [(s, c) for s in strategies for c in COMPILERS]


@pytest.mark.parametrize("strategy,compiler", compiler_params(
    ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_every_marker_is_lowered_into_its_bucket(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["markers"]["forward"] == {"unshard": 0, "reduce_grad": 0}
    assert f["markers"]["backward"] == {"unshard": 0, "reduce_grad": 0}
    assert sorted(f["reduce_buckets"]) == BUCKETS
    assert f["reduced_params"] == f["trainable"]


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "HYBRID_SHARD"]))
def test_resharding_strategies_gather_again_and_keep_no_full_parameter(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["all_gather"] == B
    assert f["saved_gathered"] == [], "a gathered parameter is saved for backward"
    # Backward gathers again, once per bucket whose parameters it needs: the head and final norm
    # (read first, so backward's "<root>") and the blocks; no embedding table.
    assert 0 < f["backward"]["all_gather"] <= B - 1
    assert sorted(f["regather_buckets"]) == ["<root>", "blocks.0", "blocks.1"]
    assert f["backward"]["reduce_scatter"] == B


@pytest.mark.parametrize("strategy,compiler", compiler_params(["SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"]))
def test_zero2_strategies_keep_gathered_parameters_for_backward(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["all_gather"] == B
    assert f["saved_gathered"], "no gathered parameter is kept for backward"
    assert f["backward"]["all_gather"] == 0
    assert f["backward"]["reduce_scatter"] == B


@pytest.mark.parametrize("strategy,compiler", compiler_params(["NO_SHARD"]))
def test_no_shard_gathers_nothing_and_all_reduces_each_bucket(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    assert f["backward"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": B}
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (1, False, 2)


@pytest.mark.parametrize("strategy,compiler", compiler_params(["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_hybrid_reduces_in_shard_group_then_across_replicas(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["backward"]["reduce_scatter"] == B and f["backward"]["all_reduce"] == B
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (2, True, 2)
    assert spec.shard_group != spec.replicate_group


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "SHARD_GRAD_OP"]))
def test_flat_strategies_reduce_scatter_over_the_world(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["backward"]["all_reduce"] == 0
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (2, True, 1)


@pytest.mark.parametrize("strategy,compiler", compiler_params(
    ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_collectives_in_flight_stay_within_the_budget(strategy, compiler):
    # Read off each scheduled graph's node order (collective to its wait) and buffer sizes, not
    # from the pass's own bookkeeping; the default budget is twice the largest collective, plus
    # twice the largest all-reduce of a reduce-scatter's result where the strategy is hybrid.
    checked, later_stages = 0, []
    for peak, largest, later, budget in facts(strategy, compiler)["inflight"]:
        if largest == 0:
            continue  # a graph without collectives (NO_SHARD's forward)
        later_stages.append(later)
        assert budget == 2 * largest + 2 * later
        assert peak <= budget, f"{peak} bytes in flight, budget {budget}"
        checked += 1
    assert checked
    assert any(later_stages) == strategy.startswith("HYBRID"), later_stages


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "HYBRID_SHARD"]))
def test_backward_gathers_only_the_parameters_backward_needs(strategy, compiler):
    """The input gradients need the weights of linear layers and layer norms: backward gathers
    all of those. It may also gather biases, for activations the partitioner chooses to
    recompute rather than save (aot_eager does for one block's q/k/v), but never the embedding
    tables, which no backward computation reads (bytes from shapes: padded rows x row x 4 x 2)."""
    from torch import nn

    from fsdp_compile.models.gpt import GPT

    def gathered_bytes(params) -> int:
        return sum(4 * 2 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in params)

    model = GPT(TEST_CONFIG)
    needed = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm))]
    biases = [m.bias for m in model.modules() if getattr(m, "bias", None) is not None]
    assert gathered_bytes(needed) + gathered_bytes(biases) < gathered_bytes(model.parameters())
    gathered = facts(strategy, compiler)["backward_gather_bytes"]
    assert gathered_bytes(needed) <= gathered <= gathered_bytes(needed) + gathered_bytes(biases)


@pytest.mark.parametrize("strategy,compiler", compiler_params(
    ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_no_wait_directly_after_its_collective_while_compute_could_run(strategy, compiler):
    assert facts(strategy, compiler)["missed_overlaps"] == []


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_inductor_runs_the_collectives_in_the_scheduled_order(strategy):
    """Inductor orders the kernels of the graph we hand it once more; its peak-memory reordering
    would move each backward all-gather to right before its wait and every reduce-scatter's
    wait to the end of the graph. Read off its wrapper code, the compiled step issues and waits
    for the collectives in the order of our scheduled graphs, and every collective our schedule
    overlaps with compute still has a kernel running while it is in flight."""
    order = facts(strategy, "inductor")["inductor_order"]
    assert_inductor_keeps_the_order(order)
    assert any(order["graph"][1][1]), "the scheduled backward overlaps nothing"


@pytest.mark.slow  # Inductor's scheduler runs only on a cold cache: a fresh one costs about 50 s
def test_inductor_reorders_for_memory_only_graphs_without_collectives(tmp_path):
    """Keeping our order costs Inductor's peak-memory reordering only where there is an order to
    keep: NO_SHARD's forward has no collective and is reordered as Inductor would by default;
    its backward (all-reduces) keeps our order."""
    order = inductor_orders_in_a_fake_world("NO_SHARD", "cpu", tmp_path)
    assert order["graph"][0][0] == [] and order["graph"][1][0], "expected collectives in backward only"
    # One log per scheduler run: the forward's top-level graph and its region body.
    assert order["reordered_for_memory"] > 0
    assert_inductor_keeps_the_order(order)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_parameter_memory_orders_the_strategies(compiler):
    """Measured per rank on the real tensors of a training step: parameter storage, the gathered
    parameters autograd keeps from forward to backward (saved tensors holding a whole
    parameter's values, the parameters' own storage excepted), and gradient storage.

    FULL_SHARD keeps shards, no gathered parameter and shard gradients; SHARD_GRAD_OP also keeps
    every gathered parameter backward needs; NO_SHARD keeps whole parameters and whole
    gradients. The static estimate (backend.graphs[i].forward_memory) orders them the same way.
    """
    measured = {s: parity_run(s)[compiler]["measured_memory"] for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}
    assert measured["FULL_SHARD"]["kept_gathered"] == 0 < measured["SHARD_GRAD_OP"]["kept_gathered"]
    assert measured["NO_SHARD"]["kept_gathered"] == 0
    total = {s: sum(m.values()) for s, m in measured.items()}
    assert total["FULL_SHARD"] < total["SHARD_GRAD_OP"] < total["NO_SHARD"], measured
    estimated = {s: facts(s, compiler)["parameter_memory"] for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}
    assert estimated["FULL_SHARD"] < estimated["SHARD_GRAD_OP"] < estimated["NO_SHARD"], estimated
