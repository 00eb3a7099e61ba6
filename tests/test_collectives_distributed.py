"""The collective semantics at world 4 (2 shard groups x 2 replicas), run for real on gloo."""

from __future__ import annotations

from typing import Any

import torch
from distributed import run_workers

from fsdp_compile import ShardingStrategy


def collectives_worker(rank: int, world: int) -> dict:
    """Run the collective semantics eagerly on a hybrid layout, logging the collectives issued."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_compile.runtime.collectives import (
        CommSpec,
        gather_params,
        reduce_grads,
        shard_bounds,
    )
    from fsdp_compile.sharding.groups import resolve_topology

    topo = resolve_topology(ShardingStrategy.HYBRID_SHARD, "cpu", shard_size=2)

    class LogCollectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default":
                group = args[-1]
                label = {topo.shard_group_name: "shard", topo.replicate_group_name: "replicate"}[group]
                self.calls.append((func.__name__.split(".")[0], label))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen), torch.randn(1, 2, generator=gen)]
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        spec = CommSpec(topo.shard_group_name, 2, True, topo.replicate_group_name, 2, None, dtype, True)
        shards = []
        for f in fulls:
            start, length = shard_bounds(f.shape[0], 2, topo.shard_rank)
            shards.append(f[start:start + length])
        gathered = gather_params(shards, [f.shape for f in fulls], spec)
        # Rank r contributes (r + 1) * full: the average over 4 ranks is 2.5 * full.
        grads = [f * (rank + 1) for f in fulls]
        with LogCollectives() as log:
            reduced = reduce_grads(grads, [s.shape[0] for s in shards], [torch.float32] * 3, spec)
        out[str(dtype)] = {
            "gathered_ok": all(torch.equal(g, f) for g, f in zip(gathered, fulls)),
            "reduced": reduced,
            "expected": [(s * 2.5) for s in shards],
            "calls": log.calls,
            "out_dtypes": [r.dtype for r in reduced],
        }
    return out


def test_hybrid_gather_and_reduction() -> None:
    for rank, report in enumerate(run_workers(collectives_worker, 4)):
        for dtype, r in report.items():
            assert r["gathered_ok"], f"rank {rank} {dtype}: gathered parameters differ"
            # One reduce-scatter inside the shard group, then one all-reduce across replicas.
            assert r["calls"] == [("reduce_scatter_tensor", "shard"), ("all_reduce", "replicate")], r["calls"]
            assert r["out_dtypes"] == [torch.float32] * 3  # gradients come back in the parameter dtype
            tol = {"torch.float32": 1e-6, "torch.bfloat16": 2e-2, "torch.float16": 4e-3}[dtype]
            for got, want in zip(r["reduced"], r["expected"]):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
