"""What the compiled forward and backward graphs gather, keep, and reduce, per strategy."""

from __future__ import annotations

import pytest

from runs import parity_run

COMPILERS = ["aot_eager", "inductor"]


def facts(strategy: str, compiler: str) -> dict:
    """Facts of the graphs the parity run compiled (the same run the parity tests check)."""
    return parity_run(strategy)[compiler]["facts"]


def compiler_params(strategies):
    return [(s, c) for s in strategies for c in COMPILERS]


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "HYBRID_SHARD"]))
def test_resharding_strategies_gather_again_and_keep_no_full_parameter(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["unshard"] == f["trainable"]
    assert f["saved_gathered"] == [], "a gathered parameter is saved for backward"
    # Every parameter that backward needs (weights, not biases) is gathered again there.
    assert 0 < f["backward"]["unshard"] < f["trainable"]
    assert f["backward"]["reduce_grad"] == f["trainable"]


@pytest.mark.parametrize("strategy,compiler", compiler_params(["SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"]))
def test_zero2_strategies_keep_gathered_parameters_for_backward(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["unshard"] == f["trainable"]
    assert f["saved_gathered"], "no gathered parameter is kept for backward"
    assert f["backward"]["unshard"] == 0
    assert f["backward"]["reduce_grad"] == f["trainable"]


@pytest.mark.parametrize("strategy,compiler", compiler_params(["NO_SHARD"]))
def test_no_shard_gathers_nothing_and_all_reduces_gradients(strategy, compiler):
    f = facts(strategy, compiler)
    assert f["forward"]["unshard"] == 0 and f["backward"]["unshard"] == 0
    assert f["backward"]["reduce_grad"] == f["trainable"]
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (1, False, 2)


@pytest.mark.parametrize("strategy,compiler", compiler_params(["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]))
def test_hybrid_reduces_in_shard_group_then_across_replicas(strategy, compiler):
    f = facts(strategy, compiler)
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (2, True, 2)
    assert spec.shard_group != spec.replicate_group


@pytest.mark.parametrize("strategy,compiler", compiler_params(["FULL_SHARD", "SHARD_GRAD_OP"]))
def test_flat_strategies_reduce_scatter_over_the_world(strategy, compiler):
    f = facts(strategy, compiler)
    (spec,) = f["reduce_specs"]
    assert (spec.shard_size, spec.dim0_sharded, spec.replicate_size) == (2, True, 1)
