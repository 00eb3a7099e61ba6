"""Scheduling: numerics unchanged, collectives really overlap compute, bad options rejected."""

from __future__ import annotations

import functools

import pytest
from distributed import run_workers
from runs import STEPS, WORLD, parity_run
from test_parity import assert_bitwise
from workers import overlap_worker, schedule_errors_worker, unscheduled_worker


@functools.cache
def unscheduled(strategy: str) -> dict:
    return run_workers(unscheduled_worker, WORLD[strategy], strategy, STEPS)[0]


@pytest.mark.parametrize("strategy", [
    s if s in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD") else pytest.param(s, marks=pytest.mark.slow)
    for s in WORLD])
def test_scheduling_changes_no_bits(strategy: str) -> None:
    off, on = unscheduled(strategy), parity_run(strategy)["aot_eager"]
    assert not off["scheduled"]
    assert_bitwise(off["grads0"], on["grads0"], "first-step gradients, scheduling off vs on")
    assert_bitwise(off["params"], on["params"], "parameters, scheduling off vs on")


def test_collectives_overlap_compute_on_cpu() -> None:
    """A profiled step at world 2: gloo moves the data on its own threads while the main
    thread computes. With the collectives scheduled, a sizeable part of the communication time
    runs under compute; without, waits follow their collectives and little does."""
    on = run_workers(overlap_worker, 2, True)
    off = run_workers(overlap_worker, 2, False)
    for report in on + off:
        assert not report["comms_on_main_thread"] and report["compute_us"] > 0
    share_on = sum(r["overlap_us"] for r in on) / sum(r["comm_us"] for r in on)
    share_off = sum(r["overlap_us"] for r in off) / sum(r["comm_us"] for r in off)
    assert share_on > 0.2, (share_on, on)
    assert share_on > 2 * share_off, (share_on, share_off)


def test_explicit_prefetch_orders_change_the_compiled_schedule() -> None:
    """forward_prefetch={"blocks.0": ["blocks.1"]} and backward_prefetch={blocks[1]: [blocks[0]]}
    with prefetch=0: the named gathers run under the trigger's compute, read off the graphs'
    node order; without the orders every gather is waited right where it is issued."""
    from workers import explicit_prefetch_worker

    out = run_workers(explicit_prefetch_worker, 2)[0]
    explicit, none = out["explicit"], out["none"]
    assert explicit["forward"]["blocks.1"] > 0 and none["forward"]["blocks.1"] == 0
    assert explicit["backward"]["blocks.0"] > 0 and none["backward"]["blocks.0"] == 0
    # Only the named buckets moved.
    assert explicit["forward"]["<root>"] == explicit["forward"]["blocks.0"] == 0
    assert explicit["backward"]["<root>"] == explicit["backward"]["blocks.1"] == 0


def test_scheduling_option_errors() -> None:
    import fsdp_compile

    with pytest.raises(ValueError, match="prefetch=-1 must be an int >= 0"):
        fsdp_compile.backend(prefetch=-1)
    with pytest.raises(ValueError, match="max_inflight_bytes=0 must be a positive int"):
        fsdp_compile.backend(max_inflight_bytes=0)
    with pytest.raises(ValueError, match="forward_prefetch= names bucket units, which bucket='param' does not have"):
        fsdp_compile.backend(bucket="param", forward_prefetch={"a": ["b"]})
    errors = run_workers(schedule_errors_worker, 2)[0]
    assert "max_inflight_bytes=1000 is smaller than bucket" in errors["small_budget"]
    assert "raise it to at least" in errors["small_budget"]
    assert "forward_prefetch= names 'blocks.7', which is not a bucket unit" in errors["unknown_unit"]
    assert "units are: <root>, blocks.0, blocks.1" in errors["unknown_unit"]
    assert "backward_prefetch= names 'blocks.1.mlp', which is not a bucket unit" in errors["unknown_module"]
