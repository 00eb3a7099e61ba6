"""Training parity: every strategy x {eager runtime, aot_eager, inductor} against references.

One multi-process run per strategy trains the same GPT from the same initial weights on the
same data with: our eager runtime, our backend with aot_eager, our backend with Inductor, and
torch's FSDP2 configured the same way; rank 0 also trains a single-process reference on the
concatenated batch. The tests below compare the recorded first-step gradients and the
parameters after 5 AdamW steps.

The tolerances (tests/helpers.py, where they are explained) are those of float rounding:
data parallelism averages per-rank means where the reference takes one mean, and AdamW
magnifies that in near-zero gradient entries.
"""

from __future__ import annotations

import pytest
from helpers import (
    GRAD_ATOL,
    GRAD_RTOL,
    PARAM_ATOL,
    STEPS,
    STRATEGIES,
    assert_bitwise,
    assert_grads_close,
    max_diff,
    parity_run,
)

OURS = ("eager", "aot_eager", "inductor")


@pytest.mark.parametrize("mode", OURS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_process_training(strategy: str, mode: str) -> None:
    out = parity_run(strategy)
    ours, ref = out[mode], out["reference"]
    # Gradient semantics: each shard's gradient is that shard of the gradient of the mean loss,
    # compared directly (AdamW would cancel a constant factor such as a missing 1/N).
    assert_grads_close(ours["grads0"], ref["grads0"], GRAD_RTOL, "first-step gradients")
    grad_diff, grad_name = max_diff(ours["grads0"], ref["grads0"])
    assert grad_diff <= GRAD_ATOL, f"first-step gradient of {grad_name} differs by {grad_diff}"
    param_diff, param_name = max_diff(ours["params"], ref["params"])
    assert param_diff <= PARAM_ATOL, f"{param_name} differs by {param_diff} after {STEPS} steps"
    # Training happened: parameters moved by much more than the tolerance.
    assert max_diff(ours["params"], out["initial"])[0] > 10 * PARAM_ATOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_runtime_is_bitwise_equal_to_aot_eager(strategy: str) -> None:
    out = parity_run(strategy)
    assert_bitwise(out["eager"]["grads0"], out["aot_eager"]["grads0"], "first-step gradients")
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "parameters")
    assert out["eager"]["losses"] == out["aot_eager"]["losses"]


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bitwise_equal_to_fsdp2(strategy: str, mode: str) -> None:
    # Same math: exact all-gathers, the same averaging reductions on the same gloo groups,
    # and the same per-parameter AdamW on DTensor shards.
    out = parity_run(strategy)
    assert_bitwise(out[mode]["grads0"], out["fsdp2"]["grads0"], f"{mode} vs FSDP2 gradients")
    assert_bitwise(out[mode]["params"], out["fsdp2"]["params"], f"{mode} vs FSDP2 parameters")
    assert out[mode]["losses"] == out["fsdp2"]["losses"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inductor_matches_fsdp2_within_tolerance(strategy: str) -> None:
    # Not bitwise: Inductor fuses pointwise chains and reorders float reductions (layer norm,
    # softmax, bias sums), so its rounding differs from eager kernels at the 1e-7 level.
    out = parity_run(strategy)
    assert_grads_close(out["inductor"]["grads0"], out["fsdp2"]["grads0"], GRAD_RTOL, "Inductor vs FSDP2")
    param_diff, param_name = max_diff(out["inductor"]["params"], out["fsdp2"]["params"])
    assert param_diff <= PARAM_ATOL, f"{param_name} differs by {param_diff}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiles_once(strategy: str) -> None:
    out = parity_run(strategy)
    assert out["aot_eager"]["graphs"] == 1
    assert out["inductor"]["graphs"] == 1
