"""Bodies of the planner's multi-process tests (importable by spawned workers)."""

from __future__ import annotations

import copy
import logging

import torch
from workers import PER_RANK_BATCH, SEQ, TEST_CONFIG, batches, train

import fsdp_compile
from fsdp_compile.gpt import GPT
from fsdp_compile.planning import Cluster, PlanError


def plan_loss(output: torch.Tensor) -> torch.Tensor:
    """Module level: the planner pickles it for its subprocess."""
    return output.float().square().mean()


def test_cluster(world: int, memory: float) -> Cluster:
    return Cluster(name="test-cpu", nodes=1, devices_per_node=world, device_memory=memory,
                   peak_flops={torch.float32: 2e10}, memory_bandwidth=5e9, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=None, intra_node_latency=2e-5, inter_node_latency=None,
                   op_overhead=1e-5, device_type="cpu")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def auto_worker(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    example = (torch.zeros(PER_RANK_BATCH, SEQ, dtype=torch.long),)
    options = {"prefetch": (1, 2)}

    # a budget nothing fits in: every rank gets the planner's error
    tiny = fsdp_compile.backend("auto", compiler="aot_eager", example_inputs=example, loss_fn=plan_loss,
                                cluster=test_cluster(world, 1e4), memory_budget=1e4,
                                plan_options={"prefetch": (1,), "strategies": ["FULL_SHARD"]})
    try:
        tiny.shard(copy.deepcopy(base))
        error = ""
    except PlanError as exc:
        error = str(exc)

    logger = logging.getLogger("fsdp_compile")
    capture = _Capture()
    logger.addHandler(capture)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        auto = fsdp_compile.backend("auto", compiler="aot_eager", example_inputs=example, loss_fn=plan_loss,
                                    cluster=test_cluster(world, 1 << 30), memory_budget=1 << 30,
                                    plan_options=options)
        model = auto.shard(copy.deepcopy(base))
    finally:
        logger.removeHandler(capture)
        logger.setLevel(previous)
    data = batches(TEST_CONFIG, world, steps)
    chosen = {"strategy": auto.strategy.name, "bucket": auto.options.bucket, "prefetch": auto.options.prefetch}
    result = train(model, torch.compile(model, backend=auto), data, rank)

    explicit = fsdp_compile.backend(chosen["strategy"], compiler="aot_eager", bucket=chosen["bucket"],
                                    prefetch=chosen["prefetch"])
    reference = explicit.shard(copy.deepcopy(base))
    expected = train(reference, torch.compile(reference, backend=explicit), data, rank)
    best = auto.plan.best
    return {
        "error": error, "chosen": chosen, "log": capture.messages,
        "best": (best.strategy, best.bucket, best.prefetch), "rows": len(auto.plan.rows),
        "losses": result["losses"] == expected["losses"],
        "grads0": all(torch.equal(result["grads0"][n], expected["grads0"][n]) for n in expected["grads0"]),
        "params": all(torch.equal(result["params"][n], expected["params"][n]) for n in expected["params"]),
        "same_graphs": [r.forward.code for r in auto.graphs] == [r.forward.code for r in explicit.graphs],
    }


def measure_worker(rank: int, world: int) -> dict:
    cluster = Cluster.measure(sizes=(1 << 14, 1 << 16, 1 << 18), repeats=3, device_memory=1 << 30)
    return {
        "world": cluster.world_size, "flops": {str(k): v for k, v in cluster.peak_flops.items()},
        "memory_bandwidth": cluster.memory_bandwidth, "op_overhead": cluster.op_overhead,
        "overlap": cluster.comm_overlap, "optimizer_step": cluster.optimizer_step,
        "workspace": cluster.collective_workspace,
        "collectives": {k: (v.step_latency, v.bandwidth, v.group_size, len(v.samples))
                        for k, v in cluster.measured_collectives.items()},
        "sources": sorted(cluster.sources),
    }
