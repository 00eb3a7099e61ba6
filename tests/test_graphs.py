"""What the compiled forward and backward graphs gather, keep, and reduce, per strategy.

The test GPT has B = 3 buckets under the default policy: blocks.0, blocks.1 and the root.
"""

from __future__ import annotations

import pytest

from runs import parity_run

COMPILERS = ["aot_eager", "inductor"]
B = 3


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
    assert sorted(f["reduce_buckets"]) == ["<root>", "blocks.0", "blocks.1"]
    assert f["reduced_params"] == f["trainable"]


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "HYBRID_SHARD"]))
def test_resharding_strategies_gather_again_and_keep_no_full_parameter(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["all_gather"] == B
    assert f["saved_gathered"] == [], "a gathered parameter is saved for backward"
    # Backward gathers again, once per bucket whose parameters it needs (every bucket here).
    assert 0 < f["backward"]["all_gather"] <= B
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
    # The static estimate of the scheduled graphs, against the default budget (two buckets).
    for estimated, budget in facts(strategy, compiler)["inflight"]:
        assert estimated <= budget


@pytest.mark.parametrize("strategy,compiler", compiler_params(
    ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_no_wait_directly_after_its_collective_while_compute_could_run(strategy, compiler):
    assert facts(strategy, compiler)["missed_overlaps"] == []


@pytest.mark.parametrize("compiler", COMPILERS)
def test_parameter_memory_orders_the_strategies(compiler):
    """Peak bytes of parameter shards, gathered parameters and gradients over the step.

    FULL_SHARD keeps shards and two buckets in flight; SHARD_GRAD_OP also keeps every gathered
    parameter backward needs (not the embeddings or biases) but its gradients are shards;
    NO_SHARD keeps whole parameters and whole gradients.
    """
    memory = {s: facts(s, compiler)["parameter_memory"] for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}
    assert memory["FULL_SHARD"] < memory["SHARD_GRAD_OP"] < memory["NO_SHARD"], memory
