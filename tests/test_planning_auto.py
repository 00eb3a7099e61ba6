"""strategy="auto": the plan's choice, applied on every rank, trains exactly like that strategy."""

from __future__ import annotations

import pytest
from distributed import run_workers
from planning_workers import auto_worker

import fsdp_compile


def test_auto_trains_bitwise_like_the_chosen_strategy():
    results = run_workers(auto_worker, 2, 3)
    for rank, r in enumerate(results):
        assert "no strategy fits" in r["error"] and "what would make it fit" in r["error"], rank
        assert r["chosen"] == results[0]["chosen"]  # every rank applies rank 0's plan
        assert (r["chosen"]["strategy"], r["chosen"]["prefetch"]) == (r["best"][0], r["best"][2])
        assert r["rows"] >= 4
        assert r["losses"] and r["grads0"] and r["params"] and r["same_graphs"], (rank, r)
    logged = [m for m in results[0]["log"] if "strategy='auto' chose" in m]
    assert len(logged) == 1 and results[0]["chosen"]["strategy"] in logged[0]
    assert not any("strategy='auto' chose" in m for m in results[1]["log"])


def test_auto_options_are_checked():
    with pytest.raises(ValueError, match="strategy='auto' chooses the layout itself"):
        fsdp_compile.backend("auto", shard_size=2)
    with pytest.raises(ValueError, match="are for strategy='auto'"):
        fsdp_compile.backend("FULL_SHARD", memory_budget=1 << 30)


def test_measure_calibrates_this_machine_on_every_rank_alike():
    from planning_workers import measure_worker

    results = run_workers(measure_worker, 2)
    assert results[0] == results[1]  # every rank gets the slowest rank's numbers
    r = results[0]
    assert r["world"] == 2
    assert r["flops"]["torch.float32"] > 1e8 and r["memory_bandwidth"] > 1e8 and r["op_overhead"] > 0
    assert 0.0 <= r["overlap"] <= 1.0
    assert set(r["collectives"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    for latency, bandwidth, group, samples in r["collectives"].values():
        assert latency >= 0 and bandwidth > 0 and group == 2 and samples == 3
    assert "collectives" in r["sources"] and "peak_flops" in r["sources"]
    # a real optimizer step over DTensor shards: a cost per tensor and per byte, AdamW dearer than SGD
    assert set(r["optimizer_step"]) == {"adamw", "sgd"}
    assert r["optimizer_step"]["adamw"][0] > r["optimizer_step"]["sgd"][0] > 0
    # what gloo allocates beside each collective's result, per byte of its buffer, by the allocator
    assert set(r["workspace"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(v >= 0 for v in r["workspace"].values())
