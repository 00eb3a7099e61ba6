"""``verify_gradients`` / ``FSDP_COMPILE_VERIFY=1``: the first step of each compiled graph is
checked against the eager runtime, and a compiled graph that computes wrong gradients is named
on every rank with the first parameter whose gradient differs.

A deliberately broken backward pass (it doubles one gradient the backward graph returns) is
the fault: with the check it raises :class:`fsdp_compile.GradientMismatch`; without it the same
run trains silently on the wrong gradient. A correct compilation passes the check, under
aot_eager bitwise and under Inductor (the default path) within its rounding.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.fx as fx
from distributed import run_workers
from helpers import PER_RANK_BATCH, expect_error, lm_loss
from model_shapes import MODEL_SHAPES, make_model

import fsdp_compile
from fsdp_compile.checks.gradients import FULL_PRECISION_RTOL


def double_first_gradient(gm: fx.GraphModule) -> None:
    """A broken backward pass: the first gradient the graph returns comes out doubled."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    first = next(i for i, v in enumerate(values) if isinstance(v, fx.Node))
    with gm.graph.inserting_before(output):
        values[first] = gm.graph.call_function(torch.ops.aten.mul.Tensor, (values[first], 2.0))
    output.args = (tuple(values),)
    gm.recompile()


def verify_worker(rank: int, world: int, compiler: str, broken_on: list[int], options: dict[str, Any]) -> dict:
    _, vocab, seq = MODEL_SHAPES["gpt2_tied"]
    torch.manual_seed(0)
    model = make_model("gpt2_tied")
    passes = {"backward": [double_first_gradient]} if rank in broken_on else {}
    backend = fsdp_compile.backend("FULL_SHARD", compiler=compiler, passes=passes, **options)
    forward = torch.compile(backend.shard(model), backend=backend)
    data = torch.randint(0, vocab, (PER_RANK_BATCH, seq + 1), generator=torch.Generator().manual_seed(rank))
    error = None
    try:
        for _ in range(2):
            lm_loss(forward(data[:, :-1]), data[:, 1:]).backward()
    except fsdp_compile.GradientMismatch as exc:
        error = str(exc)
    check = backend.compiler.gradient_check
    return {"error": error, "compared": None if check is None else check.compared,
            "names": [n for n, _ in model.named_parameters()]}


def test_a_correct_compilation_passes_the_check_once_per_graph() -> None:
    for compiler, tolerance in (("aot_eager", 0.0), ("inductor", FULL_PRECISION_RTOL)):
        for out in run_workers(verify_worker, 2, compiler, [], {"verify_gradients": True}):
            assert out["error"] is None
            (compared,) = out["compared"]  # one graph, checked on its first step only
            assert compared["inputs"] == len(out["names"])  # every parameter (the tied head is one)
            assert compared["worst"] <= tolerance, (compiler, compared)


def test_a_broken_pass_is_named_on_every_rank() -> None:
    outs = run_workers(verify_worker, 2, "aot_eager", [1], {"verify_gradients": True})
    for out in outs:
        # Found on rank 1 only; rank 0 raises too, naming rank 1, instead of waiting for it.
        match = re.search(r"compiled graph 0 computes wrong gradients on rank 1: the gradient of (\S+) differs "
                          r"from the eager runtime's by 1\.00e\+00 of its largest entry", out["error"] or "")
        assert match and match.group(1) in out["names"], out["error"]


def test_the_environment_variable_turns_the_check_on_and_without_it_the_fault_goes_unreported() -> None:
    on = run_workers(verify_worker, 2, "aot_eager", [0, 1], {}, env={"FSDP_COMPILE_VERIFY": "1"})
    assert all("computes wrong gradients on rank 0" in out["error"] for out in on)
    off = run_workers(verify_worker, 2, "aot_eager", [0, 1], {})
    assert all(out["error"] is None and out["compared"] is None for out in off)


@pytest.mark.parametrize("value", [2.0, 0, -1e-3, "yes"])
def test_a_tolerance_outside_zero_to_one_is_refused_by_name(value: Any) -> None:
    error = expect_error(lambda: fsdp_compile.backend("FULL_SHARD", verify_gradients=value))
    assert error.startswith("ValueError: verify_gradients=") and "tolerance between 0 and 1" in error
