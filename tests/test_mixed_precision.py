"""Mixed precision (bf16 compute, fp32 reduction): placement of casts, dtypes, parity."""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import run_workers
from runs import WORLD
from test_parity import assert_bitwise
from workers import mixed_precision_worker

import fsdp_compile

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
# Expected (kind, dtype) pairs of every collective, per strategy, for reduce_dtype fp32 / unset.
BF16, FP32 = "torch.bfloat16", "torch.float32"


def expected_collectives(strategy: str, reduce: str) -> list[tuple[str, str]]:
    if strategy == "NO_SHARD":
        return [("all_reduce", reduce)]
    pairs = [("all_gather", BF16), ("reduce_scatter", reduce)]
    if strategy.startswith("HYBRID"):
        pairs.append(("all_reduce", reduce))  # across replicas, in the reduce dtype too
    return sorted(pairs)


@functools.cache
def mp_run(strategy: str) -> dict:
    modes = ["eager", "aot_eager", "inductor", "fsdp2", "aot_eager_default", "fsdp2_default"]
    return run_workers(mixed_precision_worker, WORLD[strategy], strategy, modes, STEPS)[0]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together."""
    num = sum(((a[n] - b[n]).double() ** 2).sum() for n in b)
    den = sum((b[n].double() ** 2).sum() for n in b)
    return float((num / den).sqrt())


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


@pytest.mark.parametrize("strategy", MP_STRATEGIES)
def test_bf16_training_follows_fp32_training(strategy: str) -> None:
    out = mp_run(strategy)
    ref = out["reference"]["losses"]
    for mode in ("eager", "aot_eager", "inductor"):
        losses = out[mode]["losses"]
        # bf16 has 8 bits of mantissa: per-step losses agree to about 1%.
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, ref)), (mode, losses, ref)
        assert relative_difference(out[mode]["params"], out["reference"]["params"]) <= PARAM_RTOL


def test_policy_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int8\) cannot be communicated"):
        fsdp_compile.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float8_e4m3fn"):
        fsdp_compile.MixedPrecision(reduce_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"output_dtype=torch.int32\) must be a floating-point dtype"):
        fsdp_compile.MixedPrecision(output_dtype=torch.int32)
    with pytest.raises(TypeError, match="mixed_precision= must be an fsdp_compile.MixedPrecision"):
        fsdp_compile.backend(mixed_precision=torch.bfloat16)


def test_forward_input_and_output_casts() -> None:
    from workers import casts_worker

    out = run_workers(casts_worker, 1)[0]
    for mode in ("eager", "aot_eager"):
        # Floating inputs, positional and keyword, are cast to param_dtype; outputs stay bf16
        # unless output_dtype says otherwise (it also casts the echoed input).
        assert out[("default", mode)]["input_seen"] == torch.bfloat16
        assert out[("default", mode)]["kwarg_seen"] == torch.bfloat16
        assert out[("default", mode)]["output"] == torch.bfloat16
        assert out[("output_fp32", mode)]["output"] == torch.float32
        assert out[("output_fp32", mode)]["input_seen"] == torch.float32
        # Without the input cast a float32 input meets bf16 weights, as in FSDP2.
        assert "dtype" in out[("no_input_cast", mode)]["error"]
    assert out[("default", "aot_eager")]["graphs"] == 1  # the casts add no graph of their own
