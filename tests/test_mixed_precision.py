"""Mixed precision (bf16 compute, fp32 reduction): placement of casts, dtypes, parity."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import (
    LR,
    TEST_CONFIG,
    WORLD,
    assert_bitwise,
    batches,
    fsdp2_model,
    hybrid_options,
    lm_loss,
    local_slice,
    train,
)
from torch import nn

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT

STEPS = 5
# FULL_SHARD runs by default; every other strategy (each with Inductor) with -m slow.
MP_STRATEGIES = ["FULL_SHARD"] + [pytest.param(s, marks=pytest.mark.slow)
                                  for s in ("SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")]
# bf16 against fp32 training, first-step gradients, ||a - b|| / ||b|| over all of them:
# observed 5.8e-3 (bf16's 8-bit mantissa); fp32 runs of different reduction order are ~1e-7
# apart. A run computing in fp32 by mistake would sit far below this.
BF16_GAP = 1e-3
# Parameters after 5 AdamW steps: Inductor against eager bf16 (see below), and bf16 against
# fp32 training; observed 2.3e-3 and 1.9e-3.
PARAM_RTOL = 1e-2
# Per tensor, first-step gradients: ||a - b|| / ||b|| of each tensor, bf16 against fp32 training
# and Inductor's bf16 against FSDP2's. bf16 rounds to 2^-8 (0.39%) relative; a gradient that is a
# few bf16 roundings away from another sits a few of those away: observed <= 1.2e-2 (3 units,
# blocks.0.ln1.weight) over every tensor and mode. 2^-5 is 8 units; a tensor reduced or cast
# wrongly on its own (a 10% error in pos_emb's gradient moves the pooled norm by 3%) lands
# outside.
GRAD_TENSOR_RTOL = 2 ** -5
# Per tensor, parameters after 5 AdamW steps, relative to the tensor's initial norm: observed
# <= 5.9e-3 (blocks.1.attn.qkv.weight, eager against fp32). A tensor initialized to zero (the
# biases) holds only AdamW's lr-sized steps, whose direction bf16 rounding decides where the
# gradient is near zero (the key bias's is zero in exact arithmetic): observed 0.7 of its own
# norm. Those are compared against the model's largest initial norm (observed <= 2.9e-3).
PARAM_TENSOR_RTOL = 2e-2
# Expected (kind, dtype) pairs of every collective, per strategy, for reduce_dtype fp32 / unset.
BF16, FP32 = "torch.bfloat16", "torch.float32"


def expected_collectives(strategy: str, reduce: str) -> list[tuple[str, str]]:
    if strategy == "NO_SHARD":
        return [("all_reduce", reduce)]
    pairs = [("all_gather", BF16), ("reduce_scatter", reduce)]
    if strategy.startswith("HYBRID"):
        pairs.append(("all_reduce", reduce))  # across replicas, in the reduce dtype too
    return sorted(pairs)


# Matmul-like ops and how many leading arguments are the operands they multiply (the CPU
# attention backward also takes its fp32 logsumexp, which is not an operand).
MATMULS = {torch.ops.aten.mm.default: 2, torch.ops.aten.addmm.default: 3, torch.ops.aten.bmm.default: 2,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 5}


def mixed_precision_worker(rank: int, world: int, strategy: str, modes: list[str], steps: int) -> dict:
    """bf16 compute with fp32 reduction: every mode, FSDP2 with the same policy, fp32 reference.

    Modes ending in ``_default`` leave reduce_dtype unset (it defaults to param_dtype, bf16), for
    us and for FSDP2 alike."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in modes:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        kind = mode.removesuffix("_default")
        reduce_dtype = None if mode.endswith("_default") else torch.float32
        if kind == "fsdp2":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            forward = fsdp2_model(model, strategy, world, mp)
        else:
            policy = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            compiler = "aot_eager" if kind == "eager" else kind
            backend = fsdp_compile.backend(strategy, compiler=compiler, mixed_precision=policy,
                                           **hybrid_options(strategy))
            backend.shard(model)
            forward = model if kind == "eager" else torch.compile(model, backend=backend)
        result = train(model, forward, data, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = (local_slice(t, rank) for t in data[0])
        logits = forward(x)
        lm_loss(logits, y).backward()
        opt.step()
        result["dtypes"] = {
            "logits": logits.dtype,
            "shards": {p.dtype for p in model.parameters()},
            "grads": {p.grad.dtype for p in model.parameters()},
            "optimizer_state": {v.dtype for s in opt.state.values() for v in s.values() if v.dim()},
        }
        if kind not in ("eager", "fsdp2"):
            from fsdp_compile.inspection.graphinfo import collectives

            (record,) = backend.graphs
            result["fallbacks"] = record.fallbacks
            # Every (kind, dtype) pair: one kind may run in several dtypes.
            result["collective_dtypes"] = sorted(
                {(c.kind, str(c.dtype)) for c in collectives(record.forward) + collectives(record.backward)})
            # The dtypes the matmuls of the graphs handed to the inner compiler multiply.
            result["matmul_dtypes"] = sorted({
                str(a.meta["val"].dtype) for g in (record.forward, record.backward) for n in g.graph.nodes
                if n.op == "call_function" and n.target in MATMULS
                for a in n.args[:MATMULS[n.target]] if isinstance(a, torch.fx.Node)})
        out[mode] = result
    if rank == 0:
        out["initial"] = {n: p.detach().clone() for n, p in base.named_parameters()}
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out if rank == 0 else {}


@functools.cache
def mp_run(strategy: str) -> dict:
    modes = ["eager", "aot_eager", "inductor", "fsdp2", "aot_eager_default", "fsdp2_default"]
    return run_workers(mixed_precision_worker, WORLD[strategy], strategy, modes, STEPS)[0]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together."""
    num = sum(((a[n] - b[n]).double() ** 2).sum() for n in b)
    den = sum((b[n].double() ** 2).sum() for n in b)
    return float((num / den).sqrt())


def worst_tensor(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                 scales: dict[str, float] | None = None) -> tuple[float, str]:
    """The largest ||a - b|| / scale over single tensors (scale: ||b|| of the tensor unless given),
    with its name: a pooled norm lets one wrong small tensor hide behind the large ones."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    if scales is None:
        scales = {n: float(v.double().norm()) for n, v in b.items()}
    return max((float((a[n].double() - b[n].double()).norm()) / scales[n], n) for n in b)


def assert_grads_within_bf16(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    rel, name = worst_tensor(a, b)
    assert rel <= GRAD_TENSOR_RTOL, f"{what}: first-step gradient of {name} is {rel:.2e} of its norm away"


def assert_params_within_bf16(out: dict, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    initial = {n: float(v.double().norm()) for n, v in out["initial"].items()}
    largest = max(initial.values())
    scales = {n: norm if norm > 0 else largest for n, norm in initial.items()}
    rel, name = worst_tensor(a, b, scales)
    assert rel <= PARAM_TENSOR_RTOL, f"{what}: parameter {name} after {STEPS} steps is {rel:.2e} of its scale away"


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_shards_gradients_and_optimizer_state_stay_fp32(strategy: str) -> None:
    for mode in ("eager", "aot_eager", "inductor", "aot_eager_default"):
        dtypes = mp_run(strategy)[mode]["dtypes"]
        assert dtypes["logits"] == torch.bfloat16  # computed in bf16, no output_dtype
        assert dtypes["shards"] == dtypes["grads"] == dtypes["optimizer_state"] == {torch.float32}


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_gathers_move_bf16_and_reductions_run_in_the_reduce_dtype(strategy: str) -> None:
    # Every (kind, dtype) pair the graphs hold: a stray fp32 gather or bf16 reduction shows up.
    out = mp_run(strategy)
    for mode in ("aot_eager", "inductor", "aot_eager_default"):
        assert out[mode]["fallbacks"] == [], mode  # every pass ran: the graphs were lowered
    for mode in ("aot_eager", "inductor"):
        assert out[mode]["collective_dtypes"] == expected_collectives(strategy, FP32), mode
    # reduce_dtype left unset defaults to param_dtype: reductions in bf16, as FSDP2's default.
    assert out["aot_eager_default"]["collective_dtypes"] == expected_collectives(strategy, BF16)


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_computes_in_bf16_exactly_as_fsdp2(strategy: str) -> None:
    out = mp_run(strategy)
    ref = out["reference"]  # fp32 single-process training
    for ours, theirs in (("eager", "fsdp2"), ("aot_eager", "fsdp2"), ("aot_eager_default", "fsdp2_default")):
        # Far from fp32 training: the compute really is bf16 ...
        assert relative_difference(out[ours]["grads0"], ref["grads0"]) > BF16_GAP, ours
        # ... and it is FSDP2's bf16, bit for bit: same casts, same reduction dtype. (FSDP2
        # casts each unit's inputs, we cast the root's: in this model every unit's input is
        # already bf16, so the math is the same.)
        assert_bitwise(out[ours]["grads0"], out[theirs]["grads0"], f"{ours} vs {theirs} first-step gradients")
        assert_bitwise(out[ours]["params"], out[theirs]["params"], f"{ours} vs {theirs} parameters")
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "eager vs aot_eager")
    # The reduce dtype matters: fp32 and bf16 reductions of the same bf16 gradients differ.
    assert not all(torch.equal(out["aot_eager"]["grads0"][n], out["aot_eager_default"]["grads0"][n])
                   for n in out["aot_eager"]["grads0"])


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_inductor_computes_in_bf16(strategy: str) -> None:
    """Inductor keeps fused bf16 pointwise chains in fp32 and rounds once where eager rounds
    after every op, so its bf16 results are as far from eager bf16 (6.3e-3) as bf16 is from
    fp32: no tolerance separates them. What shows bf16 compute under Inductor: the graphs it
    compiles multiply bf16 tensors, its gradients are as far from fp32 training as bf16 ones
    are, and after 5 steps the model agrees with FSDP2's bf16 training as a whole."""
    out = mp_run(strategy)
    assert out["inductor"]["matmul_dtypes"] == [BF16]
    assert out["aot_eager"]["matmul_dtypes"] == [BF16]
    assert relative_difference(out["inductor"]["grads0"], out["reference"]["grads0"]) > BF16_GAP
    assert relative_difference(out["inductor"]["params"], out["fsdp2"]["params"]) <= PARAM_RTOL
    # Tensor by tensor: each gradient within bf16 rounding of FSDP2's bf16 one and of fp32
    # training's, each parameter close to FSDP2's after 5 steps.
    assert_grads_within_bf16(out["inductor"]["grads0"], out["fsdp2"]["grads0"], "inductor vs fsdp2")
    assert_grads_within_bf16(out["inductor"]["grads0"], out["reference"]["grads0"], "inductor vs fp32")
    assert_params_within_bf16(out, out["inductor"]["params"], out["fsdp2"]["params"], "inductor vs fsdp2")


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_bf16_training_follows_fp32_training(strategy: str) -> None:
    out = mp_run(strategy)
    ref = out["reference"]["losses"]
    for mode in ("eager", "aot_eager", "inductor"):
        losses = out[mode]["losses"]
        # bf16 has 8 bits of mantissa: per-step losses agree to about 1%.
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, ref)), (mode, losses, ref)
        assert relative_difference(out[mode]["params"], out["reference"]["params"]) <= PARAM_RTOL
        assert_grads_within_bf16(out[mode]["grads0"], out["reference"]["grads0"], f"{mode} vs fp32")
        assert_params_within_bf16(out, out[mode]["params"], out["reference"]["params"], f"{mode} vs fp32")


def test_policy_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int8\) cannot be communicated"):
        fsdp_compile.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float8_e4m3fn"):
        fsdp_compile.MixedPrecision(reduce_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"output_dtype=torch.int32\) must be a floating-point dtype"):
        fsdp_compile.MixedPrecision(output_dtype=torch.int32)
    with pytest.raises(TypeError, match="mixed_precision= must be an fsdp_compile.MixedPrecision"):
        fsdp_compile.backend(mixed_precision=torch.bfloat16)


class EchoNet(nn.Module):
    """Returns its output and the input it received (to see what the casts did)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x) * scale, x, scale


def casts_worker(rank: int, world: int) -> dict:
    out = {}
    cases = {
        "default": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16),
        "output_fp32": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        "no_input_cast": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False),
    }
    for name, policy in cases.items():
        for mode in ("eager", "aot_eager"):
            torch._dynamo.reset()
            model = EchoNet()
            backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", mixed_precision=policy)
            backend.shard(model)
            forward = model if mode == "eager" else torch.compile(model, backend=backend)
            x = torch.randn(2, 4)
            try:
                y, seen, scale = forward(x, scale=torch.tensor(2.0))
                out[(name, mode)] = {"output": y.dtype, "input_seen": seen.dtype, "kwarg_seen": scale.dtype,
                                     "graphs": len(backend.graphs)}
            except Exception as exc:
                out[(name, mode)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def test_forward_input_and_output_casts() -> None:
    out = run_workers(casts_worker, 1)[0]
    for mode in ("eager", "aot_eager"):
        # Floating inputs, positional and keyword, are cast to param_dtype; outputs stay bf16
        # unless output_dtype says otherwise (it also casts the echoed input).
        assert out[("default", mode)]["input_seen"] == torch.bfloat16
        assert out[("default", mode)]["kwarg_seen"] == torch.bfloat16
        assert out[("default", mode)]["output"] == torch.bfloat16
        assert out[("output_fp32", mode)]["output"] == torch.float32
        assert out[("output_fp32", mode)]["input_seen"] == torch.float32
        # Without the input cast the float32 input reaches the bf16 weights unchanged, as in
        # FSDP2: torch's own matmul refuses the pair (an input cast to any other dtype, or an
        # error of ours, reads differently).
        assert "same dtype, but got Float and BFloat16" in out[("no_input_cast", mode)]["error"], out[
            ("no_input_cast", mode)]
    assert out[("default", "aot_eager")]["graphs"] == 1  # the casts add no graph of their own
