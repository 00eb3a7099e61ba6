"""What sharding does to a model: storage per rank, shared and 0-d parameters, buffers, graph breaks."""

from __future__ import annotations

import pytest
import torch

from distributed import run_workers
from test_parity import GRAD_ATOL, PARAM_ATOL, assert_bitwise, max_diff
from workers import graph_break_worker, storage_worker, tied_worker


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_each_rank_stores_its_share_of_the_parameters(strategy: str) -> None:
    world = 2
    for report in run_workers(storage_worker, world, strategy):
        if strategy == "NO_SHARD":
            assert report["local"] == report["full"]
        else:
            # Exactly the padded 1/N share FSDP2 stores: about half, plus padding rows.
            assert report["local"] == report["padded_share"]
            assert report["full"] / world <= report["local"] < report["full"] / world * 1.05


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_tied_and_scalar_parameters_and_buffers(strategy: str) -> None:
    steps = 4
    out = run_workers(tied_worker, 2, strategy, steps)[0]
    assert out["same_object"], "a parameter shared by two modules was sharded twice"
    # The tied emb/head weight counts once: + norm weight and bias + temperature.
    assert out["unique_params"] == 4
    sharded = "Shard(dim=0)" if strategy != "NO_SHARD" else "Replicate()"
    assert out["placements"]["emb.weight"] == (sharded,)
    assert out["placements"]["temperature"] == ("Replicate()",)  # 0-d: kept whole
    assert out["buffers_plain"] and out["scale_unchanged"]
    for mode in ("eager", "aot_eager"):
        assert out[mode]["still_tied"]
        grad_diff, name = max_diff(out[mode]["grads0"], out["reference"]["grads0"])
        assert grad_diff <= GRAD_ATOL, f"{mode}: first-step gradient of {name} differs by {grad_diff}"
        param_diff, name = max_diff(out[mode]["params"], out["reference"]["params"])
        assert param_diff <= PARAM_ATOL, f"{mode}: {name} differs by {param_diff}"
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "eager vs aot_eager")
    assert torch.equal(out["eager"]["eval_logits"], out["aot_eager"]["eval_logits"])


def test_graph_break_from_disabled_submodule_trains_correctly() -> None:
    out = run_workers(graph_break_worker, 2, "FULL_SHARD", 3)[0]
    assert out["aot_eager"]["graphs"] >= 2, "the disabled submodule did not split the graph"
    for mode in ("eager", "aot_eager"):
        param_diff, name = max_diff(out[mode]["params"], out["reference"]["params"])
        assert param_diff <= PARAM_ATOL, f"{mode}: {name} differs by {param_diff}"
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "eager vs aot_eager")


def test_one_call_compile_equals_shard_then_compile() -> None:
    from workers import convenience_worker

    out = run_workers(convenience_worker, 2)[0]
    assert out["strategy"] == "SHARD_GRAD_OP" and out["graphs"] == 1
    assert_bitwise(out["got"], out["want"], "fsdp_compile.compile vs explicit")
