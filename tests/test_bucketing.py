"""Bucket policies: what each groups, and that bucketing never changes the numbers."""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import (
    STRATEGIES,
    TEST_CONFIG,
    WORLD,
    assert_bitwise,
    batches,
    graph_facts,
    hybrid_options,
    train,
)
from torch import nn

import fsdp_compile
from fsdp_compile.api import parse_policy
from fsdp_compile.models.gpt import GPT
from fsdp_compile.sharding.units import unit_modules, unit_of

# The default policy ("module") is checked by the parity runs (tests/test_parity.py).
POLICIES = ["param", "bytes", "classes", "callable"]
STEPS = 3
N_PARAMS = 29  # the test GPT's parameters
# By default FULL_SHARD (gathers, reduce-scatters) runs every policy; the others run with -m slow
# to keep the default run short, HYBRID_SHARD (adds the all-reduce across replicas, 4 ranks on 2
# cores: 38 s) among them. The parity runs lower the hybrid all-reduce per bucket by default.
POLICY_STRATEGIES = [s if s == "FULL_SHARD" else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES]


def attention_or_mlp(module: nn.Module) -> bool:
    """A callable bucket policy (as FSDP1's auto_wrap_policy): attention and MLP separately."""
    from fsdp_compile.models.gpt import MLP, CausalSelfAttention

    return isinstance(module, (CausalSelfAttention, MLP))


def bucket_policies() -> dict[str, Any]:
    from fsdp_compile.models.gpt import Block

    return {"module": "module", "param": "param", "bytes": 4096, "classes": {Block},
            "callable": attention_or_mlp}


def policy_worker(rank: int, world: int, strategy: str, policies: list[str], steps: int) -> dict:
    """The eager runtime (no buckets) and aot_eager under each bucket policy, on the same data."""
    from fsdp_compile.inspection.graphinfo import collectives

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    model = copy.deepcopy(base)
    fsdp_compile.backend(strategy, **hybrid_options(strategy)).shard(model)
    out["eager"] = train(model, model, data, rank)
    for name in policies:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", bucket=bucket_policies()[name],
                                       **hybrid_options(strategy))
        backend.shard(model)
        result = train(model, torch.compile(model, backend=backend), data, rank)
        (record,) = backend.graphs
        result["facts"] = graph_facts(backend, model)
        result["gather_bucket_bytes"] = [c.buffer_bytes for c in collectives(record.forward)
                                         if c.kind == "all_gather"]
        result["gather_bucket_sizes"] = [len({m.fqn for m in b.markers})
                                         for b in record.forward_buckets["unshard"]]
        result["gather_bucket_members"] = [[(m.fqn, m.full_bytes) for m in b.markers]
                                           for b in record.forward_buckets["unshard"]]
        # The order forward reads the parameters in (each gather marker of the captured graph).
        result["read_order"] = list(dict.fromkeys(
            n.args[1] for n in record.dynamo.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("fsdp_compile.unshard")))
        out[name] = result
    return out if rank == 0 else {}


@functools.cache
def policy_run(strategy: str) -> dict:
    return run_workers(policy_worker, WORLD[strategy], strategy, POLICIES, STEPS)[0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("strategy", POLICY_STRATEGIES)
def test_bucketed_training_is_bitwise_equal_to_the_unbucketed_eager_runtime(strategy: str, policy: str) -> None:
    out = policy_run(strategy)
    assert_bitwise(out[policy]["grads0"], out["eager"]["grads0"], f"{policy} first-step gradients")
    assert_bitwise(out[policy]["params"], out["eager"]["params"], f"{policy} parameters")


# The root is read at both ends of forward and backward: two buckets, "<root>" and "<root>:tail".
EXPECTED_BUCKETS = {
    "classes": ["<root>", "<root>:tail", "blocks.0", "blocks.1"],
    # attention and MLP of each block; layer norms of the blocks fall back to the root
    "callable": ["<root>", "<root>:tail", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"],
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", pytest.param("HYBRID_SHARD", marks=pytest.mark.slow)])
def test_one_collective_per_bucket(strategy: str, policy: str) -> None:
    f = policy_run(strategy)[policy]["facts"]
    gathers, reductions = f["gather_buckets"], f["reduce_buckets"]
    assert f["forward"]["all_gather"] == len(gathers)
    assert 0 < f["backward"]["all_gather"] <= len(gathers)
    assert f["backward"]["reduce_scatter"] == len(reductions)
    hybrid_all_reduces = len(reductions) if strategy == "HYBRID_SHARD" else 0
    assert f["backward"]["all_reduce"] == hybrid_all_reduces
    if policy in EXPECTED_BUCKETS:
        assert sorted(gathers) == sorted(reductions) == EXPECTED_BUCKETS[policy]
    if policy == "param":
        assert len(gathers) == len(reductions) == N_PARAMS


def test_byte_policy_fills_buckets_up_to_the_limit() -> None:
    out = policy_run("FULL_SHARD")["bytes"]
    limit = bucket_policies()["bytes"]
    for size, members in zip(out["gather_bucket_bytes"], out["gather_bucket_sizes"]):
        assert size <= limit or members == 1  # a larger tensor is a bucket of its own
    assert 1 < len(out["gather_bucket_bytes"]) < N_PARAMS
    buckets = out["gather_bucket_members"]
    # Consecutive parameters in the order forward reads them: the buckets, one after another,
    # are that order (every parameter once).
    assert [fqn for bucket in buckets for fqn, _ in bucket] == out["read_order"]
    assert len(out["read_order"]) == N_PARAMS
    # Filled up to the limit: each bucket closed only because the next parameter would not fit.
    for bucket, following in itertools.pairwise(buckets):
        held = sum(nbytes for _, nbytes in bucket)
        assert held + following[0][1] > limit, (bucket, following[0])


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(2, 2)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3))
        self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # not repeated: two classes


def test_unit_assignment() -> None:
    model = Tower()
    assert unit_modules(model, parse_policy("module")) == {"layers.0", "layers.1", "layers.2"}
    units = unit_modules(model, parse_policy({nn.Linear}))
    assert units == {"stem", "layers.0.0", "layers.1.0", "layers.2.0", "mixed.0"}
    assert unit_of("layers.1.0", {"layers.1"}) == "layers.1"
    assert unit_of("mixed.0", {"layers.1"}) == ""
    assert unit_modules(model, parse_policy("param")) == set()


def test_bad_policies_name_the_argument() -> None:
    with pytest.raises(ValueError, match="bucket=0 must be a positive number of bytes"):
        parse_policy(0)
    with pytest.raises(ValueError, match="bucket=-5 must be a positive"):
        parse_policy(-5)
    with pytest.raises(ValueError, match="bucket='layers' is not a policy"):
        parse_policy("layers")
    with pytest.raises(TypeError, match="not a bool"):
        parse_policy(True)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        parse_policy({int})
    with pytest.raises(ValueError, match=r"bucket=\{Conv2d\} matches no module of Tower"):
        unit_modules(Tower(), parse_policy({nn.Conv2d}))
    with pytest.raises(ValueError, match="bucket=never matches no module"):
        def never(module: nn.Module) -> bool:
            return False
        unit_modules(Tower(), parse_policy(never))
