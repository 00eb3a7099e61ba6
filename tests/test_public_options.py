"""Public options of the training-loop helpers that the training-loop runs do not reach:
``clip_grad_norm_``'s other norm types and ``error_if_nonfinite``, ``shard(device=)`` and
``full_state_dict(cpu_offload=)``.

One 2-rank run (the eager runtime: nothing here depends on compiling) for a sharded strategy
(gradients sharded across ranks: the norm sums or maxes over the ranks) and NO_SHARD
(replicated gradients: the ranks' norms must not be combined again).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import TEST_CONFIG, batches, expect_error, full, lm_loss, local_slice
from torch import nn

import fsdp_compile
from fsdp_compile.models.gpt import GPT

MAX_NORM = 0.05  # below every norm of the test GPT's first gradients: each case clips
NORM_TYPES = (2.0, 1.0, math.inf)


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def clip_case(rank: int, world: int, strategy: str) -> dict:
    """Every norm type on the same first-step gradients: our norm and clipped gradients, and
    torch's clip_grad_norm_ on the whole gradients (the single-process reference)."""
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    fsdp_compile.backend(strategy).shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(model(x), y).backward()
    saved = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}

    def restore() -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad.to_local().copy_(saved[n])

    whole = _full_grads(model)
    out: dict[str, Any] = {}
    for norm_type in NORM_TYPES:
        restore()
        ours = fsdp_compile.clip_grad_norm_(model, MAX_NORM, norm_type=norm_type).item()
        reference = {n: g.clone() for n, g in whole.items()}
        params = [nn.Parameter(torch.empty_like(g)) for g in reference.values()]
        for p, g in zip(params, reference.values()):
            p.grad = g
        expected = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=norm_type).item()
        out[norm_type] = {"norm": ours, "expected": expected, "clipped": _full_grads(model),
                          "expected_clipped": {n: p.grad for n, p in zip(reference, params)}}
    if strategy != "NO_SHARD":
        # One rank's shard holds an infinite entry: the total is global, so every rank sees it.
        restore()
        if rank == world - 1:  # named_parameters(): the DTensor itself (a read would gather)
            with torch.no_grad():
                dict(model.named_parameters())["head.weight"].grad.to_local()[0, 0] = math.inf
        before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        out["nonfinite_error"] = expect_error(
            lambda: fsdp_compile.clip_grad_norm_(model, MAX_NORM, error_if_nonfinite=True))
        out["unchanged_after_error"] = all(torch.equal(before[n], p.grad.to_local())
                                           for n, p in model.named_parameters())
        out["nonfinite_norm"] = fsdp_compile.clip_grad_norm_(model, MAX_NORM).item()
    return out


def device_case(rank: int, world: int) -> dict:
    """shard(device=): a meta-device model materialized where device= says, and the argument
    checked against where the model's parameters are."""
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5))
    torch.manual_seed(3)
    fsdp_compile.backend("FULL_SHARD").shard(model, device=torch.device("cpu"))
    return {
        "devices": sorted({p.to_local().device.type for p in model.parameters()}),
        "equal": all(torch.equal(full(p), reference.get_parameter(n)) for n, p in model.named_parameters()),
        "mismatch": expect_error(lambda: fsdp_compile.backend("FULL_SHARD").shard(nn.Linear(2, 2), device="meta")),
    }


def options_worker(rank: int, world: int) -> dict:
    return {"FULL_SHARD": clip_case(rank, world, "FULL_SHARD"), "NO_SHARD": clip_case(rank, world, "NO_SHARD"),
            "device": device_case(rank, world)}


@functools.cache
def options_run() -> list[dict]:
    return run_workers(options_worker, 2)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=["2", "1", "inf"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_clip_grad_norm_of_every_norm_type_equals_torchs_on_the_whole_gradients(strategy: str,
                                                                                norm_type: float) -> None:
    for rank, out in enumerate(options_run()):
        case = out[strategy][norm_type]
        # The max norm is exact; sums differ by their order only. A norm taken over this
        # rank's shards alone, or over replicas counted twice, is off by far more.
        assert case["norm"] == pytest.approx(case["expected"], rel=0 if math.isinf(norm_type) else 1e-5), rank
        assert case["norm"] > MAX_NORM
        for name, grad in case["clipped"].items():
            torch.testing.assert_close(grad, case["expected_clipped"][name], rtol=1e-5, atol=1e-8,
                                       msg=f"rank {rank} {name}")


def test_error_if_nonfinite_raises_on_every_rank_and_leaves_the_gradients() -> None:
    for out in options_run():
        case = out["FULL_SHARD"]
        assert case["nonfinite_error"] == ("RuntimeError: the total norm of order 2.0 of the gradients is inf; "
                                           "pass error_if_nonfinite=False to clip anyway")
        assert case["unchanged_after_error"]
        assert math.isinf(case["nonfinite_norm"])  # without the flag it clips anyway, as torch's


def test_shard_materializes_a_meta_model_on_the_given_device() -> None:
    for out in options_run():
        case = out["device"]
        assert case["devices"] == ["cpu"] and case["equal"]
        assert case["mismatch"] == ("ValueError: the model's parameters are on several device types "
                                    "['cpu', 'meta']; move the model to one device before sharding")


def test_full_state_dict_cpu_offload_chooses_where_the_copies_live() -> None:
    # A device other than the host, as fake CUDA tensors (no CUDA needed to place them).
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Linear(4, 3)
    with FakeTensorMode() as mode:
        weight, bias = torch.empty(3, 4, device="cuda"), torch.empty(3, device="cuda")
    model.weight, model.bias = nn.Parameter(weight), nn.Parameter(bias)
    with mode:
        on_host = fsdp_compile.full_state_dict(model)
        kept = fsdp_compile.full_state_dict(model, cpu_offload=False)
    assert {v.device.type for v in on_host.values()} == {"cpu"}
    assert {v.device.type for v in kept.values()} == {"cuda"}
    assert kept["weight"] is not weight  # a copy, not the model's own tensor
