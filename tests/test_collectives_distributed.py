"""The collective semantics at world 4 (2 shard groups x 2 replicas), run for real on gloo."""

from __future__ import annotations

import torch
from distributed import run_workers
from workers import collectives_worker


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
