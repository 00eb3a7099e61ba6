"""Scheduling: numerics unchanged, collectives really overlap compute, bad options rejected."""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import run_workers
from helpers import (
    SEQ,
    STEPS,
    TEST_CONFIG,
    WORLD,
    assert_bitwise,
    batches,
    expect_error,
    hybrid_options,
    lm_loss,
    local_slice,
    parity_run,
    train,
)

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig

_c10d = torch.ops._c10d_functional


def unscheduled_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    """aot_eager with the scheduling pass off, on the parity runs' data."""
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    backend = fsdp_compile.backend(strategy, compiler="aot_eager", schedule=False, **hybrid_options(strategy))
    backend.shard(model)
    out = train(model, torch.compile(model, backend=backend), data, rank)
    (record,) = backend.graphs
    out["scheduled"] = record.forward_schedule is not None
    return out if rank == 0 else {}


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


COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::native_layer_norm", "aten::native_layer_norm_backward",
               "aten::gelu", "aten::gelu_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::embedding_dense_backward")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_worker(rank: int, world: int, schedule: bool) -> dict:
    """Profile training steps; report how long gloo collectives ran while the main thread computed."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=67, block_size=64, n_layer=4, n_head=4, d_model=128)
    model = GPT(cfg)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", schedule=schedule)
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    x = torch.randint(0, cfg.vocab_size, (4, 64))
    for _ in range(2):
        compiled(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            compiled(x).sum().backward()
    events = prof.events()
    # The profiler numbers threads itself: the main thread is the one issuing collectives.
    main = next(e.thread for e in events if e.name.startswith("_c10d_functional::"))
    comms = _union([(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("gloo:")])
    computes = _union([(e.time_range.start, e.time_range.end) for e in events
                       if e.name in COMPUTE_OPS and e.thread == main])
    overlap = sum(max(0.0, min(ce, ke) - max(cs, ks)) for cs, ce in comms for ks, ke in computes)
    return {"overlap_us": overlap, "comm_us": sum(e - s for s, e in comms),
            "compute_us": sum(e - s for s, e in computes),
            "comms_on_main_thread": any(e.thread == main for e in events if e.name.startswith("gloo:"))}


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


def overlapped_compute(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Per gathered bucket, the compute nodes between its all-gather and that gather's wait (in
    node order). Buckets are told apart by the tag lowering puts on their nodes."""
    from fsdp_compile.passes.graph import COMM_META

    nodes = list(gm.graph.nodes)
    issued = {n: i for i, n in enumerate(nodes) if n.target is _c10d.all_gather_into_tensor.default}
    out = {}
    for i, node in enumerate(nodes):
        if node.target is _c10d.wait_tensor.default and node.args[0] in issued:
            start = issued[node.args[0]]
            out[node.args[0].meta[COMM_META].bucket] = sum(
                1 for n in nodes[start + 1:i] if n.op == "call_function" and COMM_META not in n.meta)
    return out


def explicit_prefetch_worker(rank: int, world: int) -> dict:
    """prefetch=0, with and without an explicit order (names in forward, modules in backward)."""
    out = {}
    for name in ("explicit", "none"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(TEST_CONFIG)
        orders = {"forward_prefetch": {"blocks.0": ["blocks.1", "<root>"]},
                  "backward_prefetch": {model.blocks[1]: [model.blocks[0]]}} if name == "explicit" else {}
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", prefetch=0, **orders)
        backend.shard(model)
        x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
        lm_loss(torch.compile(model, backend=backend)(x), y).backward()
        (record,) = backend.graphs
        out[name] = {"forward": overlapped_compute(record.forward), "backward": overlapped_compute(record.backward)}
    return out


def test_explicit_prefetch_orders_change_the_compiled_schedule() -> None:
    """forward_prefetch={"blocks.0": ["blocks.1", "<root>"]} and backward_prefetch={blocks[1]:
    [blocks[0]]} with prefetch=0: the named gathers run under the trigger's compute, read off the
    graphs' node order; without the orders every gather is waited right where it is issued. The
    root's name reaches its tail bucket (final norm and head), the one not yet gathered then."""

    out = run_workers(explicit_prefetch_worker, 2)[0]
    explicit, none = out["explicit"], out["none"]
    assert explicit["forward"]["blocks.1"] > 0 and none["forward"]["blocks.1"] == 0
    assert explicit["backward"]["blocks.0"] > 0 and none["backward"]["blocks.0"] == 0
    assert explicit["forward"]["<root>:tail"] > 0 and none["forward"]["<root>:tail"] == 0
    # Only the named buckets moved.
    assert explicit["forward"]["<root>"] == explicit["forward"]["blocks.0"] == 0
    assert explicit["backward"]["<root>"] == explicit["backward"]["blocks.1"] == 0


def schedule_errors_worker(rank: int, world: int) -> dict:
    errors = {}
    torch._dynamo.reset()
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", max_inflight_bytes=1000)
    backend.shard(model)
    x = torch.randint(0, TEST_CONFIG.vocab_size, (2, SEQ))
    errors["small_budget"] = expect_error(lambda: torch.compile(model, backend=backend)(x))
    errors["unknown_unit"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", forward_prefetch={"blocks.0": ["blocks.7"]}).shard(GPT(TEST_CONFIG)))
    model = GPT(TEST_CONFIG)
    errors["unknown_module"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", backward_prefetch={model.blocks[1]: [model.blocks[1].mlp]}).shard(model))
    return errors


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
