"""``reshard_after_forward=``: per unit, drop to the shard, keep the gathered parameters, or keep a
shard over groups of n ranks (FSDP2's option; ZeRO++'s hpZ for the int).

The gradients are the same sums whatever each unit keeps: bitwise equal to FULL_SHARD's under
``aot_eager`` and the eager runtime (and, for the settings measured, under Inductor), at world 2
and at 2 "nodes" x 2, and those of single-process training up to rounding. What changes is
which collectives backward issues, read from the compiled backward graphs: a unit that keeps
its parameters gathers nothing, one that reshards to n ranks gathers inside its group of n
(every rank of a group in the same node), and forward keeps that unit's 1/n of each parameter
for backward. The eager runtime never reshards (it keeps what it gathered for backward), so
only compiled runs tell the settings apart.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_workers
from helpers import (
    GRAD_RTOL,
    TEST_CONFIG,
    assert_bitwise,
    assert_grads_close,
    batches,
    compiled_regions,
    expect_error,
    full,
    lm_loss,
    local_slice,
)

import fsdp_compile
from fsdp_compile.models.gpt import GPT, Block, GPTConfig
from fsdp_compile.passes.graph import COMM_META, decode_collective
from fsdp_compile.runtime.markers import RESHARD

CONFIG = GPTConfig(vocab_size=67, block_size=19, n_layer=3, n_head=2, d_model=32)
STEPS = 2


def _step_grads(model: torch.nn.Module, forward, data, rank: int | None) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients (whole tensors) under SGD; ``rank=None``: one process, whole batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x, y in data:
        if rank is not None:
            x, y = local_slice(x, rank), local_slice(y, rank)
        lm_loss(forward(x), y).backward()
        out.append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _backward_gathers(backend: fsdp_compile.FSDPBackend) -> dict[str, int]:
    """Bucket -> the size of the group its backward all-gather runs in (0: no gather)."""
    gathers: dict[str, int] = {}
    for record in backend.graphs:
        for node in record.backward.graph.nodes:
            collective = decode_collective(node)
            if collective is not None and collective.kind == "all_gather":
                gathers[node.meta[COMM_META].bucket] = collective.resolved_group_size()
    return gathers


def _kept_rows(backend: fsdp_compile.FSDPBackend) -> dict[str, tuple[int, int]]:
    """Parameter -> (rows forward keeps for backward, full rows), for units that reshard to a group."""
    kept = {}
    for record in backend.graphs:
        for node in record.forward.graph.nodes:
            if node.target is RESHARD:
                kept[node.args[1]] = (node.meta["val"].shape[0], node.args[0].meta["val"].shape[0])
    return kept


def reshard_worker(rank: int, world: int, strategy: str, settings: list, compiler: str,
                   with_strategy: bool = True) -> dict:
    torch.manual_seed(0)
    base = GPT(CONFIG)
    data = batches(CONFIG, world, STEPS)
    options = {"shard_size": 2} if strategy.startswith("HYBRID") else {}
    out = {}
    for label, value in [("strategy", None)] * with_strategy + settings:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        extra = {} if value is None else {"reshard_after_forward": value}
        backend = fsdp_compile.backend(strategy, compiler="aot_eager" if compiler == "eager" else compiler,
                                       **options, **extra)
        backend.shard(model)
        forward = model if compiler == "eager" else torch.compile(model, backend=backend)
        run = {"grads": _step_grads(model, forward, data, rank), "reshard_to": dict(backend._state.reshard_to)}
        if compiler != "eager":
            run["backward_gathers"] = _backward_gathers(backend)
            run["kept_rows"] = _kept_rows(backend)
            run["report"] = backend.report()
            # What ran: the graphs of the compiler asked for, every pass applied, and regions
            # compiled as regions (not inlined back into the graph).
            run["compilers"] = {g.compiler for g in backend.graphs}
            run["fallbacks"] = [f for g in backend.graphs for f in g.fallbacks]
            run["inlined"] = [c.key for c in backend._state.region_fallback.inlined()]
            run["regions"] = compiled_regions(backend)[0]
        out[label] = run
    if rank == 0:
        reference = copy.deepcopy(base)
        out["reference"] = {"grads": _step_grads(reference, reference, data, None)}
    return out


def _assert_same_sums(out: dict, what: str) -> None:
    for label, run in out.items():
        if label == "reference":
            continue
        for step, (ours, theirs) in enumerate(zip(run["grads"], out["strategy"]["grads"])):
            assert_bitwise(ours, theirs, f"{what} {label} step {step} vs the strategy's")


# World 2: one value for all, and a dict naming units by class, by name and the root (later
# keys win, as in dict.update: blocks.1 by name after its class).
WORLD2_SETTINGS = [("keep", False), ("mixed", {Block: False, "blocks.1": True, "<root>": False})]


# The eager runtime with -m slow: it never reshards, so it reads the settings and nothing more.
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("eager", marks=pytest.mark.slow)])
def test_every_setting_reduces_the_same_gradients_at_world_2(compiler: str) -> None:
    out = run_workers(reshard_worker, 2, "FULL_SHARD", WORLD2_SETTINGS, compiler)[0]
    _assert_same_sums(out, f"world 2 {compiler}")
    assert out["keep"]["reshard_to"] == {"": 1, "blocks.0": 1, "blocks.1": 1, "blocks.2": 1}
    assert out["mixed"]["reshard_to"] == {"": 1, "blocks.0": 1, "blocks.1": 2, "blocks.2": 1}
    if compiler == "aot_eager":
        assert out["strategy"]["backward_gathers"] == {"<root>": 2, "blocks.0": 2, "blocks.1": 2, "blocks.2": 2}
        assert out["keep"]["backward_gathers"] == {}
        assert out["mixed"]["backward_gathers"] == {"blocks.1": 2}


def test_a_unit_keeps_its_parameters_while_the_others_reshard() -> None:
    out = run_workers(reshard_worker, 2, "FULL_SHARD", [("one", {"blocks.1": False})], "aot_eager")[0]
    _assert_same_sums(out, "blocks.1 kept")
    assert out["one"]["backward_gathers"] == {"<root>": 2, "blocks.0": 2, "blocks.2": 2}
    assert "reshard after forward: blocks.1 keeps its gathered parameters" in out["one"]["report"]


# 2 "nodes" x 2 ranks: FULL_SHARD over all 4 with every unit resharded to its node, and a mix.
NODE_SETTINGS = [("node", 2), ("mixed", {"blocks.0": 2, "blocks.1": False})]


# -m slow: aot_eager (13 s), and the eager runtime, which never reshards (it reads the settings
# alone); the default run compiles them under Inductor below.
@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
def test_resharding_to_the_node_gathers_backward_inside_it(compiler: str) -> None:
    out = run_workers(reshard_worker, 4, "FULL_SHARD", NODE_SETTINGS, compiler)[0]
    _assert_same_sums(out, f"2x2 {compiler}")
    assert out["node"]["reshard_to"] == dict.fromkeys(["", "blocks.0", "blocks.1", "blocks.2"], 2)
    if compiler == "eager":
        return
    assert out["strategy"]["backward_gathers"] == dict.fromkeys(["<root>", "blocks.0", "blocks.1", "blocks.2"], 4)
    assert out["node"]["backward_gathers"] == dict.fromkeys(["<root>", "blocks.0", "blocks.1", "blocks.2"], 2)
    assert out["mixed"]["backward_gathers"] == {"<root>": 4, "blocks.0": 2, "blocks.2": 4}
    # Forward keeps half of each parameter of a unit resharded to 2 ranks, the rest nothing.
    kept = out["mixed"]["kept_rows"]
    assert kept and all(name.startswith("blocks.0.") for name in kept)
    assert all(rows == -(-full_rows // 2) for rows, full_rows in kept.values()), kept
    assert "reshard after forward: blocks.0 keeps a shard over 2 ranks" in out["mixed"]["report"]


# The default compiler (Inductor, regions, scheduling) at 2 "nodes" x 2, in the default run: every
# form of the option (False, an int group size, a dict by class, by name and the root) in one job,
# against one process rather than FULL_SHARD's own compiled run (another Inductor compile at 4
# ranks on 2 cores: 30 s of the default run).
COMPILED_SETTINGS = [("keep", False), ("node", 2), ("mixed", {Block: 2, "blocks.1": False, "<root>": True})]


def test_every_setting_compiles_under_inductor_to_the_same_gradients() -> None:
    out = run_workers(reshard_worker, 4, "FULL_SHARD", COMPILED_SETTINGS, "inductor", False)[0]
    for label in ("keep", "node", "mixed"):
        run = out[label]
        assert run["compilers"] == {"inductor"} and run["fallbacks"] == [], (label, run["compilers"], run["fallbacks"])
        assert run["inlined"] == [] and run["regions"] > 0, (label, run["inlined"], run["regions"])
        # Per tensor against one process on the whole batch: a unit regathered from the wrong
        # rows, or not reduced, is off by far more than rounding.
        assert_grads_close(run["grads"][0], out["reference"]["grads"][0], GRAD_RTOL, f"inductor {label}")
        # and the same sums whatever each unit keeps, both steps
        for step, (ours, theirs) in enumerate(zip(run["grads"], out["keep"]["grads"])):
            assert_bitwise(ours, theirs, f"2x2 inductor {label} step {step} vs keep")
    assert out["keep"]["reshard_to"] == dict.fromkeys(["", "blocks.0", "blocks.1", "blocks.2"], 1)
    assert out["node"]["reshard_to"] == dict.fromkeys(["", "blocks.0", "blocks.1", "blocks.2"], 2)
    assert out["mixed"]["reshard_to"] == {"": 4, "blocks.0": 2, "blocks.1": 1, "blocks.2": 2}
    assert out["keep"]["backward_gathers"] == {}
    assert out["node"]["backward_gathers"] == dict.fromkeys(["<root>", "blocks.0", "blocks.1", "blocks.2"], 2)
    assert out["mixed"]["backward_gathers"] == {"<root>": 4, "blocks.0": 2, "blocks.2": 2}
    # Forward keeps half of each parameter of a unit resharded to 2 ranks, and no piece of the others.
    kept = out["mixed"]["kept_rows"]
    assert {name.split(".")[1] for name in kept} == {"0", "2"}, sorted(kept)
    assert all(rows == -(-full_rows // 2) for rows, full_rows in kept.values()), kept
    assert "reshard after forward: blocks.1 keeps its gathered parameters" in out["mixed"]["report"]


@pytest.mark.slow  # 16 s: options beyond the defaults; FULL_SHARD takes them at world 2 and 2 x 2 by default
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "SHARD_GRAD_OP"])
def test_hybrid_and_zero2_take_per_unit_settings(strategy: str) -> None:
    # HYBRID_SHARD's shard group is a node of 2 here: True or False per unit. SHARD_GRAD_OP keeps
    # every unit by default; a unit set to True reshards and gathers again in backward.
    setting = {"blocks.0": False} if strategy == "HYBRID_SHARD" else {"blocks.0": True}
    out = run_workers(reshard_worker, 4 if strategy == "HYBRID_SHARD" else 2, strategy, [("one", setting)],
                      "aot_eager")[0]
    _assert_same_sums(out, strategy)
    gathered = out["one"]["backward_gathers"]
    if strategy == "HYBRID_SHARD":
        assert gathered == {"<root>": 2, "blocks.1": 2, "blocks.2": 2}
    else:
        assert out["strategy"]["backward_gathers"] == {} and gathered == {"blocks.0": 2}


def bad_values_worker(rank: int, world: int) -> dict:
    def shard(strategy: str = "FULL_SHARD", **options):
        return lambda: fsdp_compile.backend(strategy, **options).shard(GPT(TEST_CONFIG))
    return {
        "not_dividing": expect_error(shard(reshard_after_forward=3)),
        "whole_group": expect_error(shard(reshard_after_forward=4)),
        "one": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", reshard_after_forward=1)),
        "text": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", reshard_after_forward="yes")),
        "no_shard": expect_error(lambda: fsdp_compile.backend("NO_SHARD", reshard_after_forward=False)),
        "unknown_unit": expect_error(shard(reshard_after_forward={"blocks.9": False})),
        "not_a_unit": expect_error(shard(reshard_after_forward={"blocks.0.attn": False})),
        "bytes_policy": expect_error(lambda: fsdp_compile.backend("FULL_SHARD", bucket=1 << 20,
                                                                   reshard_after_forward={"blocks.0": False})),
        "unit_value": expect_error(shard(reshard_after_forward={"blocks.0": 3})),
    }


def test_bad_values_name_the_unit_and_the_rule() -> None:
    errors = run_workers(bad_values_worker, 4)[0]
    assert "reshard_after_forward=3 for unit '<root>'" in errors["not_dividing"]
    assert "must divide the shard group's 4 ranks" in errors["not_dividing"]
    assert "reshard_after_forward=4 for unit '<root>'" in errors["whole_group"]
    assert "True reshards to all 4" in errors["whole_group"]
    assert "value 1" in errors["one"] and "an int n >= 2" in errors["one"]
    assert "value 'yes'" in errors["text"]
    assert "NO_SHARD keeps every parameter whole" in errors["no_shard"]
    assert "names 'blocks.9', which is not a bucket unit" in errors["unknown_unit"]
    assert "'blocks.0.attn', which is not a bucket unit" in errors["not_a_unit"]
    assert "which bucket= sizes in bytes or per parameter do not have" in errors["bytes_policy"]
    assert "reshard_after_forward=3 for unit 'blocks.0'" in errors["unit_value"]
