"""Bytes per step per rank: theory from parameter shapes = compiled graphs = a profiled step.

Bytes are collective buffer sizes per rank (all-gather output, reduce-scatter input,
all-reduce buffer), padding included; with ring algorithms a rank sends (N-1)/N of an
all-gather or reduce-scatter buffer and 2(N-1)/N of an all-reduce buffer. The theory is computed in the test from parameter shapes, the strategy and
the configured dtypes, without the implementation's helpers; the profiled step reads element
counts and dtypes of the collectives from torch's profiler (implementation-independent).
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_workers
from helpers import WORLD, hybrid_options
from torch import nn

import fsdp_compile
from fsdp_compile import ShardingStrategy


class AllNeeded(nn.Module):
    """Every parameter is needed by backward: no biases, and the input itself requires grad.

    Row counts (7, 3) do not divide 2 or 4, so every buffer carries padding.
    """

    def __init__(self, dim: int = 7, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim, bias=False), nn.LayerNorm(dim, bias=False)) for _ in range(depth))
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def theoretical_bytes(model: nn.Module, strategy: ShardingStrategy, shard: int, replicas: int,
                      compute: torch.dtype, reduce: torch.dtype) -> dict[str, int]:
    """Collective buffer bytes per rank per step that the strategy implies, from shapes alone
    (dim 0 padded up to a multiple of the shard group, as torch.chunk cuts it)."""
    padded = sum(-(-p.shape[0] // shard) * (p.numel() // p.shape[0]) for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    c, r = compute.itemsize, reduce.itemsize
    if strategy is ShardingStrategy.NO_SHARD:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": whole * r}
    gathers = 2 if strategy.reshard_after_forward else 1  # forward, and again in backward
    return {
        "all_gather": gathers * shard * padded * c,
        "reduce_scatter": shard * padded * r,
        "all_reduce": padded * r if replicas > 1 else 0,
    }


def bytes_worker(rank: int, world: int, strategy: str) -> dict:
    """Theory, compiled graphs and a profiled step, for fp32 and for bf16 compute / fp32 reduce."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_compile.inspection.graphinfo import collectives

    strategy = ShardingStrategy.parse(strategy)
    out = {}
    for label, mp in (("fp32", None), ("bf16", fsdp_compile.MixedPrecision(torch.bfloat16, torch.float32))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = AllNeeded()
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", mixed_precision=mp,
                                       **hybrid_options(strategy))
        full_model = copy.deepcopy(model)
        backend.shard(model)
        topo = backend.topology
        compute = mp.param_dtype if mp else torch.float32
        theory = theoretical_bytes(full_model, strategy, topo.shard_size, topo.replicate_size,
                                   compute, torch.float32)
        compiled = torch.compile(model, backend=backend)

        def step():
            x = torch.randn(4, 7, requires_grad=True)
            compiled(x).square().mean().backward()

        step()
        (record,) = backend.graphs
        graph = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        for c in collectives(record.forward) + collectives(record.backward):
            graph[c.kind] += c.buffer_bytes
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        # Element counts and dtypes as the profiler recorded the collectives' inputs; an
        # all-gather's buffer is its output, the input times the group size.
        profiled = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        itemsize = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}
        # The profiler's own events: torch 2.11's FunctionEvent has no input_dtypes.
        for event in prof.profiler.kineto_results.events():
            name = event.name()
            if name.startswith("_c10d_functional::") and "wait" not in name:
                kind = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                        "all_reduce": "all_reduce"}[name.split("::")[1]]
                numel = 1
                for d in event.shapes()[0]:
                    numel *= d
                profiled[kind] += numel * itemsize[event.dtypes()[0]] * (
                    topo.shard_size if kind == "all_gather" else 1)
        out[label] = {"theory": theory, "graph": graph, "profiled": profiled}
    return out


# The ZeRO-2 variants run with -m slow (they only drop the backward gathers).
@pytest.mark.parametrize("strategy", [
    s if s in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD") else pytest.param(s, marks=pytest.mark.slow)
    for s in WORLD])
def test_bytes_per_step_equal_the_theory(strategy: str) -> None:
    for rank, report in enumerate(run_workers(bytes_worker, WORLD[strategy], strategy)):
        for precision, r in report.items():
            assert r["graph"] == r["theory"], f"rank {rank} {precision}: graph {r['graph']} vs theory {r['theory']}"
            assert r["profiled"] == r["theory"], f"rank {rank} {precision}: profiled {r['profiled']}"
        # Measured: bf16 gathers move half the bytes of fp32 ones; reductions stay in fp32.
        fp32, bf16 = report["fp32"]["profiled"], report["bf16"]["profiled"]
        assert bf16["all_gather"] * 2 == fp32["all_gather"]
        assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
        assert bf16["all_reduce"] == fp32["all_reduce"]
