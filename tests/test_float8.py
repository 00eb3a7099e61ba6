"""Float8 training with torchao's ``Float8Linear``: float8 all-gathers, numerics, and FULL_SHARD.

A weight of a ``Float8Linear`` with ``enable_fsdp_float8_all_gather=True`` is gathered as float8
bytes with one float32 scale per weight (one all-reduce of the bucket's amaxes), and handed to
``Float8Linear`` in the compute dtype. Under bf16 mixed precision that changes the bytes, not the
numbers: ``Float8Linear`` recasts the gathered weight to the float8 values and scale it would
compute from a bf16 gather, so training is bitwise that of the same model gathering bf16
(``enable_fsdp_float8_all_gather=False``). FSDP2 casts the float32 shard instead, so it agrees
within float8 rounding (see ``FSDP2_LOSS_RTOL``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import assert_bitwise, assert_grads_close, compiled_regions, fsdp2_model, full, hybrid_options
from torch import nn

import fsdp_compile
from fsdp_compile import MixedPrecision, ShardingStrategy
from fsdp_compile.inspection.graphinfo import collectives

WIDTH = 32
BATCH_PER_RANK = 4
STEPS = 2
LR = 0.05
# Under bf16 mixed precision FSDP2 scales the float32 shard by the float32 amax; this gather (as
# Float8Linear after a bf16 gather) the bf16 weight by the bf16 amax. Scales that differ by up
# to bf16's rounding move weights to neighbouring float8 values, 6% apart: measured, losses
# differ by 0.1% and gradients by up to 18% of their norm (FSDP2 differs from its own bf16
# gather as much).
FSDP2_LOSS_RTOL = 1e-2
# Against one process: the same operations, summed in another order.
FP32_RTOL = 1e-5


class Block(nn.Module):
    """A pre-norm MLP block. The norm also makes FSDP2 gather the block as bytes: gloo has no
    float8 all-gather, which FSDP2 issues for a group of float8 weights alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Float8Net(nn.Module):
    """Three blocks (one region class under the default compiler), a norm and a head; every
    linear a torchao ``Float8Linear`` (the norm gathers as before)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def float8_net(float8_all_gather: bool = True) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Float8Net()
    # emulate: float8 matmuls as dequantized matmuls, which the CPU runs.
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather, emulate=True)
    return convert_to_float8_training(model, config=config)


def global_batch(world: int) -> torch.Tensor:
    return torch.randn(world * BATCH_PER_RANK, WIDTH, generator=torch.Generator().manual_seed(1))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def train(model: nn.Module, forward, batch: torch.Tensor) -> dict:
    """``STEPS`` SGD steps on ``batch``: the losses and the first step's gradients (whole)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = loss_of(forward(batch))
        loss.backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "grads": grads}


def gather_facts(backend: fsdp_compile.FSDPBackend) -> dict:
    """Each graph's all-gathers (dtype and buffer bytes) and amax all-reduces, forward and backward."""
    facts: dict[str, list] = {"forward": [], "backward": []}
    for record in backend.graphs:
        for phase in facts:
            graph = getattr(record, phase)
            for c in collectives(graph):
                if c.kind in ("all_gather", "all_reduce"):
                    facts[phase].append((c.kind, str(c.dtype).removeprefix("torch."), c.buffer_bytes))
    return facts


def ours(base: nn.Module, strategy: str, mode: str, mp: bool, batch: torch.Tensor) -> dict:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    options: dict[str, Any] = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if mp else {}
    compiler = "aot_eager" if mode == "eager" else mode
    backend = fsdp_compile.backend(strategy, compiler=compiler, strict=True, **options, **hybrid_options(strategy))
    backend.shard(model)
    forward = model
    if mode != "eager":
        forward = torch.compile(model, backend=backend)
    out = train(model, forward, batch)
    if mode == "eager":
        out["eager_float8_gathers"] = eager_float8_gathers(lambda: loss_of(forward(batch)).backward())
    else:
        out["gathers"] = gather_facts(backend)
        out["regions"] = compiled_regions(backend)
    return out


def eager_float8_gathers(step) -> dict:
    """The bucket gathers ``step()`` ran as float8 in the eager runtime (the one definition every
    gather goes through, wrapped for the step), and per weight they gathered: how far it is from
    torchao's own float8 round trip of the same weight gathered in the compute dtype (0: the
    values ``Float8Linear`` would compute from that weight), and whether it differs from that
    weight at all (the float8 rounding, which a bf16 gather under a float8 label would skip)."""
    import dataclasses

    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    from fsdp_compile.runtime import collectives as runtime

    calls, weights = [], []
    original = runtime._gather_float8

    def checked(shards, full_shapes, chunks, dtype, spec):
        gathered = original(shards, full_shapes, chunks, dtype, spec)
        calls.append(len(gathered))
        # The same shards through the gather of the compute dtype: every rank runs it, in step.
        plain = runtime.gather_params(shards, full_shapes, dataclasses.replace(spec, float8=None))
        for ours, weight in zip(gathered, plain):
            expected = hp_tensor_to_float8_dynamic(
                weight, spec.float8, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT,
                round_scales_to_power_of_2=spec.float8_pow2_scale).to_original_precision()
            weights.append({"shape": tuple(weight.shape), "dtype": ours.dtype,
                            "off_torchao": (ours.float() - expected.float()).abs().max().item(),
                            "rounded": not torch.equal(ours, weight)})
        return gathered

    runtime._gather_float8 = checked
    try:
        step()
    finally:
        runtime._gather_float8 = original
    return {"buckets": len(calls), "weights": weights}


def fsdp2(base: nn.Module, strategy: str, world: int, mp: bool, batch: torch.Tensor) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    model = fsdp2_model(copy.deepcopy(base), ShardingStrategy.parse(strategy), world, policy)
    return train(model, model, batch)


def accumulated(base: nn.Module, batch: torch.Tensor, world: int) -> dict:
    """Single-process float8 training on each rank's micro-batch in turn, gradients averaged:
    data parallelism's arithmetic. (On the whole batch at once, Float8Linear would scale each
    activation by its amax over all ranks' rows instead of each rank's own.)"""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        for micro in batch.chunk(world):
            (loss_of(model(micro)) / world).backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"grads": grads}


def float8_worker(rank: int, world: int, cases: list[tuple[str, str]], mp: bool) -> dict:
    """Each (strategy, mode) case trains the float8-gathering model and the same model
    gathering in the compute dtype; FSDP2 trains both per strategy."""
    batch = global_batch(world)
    local = batch[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    float8, plain = float8_net(True), float8_net(False)
    out: dict[str, Any] = {}
    for strategy, mode in cases:
        out[f"{strategy}/{mode}"] = {"float8": ours(float8, strategy, mode, mp, local),
                                     "plain": ours(plain, strategy, mode, mp, local)}
    for strategy in dict.fromkeys(s for s, _ in cases):
        out[f"{strategy}/fsdp2"] = {"float8": fsdp2(float8, strategy, world, mp, local),
                                    "plain": fsdp2(plain, strategy, world, mp, local)}
    out["accumulated"] = accumulated(float8, batch, world)
    return out


@functools.cache
def float8_run(world: int, cases: tuple[tuple[str, str], ...], mp: bool) -> dict:
    return run_workers(float8_worker, world, list(cases), mp)[0]


def _slow_unless(default: bool) -> tuple:
    return () if default else (pytest.mark.slow,)


# The default run: FULL_SHARD in the eager runtime and under both compilers (one job at world
# 2); -m slow adds every other strategy in every mode, the hybrid ones at 2 x 2 (float8 is an
# option of the model, not a default: the default run keeps to one job, about 20 s).
WORLD2_DEFAULT = (("FULL_SHARD", "eager"), ("FULL_SHARD", "aot_eager"), ("FULL_SHARD", "inductor"))
WORLD2_SLOW = (("SHARD_GRAD_OP", "eager"), ("SHARD_GRAD_OP", "aot_eager"), ("SHARD_GRAD_OP", "inductor"),
               ("NO_SHARD", "eager"), ("NO_SHARD", "aot_eager"), ("NO_SHARD", "inductor"))
WORLD4_DEFAULT: tuple[tuple[str, str], ...] = ()
WORLD4_SLOW = (("HYBRID_SHARD", "eager"), ("HYBRID_SHARD", "aot_eager"), ("HYBRID_SHARD", "inductor"),
               ("HYBRID_SHARD_ZERO2", "eager"), ("HYBRID_SHARD_ZERO2", "aot_eager"),
               ("HYBRID_SHARD_ZERO2", "inductor"))
# Without mixed precision (float32 weights): the comparisons with FSDP2 and one process.
FLOAT32 = (("FULL_SHARD", "eager"),)


def run_of(strategy: str, mode: str, mp: bool = True) -> tuple[dict, dict]:
    """(the case's results, the whole job's) from the job that holds it."""
    jobs = ((2, WORLD2_DEFAULT), (2, WORLD2_SLOW), (4, WORLD4_DEFAULT), (4, WORLD4_SLOW)) if mp else ((2, FLOAT32),)
    for world, cases in jobs:
        if (strategy, mode) in cases:
            job = float8_run(world, cases, mp)
            return job[f"{strategy}/{mode}"], job
    raise KeyError((strategy, mode, mp))


CASES = [pytest.param(s, m, marks=_slow_unless(default), id=f"{s}-{m}")
         for cases, default in ((WORLD2_DEFAULT, True), (WORLD4_DEFAULT, True), (WORLD2_SLOW, False),
                                (WORLD4_SLOW, False))
         for s, m in cases]


@pytest.mark.parametrize("strategy,mode", CASES)
def test_float8_gathers_train_bitwise_like_compute_dtype_gathers(strategy: str, mode: str) -> None:
    """Under bf16 mixed precision a float8 gather changes the bytes, not the numbers: losses and
    gradients are those of the same model gathering bf16, and of FSDP2 gathering bf16."""
    case, job = run_of(strategy, mode)
    assert_bitwise(case["float8"]["grads"], case["plain"]["grads"], "float8-gathered against bf16-gathered")
    assert [float(x) for x in case["float8"]["losses"]] == [float(x) for x in case["plain"]["losses"]]
    if mode != "inductor":  # Inductor fuses the elementwise work FSDP2 runs op by op
        assert_bitwise(case["float8"]["grads"], job[f"{strategy}/fsdp2"]["plain"]["grads"],
                       "float8-gathered against FSDP2 gathering bf16")
    # FSDP2 with the same torchao config casts the float32 shard: within float8 rounding.
    ours_losses = torch.stack(case["float8"]["losses"])
    theirs = torch.stack(job[f"{strategy}/fsdp2"]["float8"]["losses"])
    assert torch.allclose(ours_losses, theirs, rtol=FSDP2_LOSS_RTOL, atol=0), (ours_losses, theirs)


@pytest.mark.parametrize("strategy,mode", CASES)
def test_float8_weights_gather_one_byte_per_element(strategy: str, mode: str) -> None:
    """Each float8 bucket is one all-reduce of its weights' amaxes (4 bytes each) and one
    all-gather of uint8 half the size of the bf16 one; NO_SHARD gathers nothing."""
    case, _ = run_of(strategy, mode)
    if mode == "eager":
        # The eager runtime gathers each float8 bucket it reads as float8, and nothing else:
        # each block's two linears and the root's head, once a step (it keeps what it
        # gathered for backward).
        gathers = case["float8"]["eager_float8_gathers"]
        assert case["plain"]["eager_float8_gathers"] == {"buckets": 0, "weights": []}
        if strategy == "NO_SHARD":
            assert gathers == {"buckets": 0, "weights": []}, gathers
            return
        weights = gathers["weights"]
        assert gathers["buckets"] == 4, gathers
        assert sorted(w["shape"] for w in weights) == sorted([(2 * WIDTH, WIDTH), (WIDTH, 2 * WIDTH)] * 3
                                                             + [(16, WIDTH)]), weights
        # Weight by weight: the values torchao's cast of the bf16 weight gives, bit for bit, and
        # not the bf16 weight itself (float8 keeps 3 bits of mantissa where bf16 keeps 7).
        for weight in weights:
            assert weight["dtype"] == torch.bfloat16 and weight["off_torchao"] == 0 and weight["rounded"], weight
        return
    for phase in ("forward", "backward"):
        float8, plain = case["float8"]["gathers"][phase], case["plain"]["gathers"][phase]
        bytes_float8 = sum(b for kind, dtype, b in float8 if kind == "all_gather")
        bytes_plain = sum(b for kind, dtype, b in plain if kind == "all_gather")
        keeps = ShardingStrategy.parse(strategy).reshard_after_forward is False
        if strategy == "NO_SHARD" or (phase == "backward" and keeps):  # nothing to gather there
            assert bytes_float8 == bytes_plain == 0, (phase, float8, plain)
            continue
        byte_gathers = [b for kind, dtype, b in float8 if kind == "all_gather" and dtype == "uint8"]
        # The hybrid strategies' gradient all-reduces are in both: the rest reduce amaxes.
        amax_reduces = sum(kind == "all_reduce" for kind, _, _ in float8) - sum(kind == "all_reduce" for kind, _, _ in plain)
        assert byte_gathers and amax_reduces == len(byte_gathers), (phase, float8)
        # Every linear is float8: the bf16 bytes less half the linear weights' bf16 bytes.
        linear_bf16 = 2 * sum(byte_gathers)
        assert bytes_float8 == bytes_plain - linear_bf16 // 2, (phase, float8, plain)


def test_full_shard_regathers_every_float8_unit_in_backward_under_the_default_compiler() -> None:
    """Under Inductor with regions a block's body computes the float8 cast of each gathered
    weight, which the partitioner would save for backward instead of gathering again: FULL_SHARD
    would keep a float8 copy of every block from forward to backward."""
    case, _ = run_of("FULL_SHARD", "inductor")
    assert case["float8"]["regions"][0] > 0, "the default compiler compiled no region"
    gathers = case["float8"]["gathers"]
    forward = [b for kind, dtype, b in gathers["forward"] if kind == "all_gather" and dtype == "uint8"]
    backward = [b for kind, dtype, b in gathers["backward"] if kind == "all_gather" and dtype == "uint8"]
    assert sorted(backward) == sorted(forward), gathers


def test_float8_matches_fsdp2_float8_all_gather() -> None:
    """Against FSDP2 with the same torchao config. In float32 both cast the float32 shard:
    bitwise (the eager runtime). Under bf16 mixed precision FSDP2 casts the float32 shard with
    the float32 amax, where Float8Linear after a bf16 gather (and so this gather) casts the
    bf16 weight with its bf16 amax: the float8 values differ by rounding, so only the losses
    are compared, within ``FSDP2_LOSS_RTOL``."""
    fp32_case, fp32_job = run_of("FULL_SHARD", "eager", mp=False)
    assert_bitwise(fp32_case["float8"]["grads"], fp32_job["FULL_SHARD/fsdp2"]["float8"]["grads"],
                   "float32: against FSDP2 with float8 all-gather")
    case, job = run_of("FULL_SHARD", "eager")
    ours_losses = torch.stack(case["float8"]["losses"])
    theirs = torch.stack(job["FULL_SHARD/fsdp2"]["float8"]["losses"])
    assert torch.allclose(ours_losses, theirs, rtol=FSDP2_LOSS_RTOL, atol=0), (ours_losses, theirs)


def test_float8_matches_single_process_float8_training() -> None:
    """Against torchao's float8 training in one process over the same per-rank micro-batches
    (gradients averaged): equal up to the order of the sums (float32)."""
    case, job = run_of("FULL_SHARD", "eager", mp=False)
    assert_grads_close(case["float8"]["grads"], job["accumulated"]["grads"], rtol=FP32_RTOL,
                       what="float8 FULL_SHARD against single-process float8")


# ---------------------------------------------------------------- the planner
def _planned(cluster_name: str, float8: bool):
    from fsdp_compile.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # large enough that matmuls, not casts, set the step
        model = GPT(GPTConfig(vocab_size=256, block_size=2048, n_layer=2, n_head=32, d_model=4096))
    tokens = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    return fsdp_compile.plan(model, (tokens,), cluster=fsdp_compile.Cluster.preset(cluster_name),
                             strategies=["FULL_SHARD"], prefetch=(1,), float8=float8,
                             loss_fn=lambda logits: logits.float().logsumexp(-1).mean(),
                             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)).best


def test_plan_prices_float8_gathers_by_bytes_and_matmuls_at_the_float8_peak() -> None:
    bf16, float8 = _planned("h100-sxm", False), _planned("h100-sxm", True)
    # The linears' gathers move half the bytes (reductions, embeddings, norms and head do not).
    assert float8.bytes_per_step["intra"] < 0.75 * bf16.bytes_per_step["intra"], (float8.bytes_per_step,
                                                                                 bf16.bytes_per_step)
    # Float8 matmuls at 1,979 TFLOPS against 989, less the casts torchao adds.
    assert float8.compute_seconds < 0.95 * bf16.compute_seconds, (float8.compute_seconds, bf16.compute_seconds)


def test_plan_refuses_float8_on_a_gpu_without_float8_tensor_cores() -> None:
    from fsdp_compile.planning.cluster import ClusterError

    with pytest.raises(ClusterError, match=r"float8.*tensor cores"):
        _planned("a100-80gb", True)


def test_a_float8_cast_is_priced_as_inductors_two_kernels() -> None:
    """torchao's cast (amax; scale, saturate, round) is one reduction and one elementwise pass."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    from fsdp_compile.planning.cost import float8_cast_kernels, graph_costs

    def cast(x):
        scale = amax_to_scale(torch.max(torch.abs(x)), torch.float8_e4m3fn)
        return to_fp8_saturated(x.to(torch.float32) * scale, torch.float8_e4m3fn)

    gm = make_fx(cast, tracing_mode="fake")(torch.randn(256, 512, dtype=torch.bfloat16))
    kernels = {n: reads for n, reads in float8_cast_kernels(gm.graph).items() if reads}
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert sorted(n.target.__name__ for n in kernels) == ["_to_copy.default", "max.default"]
    assert all(reads == [x] for reads in kernels.values())
    priced = sum(c.bytes for _, c in graph_costs(gm, fsdp_compile.Cluster.preset("h100-sxm")) if c.kind == "compute")
    x_bytes = 256 * 512 * 2
    # two reads of x, one float8 write, and the scale's scalars (a few bytes each)
    assert 2 * x_bytes + x_bytes // 2 <= priced < 2 * x_bytes + x_bytes // 2 + 256


def test_float8_without_torchao_names_the_extra(monkeypatch) -> None:
    import sys

    from fsdp_compile.planning.float8_plan import float8_training_model

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'plan\(float8=True\) needs torchao.*pip install -e "\.\[float8\]"'):
        float8_training_model(nn.Linear(16, 16), fsdp_compile.Cluster.preset("h100-sxm"))
