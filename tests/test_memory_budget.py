"""``memory_budget=``: the compiler chooses each unit's ``reshard_after_forward`` under a budget.

The choice (planning/budget.py) on hand-made steps, where the arithmetic can be done
by hand, and on a GPT at 2 "nodes" x 2 ranks: a budget below FULL_SHARD's own peak is an error
naming the smallest that fits; a budget between FULL_SHARD's and SHARD_GRAD_OP's keeps some units
and no more than fits (by the compiled graphs' own estimate), and every rank chose alike; the
gradients are FULL_SHARD's, bit for bit; the choice is in the report and the dumps.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from helpers import (
    GRAD_RTOL,
    assert_bitwise,
    assert_grads_close,
    batches,
    expect_error,
    full,
    lm_loss,
    local_slice,
)

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.passes.graph import COMM_META, decode_collective
from fsdp_compile.planning.budget import choose, kept_bytes

# ---------------------------------------------------------------- the greedy choice, by hand


class FakeStep:
    """A step whose peak is a base plus what units keep, and whose exposed communication is
    each unit's regather, removed by keeping it, halved by resharding to 2 ranks."""

    def __init__(self, base_peak: float, units: dict[str, tuple[float, float]]) -> None:
        self.base_peak = base_peak
        self.exposure = {u: seconds for u, (_, seconds) in units.items()}
        self.units = {u: type("Info", (), {"gathered_bytes": nbytes}) for u, (nbytes, _) in units.items()}

    def peak(self, settings: dict[str, int], shard_size: int) -> float:
        return self.base_peak + sum(kept_bytes(self.units[u].gathered_bytes, r, shard_size) for u, r in settings.items())

    def exposed(self, settings: dict[str, int]) -> tuple[float, float]:
        total = 0.0
        for unit, seconds in self.exposure.items():
            ranks = settings.get(unit, 4)
            total += 0.0 if ranks == 1 else seconds / 2 if ranks == 2 else seconds
        return total, total


STEP = {"a": (100.0, 4e-3), "b": (100.0, 1e-3), "c": (400.0, 4e-3)}


def test_the_choice_takes_what_saves_most_per_byte_within_the_budget() -> None:
    # Per byte: a keeps 100 for 4 ms, or half of it (50) for 2 ms; b 100 for 1 ms; c 400 for 4 ms.
    step = FakeStep(1000.0, STEP)
    assert choose(step, 1000.0, 4, [2]).reshard_to == {}
    assert choose(step, 1050.0, 4, [2]).reshard_to == {"a": 2}
    assert choose(step, 1100.0, 4, [2]).reshard_to == {"a": 1}
    generous = choose(step, 10_000.0, 4, [2])
    assert generous.reshard_to == {"a": 1, "b": 1, "c": 1} and generous.exposed == 0.0
    middle = choose(step, 1400.0, 4, [2])
    assert middle.peak <= 1400.0 and middle.reshard_to == {"a": 1, "b": 1, "c": 2}
    assert middle.units["a"].kept_bytes == 100.0 and middle.units["a"].saved_seconds == pytest.approx(4e-3)


def test_a_budget_below_the_strategys_peak_names_the_smallest_that_fits() -> None:
    with pytest.raises(fsdp_compile.ConfigError, match=r"the smallest budget that fits is .* \(1000 bytes\)"):
        choose(FakeStep(1000.0, STEP), 999.0, 4, [2])


# ---------------------------------------------------------------- a GPT at 2 x 2

CONFIG = GPTConfig(vocab_size=67, block_size=33, n_layer=4, n_head=2, d_model=64)


def budget_worker(rank: int, world: int, dump_root: str) -> dict:
    """FULL_SHARD, then budgets too small, generous (everything fits), and halfway between
    FULL_SHARD's peak and the generous choice's."""
    torch.manual_seed(0)
    base = GPT(CONFIG)
    data = batches(CONFIG, world, 1)
    cluster = fsdp_compile.Cluster.preset("h100-sxm", nodes=2, devices_per_node=2)
    out: dict = {}
    for label in ("strategy", "small", "generous", "middle"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        budget = {"small": 100_000, "generous": "1GiB", "middle": None, "strategy": None}[label]
        if label == "middle":
            generous = out["generous"]["choice"]
            budget = int((generous["strategy_peak"] + generous["peak"]) / 2)
        options = {} if budget is None else {"memory_budget": budget, "cluster": cluster}
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", dump_dir=f"{dump_root}/{label}", **options)
        backend.shard(model)
        x, y = data[0]
        try:
            lm_loss(torch.compile(model, backend=backend)(local_slice(x, rank)), local_slice(y, rank)).backward()
        except Exception as exc:
            out[label] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        choice = backend._state.reshard_choice
        out[label] = {"grads": {n: full(p.grad) for n, p in model.named_parameters()}, "budget": budget,
                      "choice": None if choice is None else choice.summary(),
                      "reshard_to": dict(backend._state.reshard_to), "report": backend.report()}
    return out


# -m slow (25 s, 4 ranks): the default run compiles a partial choice under the default compiler below.
@pytest.mark.slow
def test_a_budget_keeps_what_fits_and_trains_like_full_shard(tmp_path: Path) -> None:
    outs = run_workers(budget_worker, 4, str(tmp_path))
    out = outs[0]
    generous, middle = out["generous"]["choice"], out["middle"]["choice"]
    assert "ConfigError" in out["small"]["error"]
    assert "the smallest budget that fits is" in out["small"]["error"]
    assert f"({math.ceil(generous['strategy_peak'])} bytes)" in out["small"]["error"]
    # The most generous budget keeps every unit gathered (the root and 4 blocks) and leaves
    # the least to wait for; halfway, some units and no more than fit.
    assert {c["reshard_to"] for c in generous["units"]} == {1} and len(generous["units"]) == 5
    budget = out["middle"]["budget"]
    assert 0 < len(middle["units"]) < 5 or any(c["reshard_to"] > 1 for c in middle["units"]), middle["units"]
    assert middle["peak"] <= budget and middle["compiled_peak"] <= budget
    assert generous["exposed"] <= middle["exposed"] < middle["strategy_exposed"]
    # Every rank chose alike (rank 0's choice, broadcast), and the gradients are FULL_SHARD's.
    for rank_out in outs:
        assert rank_out["middle"]["reshard_to"] == out["middle"]["reshard_to"]
        for label in ("middle", "generous"):
            assert_bitwise(rank_out[label]["grads"], rank_out["strategy"]["grads"], f"memory_budget {label}")
    # The report and the dumps (what `python -m fsdp_compile inspect` reads) say what was chosen.
    assert "memory_budget=" in out["middle"]["report"] and "kept" in out["middle"]["report"]
    summary = json.loads(next((tmp_path / "middle").rglob("summary.json")).read_text())
    assert summary["reshard_choice"]["units"] == middle["units"]


SMALL = GPTConfig(vocab_size=67, block_size=17, n_layer=2, n_head=2, d_model=32)


def _backward_gathered(backend: fsdp_compile.FSDPBackend) -> set[str]:
    """The buckets the compiled backward graphs gather again."""
    return {node.meta[COMM_META].bucket for record in backend.graphs for node in record.backward.graph.nodes
            if (c := decode_collective(node)) is not None and c.kind == "all_gather"}


def default_compiler_worker(rank: int, world: int) -> dict:
    """What a user gets by default (Inductor, regions, scheduling), with a budget halfway between
    FULL_SHARD's peak and the peak of keeping every unit, against FULL_SHARD's defaults alone
    and one process; and a trace that fails on rank 0 only."""
    torch.manual_seed(0)
    base = GPT(SMALL)
    x, y = batches(SMALL, world, 1)[0]
    cluster = fsdp_compile.Cluster.preset("h100-sxm", nodes=1, devices_per_node=world)
    out: dict = {}
    # The two peaks, from a budget everything fits in. The choice traces the strategy's step
    # without code generation whatever the inner compiler, so aot_eager's forward finds them.
    torch._dynamo.reset()
    probe = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", memory_budget="1GiB", cluster=cluster)
    torch.compile(probe.shard(copy.deepcopy(base)), backend=probe)(local_slice(x, rank))
    out["generous"] = probe._state.reshard_choice.summary()
    budget = int((out["generous"]["strategy_peak"] + out["generous"]["peak"]) / 2)
    for label, options in (("strategy", {}), ("budget", {"memory_budget": budget, "cluster": cluster})):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend("FULL_SHARD", **options)
        backend.shard(model)
        lm_loss(torch.compile(model, backend=backend)(local_slice(x, rank)), local_slice(y, rank)).backward()
        choice = backend._state.reshard_choice
        out[label] = {"grads": {n: full(p.grad) for n, p in model.named_parameters()},
                      "compilers": {g.compiler for g in backend.graphs},
                      "fallbacks": [f for g in backend.graphs for f in g.fallbacks],
                      "inlined": [c.key for c in backend._state.region_fallback.inlined()],
                      "regathered": _backward_gathered(backend), "budget": budget,
                      "reshard_to": dict(backend._state.reshard_to),
                      "choice": None if choice is None else choice.summary()}
    reference = copy.deepcopy(base)
    lm_loss(reference(x), y).backward()
    out["reference"] = {n: p.grad.clone() for n, p in reference.named_parameters()}

    def fail_on_rank_0(*args: object) -> None:  # only rank 0 traces; the others wait for its choice
        raise RuntimeError("a trace that fails on rank 0 alone")

    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=False, memory_budget="1GiB",
                                   cluster=cluster)
    backend.shard(model)
    backend.compiler.trace_step = fail_on_rank_0  # this backend's compiler only
    out["rank0_failure"] = expect_error(lambda: torch.compile(model, backend=backend)(local_slice(x, rank)))
    return out


def test_a_partial_budget_under_the_default_compiler_keeps_regions_and_full_shards_gradients() -> None:
    outs = run_workers(default_compiler_worker, 2, fresh=True)
    units = ["", "blocks.0", "blocks.1"]
    # Everything fits in the generous budget: every unit (the root and 2 blocks) kept.
    assert sorted(u["unit"] for u in outs[0]["generous"]["units"]) == units, outs[0]["generous"]
    for rank, out in enumerate(outs):
        budget = out["budget"]
        assert budget["compilers"] == {"inductor"} and budget["fallbacks"] == [] and budget["inlined"] == [], budget
        # Halfway, some units keep their parameters and the rest reshard (to both ranks: at
        # world 2 there is no smaller group), within the budget, alike on every rank.
        kept = sorted(unit for unit, ranks in budget["reshard_to"].items() if ranks == 1)
        assert 0 < len(kept) < len(units), budget["reshard_to"]
        assert budget["reshard_to"] == {unit: 1 if unit in kept else 2 for unit in units}, budget["reshard_to"]
        assert budget["reshard_to"] == outs[0]["budget"]["reshard_to"]
        assert sorted(u["unit"] for u in budget["choice"]["units"]) == kept
        assert budget["choice"]["peak"] <= budget["budget"] and budget["choice"]["compiled_peak"] <= budget["budget"]
        # What ran: backward gathers again exactly the units that did not keep their parameters.
        assert out["strategy"]["regathered"] == {"<root>", "blocks.0", "blocks.1"}, out["strategy"]["regathered"]
        assert budget["regathered"] == {unit or "<root>" for unit in units if unit not in kept}, budget["regathered"]
        # Per tensor: FULL_SHARD's gradients under the same compiler, and one process's.
        assert_grads_close(budget["grads"], out["strategy"]["grads"], GRAD_RTOL, f"rank {rank} budget vs FULL_SHARD")
        assert_grads_close(budget["grads"], out["reference"], GRAD_RTOL, f"rank {rank} budget vs one process")
        # Every rank raises rank 0's failure, none waits for the others.
        assert "tracing the strategy's step on rank 0 failed" in out["rank0_failure"], (rank, out["rank0_failure"])


def bad_options_worker(rank: int, world: int) -> dict:
    cluster = fsdp_compile.Cluster.preset("h100-sxm")
    return {
        "strategy": expect_error(lambda: fsdp_compile.backend("SHARD_GRAD_OP", memory_budget="1GiB", cluster=cluster)),
        "both": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", memory_budget="1GiB", cluster=cluster,
                                                          reshard_after_forward=False)),
        "no_cluster": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", memory_budget="1GiB")),
        "size": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", memory_budget="lots", cluster=cluster)),
        "alone": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", cluster=cluster)),
    }


def test_bad_memory_budget_options_are_named() -> None:
    errors = run_workers(bad_options_worker, 2)[0]
    assert "SHARD_GRAD_OP already decides it" in errors["strategy"]
    assert "pass one of the two" in errors["both"]
    assert "pass cluster=" in errors["no_cluster"]
    assert "memory_budget='lots'" in errors["size"]
    assert "pass memory_budget= too" in errors["alone"]


# ---------------------------------------------------------------- the planner's rows and auto

def plan_loss(output: torch.Tensor) -> torch.Tensor:
    """Module level: the planner pickles it for its subprocess."""
    return output.float().square().mean()


def toy_cluster(nodes: int, per_node: int) -> fsdp_compile.Cluster:
    """Slow links, so that what a unit keeps saves time the planner can see."""
    return fsdp_compile.Cluster(
        name="toy-cpu", nodes=nodes, devices_per_node=per_node, device_memory=1 << 30,
        peak_flops={torch.float32: 5e10}, memory_bandwidth=1e10, intra_node_bandwidth=1e9,
        inter_node_bandwidth=2e8 if nodes > 1 else None, intra_node_latency=1e-5,
        inter_node_latency=5e-5 if nodes > 1 else None, device_type="cpu")


def _plan(cluster: fsdp_compile.Cluster, budget: float | None = None) -> fsdp_compile.Plan:
    with torch.device("meta"):
        model = GPT(CONFIG)
    return fsdp_compile.plan(model, (torch.zeros(2, 16, dtype=torch.long),), cluster=cluster, loss_fn=plan_loss,
                             prefetch=(1,), strategies=["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"],
                             memory_budget=budget)


def _between_full_and_grad_op(cluster: fsdp_compile.Cluster) -> int:
    generous = _plan(cluster)
    assert not any(row.reshard for row in generous.rows), "keeping every unit is SHARD_GRAD_OP's own row"
    return int((generous.row("FULL_SHARD").peak_bytes + generous.row("SHARD_GRAD_OP").peak_bytes) / 2)


# -m slow: the planner's view of memory_budget= (13 s); the default run trains under a budget.
@pytest.mark.slow
def test_the_plan_has_a_row_for_the_units_a_budget_keeps() -> None:
    cluster = toy_cluster(2, 2)
    budget = _between_full_and_grad_op(cluster)
    tight = _plan(cluster, budget)
    full_shard = next(r for r in tight.rows if r.strategy == "FULL_SHARD" and not r.reshard)
    mixed = [r for r in tight.rows if r.reshard]
    assert {r.strategy for r in mixed} <= {"FULL_SHARD", "HYBRID_SHARD"} and mixed
    mix = next(r for r in mixed if r.strategy == "FULL_SHARD")
    # What it keeps fits (the row is traced with reshard_after_forward= as the backend applies
    # it) and saves communication on the slow inter-node link that FULL_SHARD's regathers use.
    assert mix.fits and full_shard.peak_bytes < mix.peak_bytes <= budget
    assert mix.bytes_per_step["inter"] < full_shard.bytes_per_step["inter"]
    assert mix.step_seconds < full_shard.step_seconds
    assert not tight.row("SHARD_GRAD_OP").fits
    text = str(tight)
    assert "kept" in mix.label() and f"reshard_after_forward={mix.reshard}" in text


def auto_budget_worker(rank: int, world: int, budget: int) -> dict:
    torch.manual_seed(0)
    base = GPT(CONFIG)
    data = batches(CONFIG, world, 1)
    example = (torch.zeros(2, 16, dtype=torch.long),)
    auto = fsdp_compile.backend("auto", compiler="aot_eager", example_inputs=example, loss_fn=plan_loss,
                                cluster=toy_cluster(1, world), memory_budget=budget,
                                plan_options={"prefetch": (1,), "strategies": ["FULL_SHARD", "SHARD_GRAD_OP"]})
    model = auto.shard(copy.deepcopy(base))
    # The backend's own choice under the same budget and cluster: what the plan's note promises.
    chooser = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", memory_budget=budget,
                                   cluster=toy_cluster(1, world))
    chosen_model = chooser.shard(copy.deepcopy(base))
    reference_backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    reference = reference_backend.shard(copy.deepcopy(base))
    grads = {}
    x, y = data[0]
    for label, m, b in (("auto", model, auto), ("chooser", chosen_model, chooser),
                        ("full_shard", reference, reference_backend)):
        torch._dynamo.reset()
        lm_loss(torch.compile(m, backend=b)(local_slice(x, rank)), local_slice(y, rank)).backward()
        grads[label] = {n: full(p.grad) for n, p in m.named_parameters()}
    return {"row": auto.plan.best.reshard, "applied": auto.options.reshard_after_forward,
            "reshard_to": dict(auto._state.reshard_to), "chooser": dict(chooser._state.reshard_to),
            "strategy": auto.strategy.name, "grads": grads}


@pytest.mark.slow  # 24 s; the default run compiles a partial budget under the default compiler
def test_auto_applies_the_units_its_budget_keeps() -> None:
    budget = _between_full_and_grad_op(toy_cluster(1, 2))
    outs = run_workers(auto_budget_worker, 2, budget)
    out = outs[0]
    assert out["strategy"] == "FULL_SHARD" and out["row"] and out["applied"] == out["row"]
    kept = {unit for unit, ranks in out["reshard_to"].items() if ranks == 1}
    assert kept and len(kept) < len(out["reshard_to"]), out["reshard_to"]
    assert out["chooser"] == out["reshard_to"]
    for rank_out in outs:
        assert rank_out["reshard_to"] == out["reshard_to"]
        assert_bitwise(rank_out["grads"]["auto"], rank_out["grads"]["full_shard"], "auto with a budget")
