"""strategy="auto": the plan's choice, applied on every rank, trains exactly like that strategy."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from distributed import run_workers
from helpers import PER_RANK_BATCH, SEQ, TEST_CONFIG, batches, train

import fsdp_compile
from fsdp_compile.models.gpt import GPT
from fsdp_compile.planning import Cluster, PlanError
from fsdp_compile_lab.host import HostCPU


def plan_loss(output: torch.Tensor) -> torch.Tensor:
    """Module level: the planner pickles it for its subprocess."""
    return output.float().square().mean()


def cpu_cluster(world: int, memory: float) -> Cluster:
    return Cluster(name="test-cpu", nodes=1, devices_per_node=world, device_memory=memory,
                   peak_flops={torch.float32: 2e10}, memory_bandwidth=5e9, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=None, intra_node_latency=2e-5, inter_node_latency=None,
                   device_type="cpu", host=HostCPU(op_overhead=1e-5))


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
    # The ranks ask for plans that cannot agree: only rank 0's counts, and every rank applies it.
    options = {"prefetch": (1, 2), "strategies": ["FULL_SHARD", "SHARD_GRAD_OP"] if rank == 0 else ["NO_SHARD"]}

    # a budget nothing fits in: every rank gets the planner's error
    tiny = fsdp_compile.backend("auto", compiler="aot_eager", example_inputs=example, loss_fn=plan_loss,
                                cluster=cpu_cluster(world, 1e4), memory_budget=1e4,
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
                                    cluster=cpu_cluster(world, 1 << 30), memory_budget=1 << 30,
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


def test_auto_trains_bitwise_like_the_chosen_strategy():
    results = run_workers(auto_worker, 2, 3)
    assert results[0]["chosen"]["strategy"] in ("FULL_SHARD", "SHARD_GRAD_OP")
    for rank, r in enumerate(results):
        assert "no strategy fits" in r["error"] and "what would make it fit" in r["error"], rank
        # Every rank applies rank 0's plan, though rank 1 asked for NO_SHARD only.
        assert r["chosen"] == results[0]["chosen"] and r["best"] == results[0]["best"]
        assert (r["chosen"]["strategy"], r["chosen"]["prefetch"]) == (r["best"][0], r["best"][2])
        # One row per strategy and prefetch of rank 0's options (2 x 2, one bucket policy); the
        # budget fits SHARD_GRAD_OP whole, so no row of a mix of kept units joins them.
        assert r["rows"] == 4, r["rows"]
        assert r["losses"] and r["grads0"] and r["params"] and r["same_graphs"], (rank, r)
    logged = [m for m in results[0]["log"] if "strategy='auto' chose" in m]
    assert len(logged) == 1 and results[0]["chosen"]["strategy"] in logged[0]
    assert not any("strategy='auto' chose" in m for m in results[1]["log"])


def test_auto_options_are_checked():
    with pytest.raises(ValueError, match="strategy='auto' chooses the layout itself"):
        fsdp_compile.backend("auto", shard_size=2)
    with pytest.raises(ValueError, match="are for strategy='auto'"):
        fsdp_compile.backend("FULL_SHARD", example_inputs=(torch.zeros(2, 8),))
    with pytest.raises(ValueError, match="strategy='auto' chooses reshard_after_forward itself"):
        fsdp_compile.backend("auto", reshard_after_forward=False)


def test_auto_refuses_tensor_parallel_plan_options_by_name():
    # auto shards the model as given (1-D): a TP row would be applied as a 1-D strategy
    with pytest.raises(ValueError, match=r"plan_options: tp_degrees=\(1, 2\) asks strategy='auto' for tensor "
                                         r"parallelism.*parallelize_module"):
        fsdp_compile.backend("auto", plan_options={"tp_degrees": (1, 2)})
    with pytest.raises(ValueError, match="plan_options: parallelize_fn= asks strategy='auto' for tensor"):
        fsdp_compile.backend("auto", plan_options={"parallelize_fn": lambda model, mesh: model})
    fsdp_compile.backend("auto", plan_options={"tp_degrees": (1,)})  # no TP: what auto plans anyway
    # options auto sets itself, and options plan() does not take, are named too
    with pytest.raises(ValueError, match="plan_options: strategy='auto' sets world_size itself"):
        fsdp_compile.backend("auto", plan_options={"world_size": 8})
    with pytest.raises(ValueError, match="plan_options: prefetches is not an option of fsdp_compile.plan"):
        fsdp_compile.backend("auto", plan_options={"prefetches": (1,)})


def test_a_tp_row_is_never_applied_as_a_1d_strategy():
    from fsdp_compile.planning.auto import candidate_options
    from fsdp_compile.planning.plan import Plan, PlanRow

    row = PlanRow("FULL_SHARD", "module", 1, True, 1.0, {}, 1.0, 0.0, {}, tp=2)
    result = Plan(cpu_cluster(2, 1 << 30), 2, [row], row, "", 1 << 30, 1, bucket_policies={"module": "module"})
    with pytest.raises(PlanError, match=r"applies 1-D rows only, and the plan chose FULL_SHARD.*TP degree 2"):
        candidate_options(result, row)
    row.tp = 1
    assert candidate_options(result, row) == {"strategy": "FULL_SHARD", "bucket": "module", "prefetch": 1,
                                              "reshard_after_forward": None}


def measure_worker(rank: int, world: int) -> dict:
    cluster = Cluster.measure(sizes=(1 << 14, 1 << 16, 1 << 18), repeats=3, device_memory=1 << 30,
                              dtypes=(torch.float32,), host=HostCPU)  # bf16 calibrates alike, at twice the time
    return {
        "world": cluster.world_size, "flops": {str(k): v for k, v in cluster.peak_flops.items()},
        "attention_flops": {str(k): v for k, v in cluster.attention_flops.items()},
        "memory_bandwidth": cluster.memory_bandwidth, "op_overhead": cluster.host.op_overhead,
        "overlap": cluster.comm_overlap, "optimizer_step": cluster.optimizer_step,
        "workspace": cluster.collective_workspace, "runtime_per_tensor": cluster.runtime_per_tensor,
        "copy_kernels": cluster.host.copy_kernels, "collective_issue": cluster.host.collective_issue,
        "collective_cpu": cluster.host.collective_cpu, "compute_scale": cluster.host.compute_scale,
        "collectives": {k: (v.step_latency, v.bandwidth, v.group_size, len(v.samples))
                        for k, v in cluster.measured_collectives.items()},
        "sources": sorted(cluster.sources),
    }


# What a CPU can physically do, as ceilings for the calibrated rates: every core this process
# may run on at 6 GHz, each cycle two 16-lane fp32 FMAs (AVX-512's widest: 64 FLOPs) and two
# 64-byte loads and a store (192 bytes, L1 cache's rate, above any memory's). And a ceiling for
# the calibrated seconds of one call: an operator call, a small copy, a collective of 1 MiB on
# loopback or an optimizer step over one tensor takes microseconds to milliseconds (measured
# here: 2 us to 1 ms); a second is far above any of them on a loaded machine.
CORES = len(os.sched_getaffinity(0))
CPU_PEAK_FLOPS = CORES * 6e9 * 64
CPU_PEAK_BYTES = CORES * 6e9 * 192
CALL_CEILING_S = 1.0


def test_measure_calibrates_this_machine_on_every_rank_alike():
    results = run_workers(measure_worker, 2)
    assert results[0] == results[1]  # every rank gets the slowest rank's numbers
    r = results[0]
    assert r["world"] == 2
    assert 1e8 < r["flops"]["torch.float32"] <= CPU_PEAK_FLOPS, r["flops"]
    assert 1e8 < r["memory_bandwidth"] <= CPU_PEAK_BYTES, r["memory_bandwidth"]
    assert 0 < r["op_overhead"] < CALL_CEILING_S, r["op_overhead"]
    # two ranks on two cores (CI): gloo's threads take CPU from compute, priced as seconds per
    # collective; with a core to spare per rank they take none. A CPU hides nothing else.
    assert r["overlap"] == 1.0
    if len(os.sched_getaffinity(0)) <= 2:
        assert set(r["collective_cpu"]) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert all(0 < fixed + per_byte * (1 << 20) < CALL_CEILING_S for fixed, per_byte in r["collective_cpu"].values())
    else:
        assert r["collective_cpu"] == {}
    # a whole reference graph against its priced nodes: a residual near 1, not a rate
    assert 0.5 < r["compute_scale"] < 3.0 and "compute_scale" in r["sources"]
    # the runtime's own work per sharded parameter outside the graphs (to_local, gradient wrap)
    assert 0 < r["runtime_per_tensor"] < CALL_CEILING_S and "runtime_per_tensor" in r["sources"]
    # the backend's copies around each collective, as the real ops: every op has a cost per byte
    assert set(r["copy_kernels"]) == {"copy_in", "copy_out", "chunk_cat"} and "copy_kernels" in r["sources"]
    # (per byte: no slower than 1 MB/s, a thousandth of what memory copies run at on any CPU)
    assert all(0 <= per_param < CALL_CEILING_S and 1 / CPU_PEAK_BYTES <= per_byte < 1e-6
               for per_param, per_byte in r["copy_kernels"].values()), r["copy_kernels"]
    # starting a collective costs the issuing thread time on a CPU
    assert set(r["collective_issue"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(0 < fixed + per_byte * (1 << 18) < CALL_CEILING_S for fixed, per_byte in r["collective_issue"].values())
    assert set(r["collectives"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    # (a bandwidth is not bounded above: latency alone fits the small sizes, and the fit then
    # stores an effectively infinite one)
    for latency, bandwidth, group, samples in r["collectives"].values():
        assert 0 <= latency < CALL_CEILING_S and bandwidth > 0 and group == 2 and samples == 3
    assert "collectives" in r["sources"] and "peak_flops" in r["sources"]
    # fused attention's own rate, for every calibrated dtype
    assert set(r["attention_flops"]) == set(r["flops"])
    assert all(1e8 < rate <= CPU_PEAK_FLOPS for rate in r["attention_flops"].values()), r["attention_flops"]
    assert "attention_flops" in r["sources"]
    # a real optimizer step over DTensor shards: a cost per tensor and per byte, AdamW dearer than SGD
    assert set(r["optimizer_step"]) == {"adamw", "sgd"}
    assert CALL_CEILING_S > r["optimizer_step"]["adamw"][0] > r["optimizer_step"]["sgd"][0] > 0
    assert all(0 <= per_byte < 1e-6 for _, per_byte in r["optimizer_step"].values()), r["optimizer_step"]
    # what gloo allocates beside each collective's result, per byte of its buffer, by the
    # allocator: it gathers into a temporary of the output's size and reduce-scatters a copy of
    # the whole input; the all-reduce works in its result
    assert r["workspace"] == {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 0.0}


def test_auto_calibrates_a_cpu_for_the_dtypes_the_model_computes_in() -> None:
    """A CPU's bf16 calibration takes a minute: an fp32 model without mixed precision skips it."""
    from fsdp_compile.planning.auto import compute_dtypes

    assert compute_dtypes(torch.nn.Linear(2, 2), None) == (torch.float32,)
    bf16 = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    assert compute_dtypes(torch.nn.Linear(2, 2), bf16) == (torch.float32, torch.bfloat16)
