"""The default policy (bucket="module") in every common model layout, and the warning when a
bucket defeats sharding.

One 2-rank FULL_SHARD run (aot_eager) trains each layout of tests/layouts.py with the default
buckets and with the unbucketed eager runtime on the same data; the tests check the units chosen,
that each forward all-gather carries exactly one unit, and bitwise equal training.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import TEST_CONFIG, assert_bitwise, batches, train
from layouts import (
    EXPECTED_UNITS,
    LAYOUTS,
    VOCAB,
    Block,
    ListLM,
    NoRepeatLM,
)
from torch import nn

from fsdp_compile.api import parse_policy
from fsdp_compile.inspection.bucket_advice import oversized_bucket
from fsdp_compile.passes.lowering import unit_label
from fsdp_compile.sharding.units import repeated_classes, unit_modules, unit_of

WORLD = 2
STEPS = 3
FITTING = [name for name in LAYOUTS if name != "no_repeats"]
# Every layout of docs/buckets.md's table trains by default; T5's twin stacks (the same blocks as the
# encoder-decoder's, found through another rule that test_default_units covers) with -m slow.
DEFAULT_RUN = [name for name in LAYOUTS if name != "twin_stacks"]
TRAINED = [name if name in DEFAULT_RUN else pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_units(layout: str) -> None:
    units = unit_modules(LAYOUTS[layout](), parse_policy("module"))
    assert sorted(units) == sorted(EXPECTED_UNITS[layout])


def test_the_test_gpt_keeps_its_buckets() -> None:
    from fsdp_compile.models.gpt import GPT

    assert unit_modules(GPT(TEST_CONFIG), parse_policy("module")) == {"blocks.0", "blocks.1"}


class SharedBlock(nn.Module):
    """One block registered twice: as ``self.shared`` first, then as a member of the list."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = Block()
        self.layers = nn.ModuleList([Block(), self.shared, Block()])


def test_a_shared_module_counts_where_its_parameters_are_named() -> None:
    # Its parameters are named shared.* (where named_modules() first meets it) and belong to the
    # root; a unit "layers.1" would head a bucket that holds nothing.
    assert unit_modules(SharedBlock(), parse_policy("module")) == {"layers.0", "layers.2"}


class Containers(nn.Module):
    """A container holding two leaf Linears (a Sequential MLP) is a block, not a stage of Linears;
    a container whose composite members differ in class repeats nothing; dicts of blocks are
    stages like lists of them."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2)) for _ in range(2))
        self.mixed = nn.ModuleList([LAYOUTS["module_list"](), NoRepeatLM()])
        self.groups = nn.ModuleDict({key: nn.ModuleDict({"0": Block(), "1": Block()}) for key in "ab"})


def test_containers_are_blocks_only_when_they_hold_no_blocks() -> None:
    units = unit_modules(Containers(), parse_policy("module"))
    assert {"mlps.0", "mlps.1"} <= units
    assert not any(u.startswith("mlps.0.") for u in units)
    # Inside the mixed list the search goes on: the first LM's blocks are found.
    assert {"mixed.0.layers.0", "mixed.0.layers.1", "mixed.0.layers.2"} <= units
    assert "mixed.0" not in units and "mixed.1" not in units
    assert {"groups.a.0", "groups.a.1", "groups.b.0", "groups.b.1"} <= units
    assert "groups.a" not in units


def test_a_policy_that_selects_nothing_lists_the_repeated_classes() -> None:
    model = LAYOUTS["nested_moe"]()
    expected = "its repeated module classes are MoEBlock, Attention, MoE, FeedForward, Embedding, LayerNorm, Linear"
    with pytest.raises(ValueError, match=r"bucket=\{Conv2d\} matches no module of MoELM .*" + expected):
        unit_modules(model, parse_policy({nn.Conv2d}))

    def never(module: nn.Module) -> bool:
        return False
    with pytest.raises(ValueError, match="bucket=never matches no module of MoELM .*" + expected):
        unit_modules(model, parse_policy(never))
    with pytest.raises(ValueError, match="it repeats no module class, so a size in bytes"):
        unit_modules(nn.Sequential(nn.Linear(2, 2)), parse_policy({nn.Conv2d}))


def test_repeated_classes_lists_blocks_before_leaf_layers() -> None:
    assert repeated_classes(LAYOUTS["module_list"]()) == ["Block", "Attention", "FeedForward", "Embedding",
                                                          "LayerNorm", "Linear"]


def _oversized(model: nn.Module, policy) -> object:
    units_set = unit_modules(model, policy)
    units = {fqn: unit_of(fqn.rpartition(".")[0], units_set) for fqn, _ in model.named_parameters()}
    return oversized_bucket(model, units, {fqn: 4 for fqn in units}, policy)


def test_oversized_bucket_names_it_and_what_to_pass() -> None:
    model = NoRepeatLM()
    found = _oversized(model, parse_policy("module"))
    assert found.label == "<root>" and found.share == 1.0
    total_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert found.advice == (
        "bucket='module' found no repeated blocks in it. Pass a set of its classes, e.g. bucket={Embedding, "
        "LayerNorm, Linear} (these repeat in it), or a bucket size in bytes, e.g. "
        f"bucket={-(-total_bytes // 8)} (about 1/8 of the model per bucket).")
    for layout in FITTING:
        assert _oversized(LAYOUTS[layout](), parse_policy("module")) is None, layout
    # A class policy that keeps most of the model in one unit is flagged too.
    found = _oversized(LAYOUTS["module_list"](), parse_policy({nn.Embedding}))
    assert found.label == "<root>" and "bucket={Embedding} leaves it whole" in found.advice


def test_a_parameter_over_half_the_model_is_not_flagged() -> None:
    # Gathered whole under any policy: a warning could suggest nothing.
    model = nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert _oversized(model, parse_policy("module")) is None


# ----------------------------------------------------------------------------- 2 ranks
def padded_unit_bytes(model: nn.Module, unit_of_param: dict[str, str], world: int) -> dict[str, int]:
    """Bytes of each unit's all-gather buffer at ``world`` ranks: its parameters, rows padded."""
    from fsdp_compile.runtime.collectives import padded_rows

    sizes: dict[str, int] = {}
    for fqn, p in model.named_parameters():
        row = p.numel() // p.shape[0] * p.element_size()
        unit = unit_of_param[fqn]
        sizes[unit] = sizes.get(unit, 0) + padded_rows(p.shape[0], world) * world * row
    return sizes


def layout_worker(rank: int, world: int, strategy: str, names: list[str], steps: int) -> dict:
    """Per layout: the eager runtime (no buckets) and aot_eager with the default buckets, trained
    on the same data; what was bucketed and gathered, the warnings and the report."""
    import logging
    import warnings

    import fsdp_compile
    from fsdp_compile.inspection.graphinfo import collectives
    from fsdp_compile.models.gpt import GPTConfig

    data = batches(GPTConfig(vocab_size=VOCAB), world, steps)
    out: dict[str, Any] = {}
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("fsdp_compile").addHandler(handler)
    try:
        for name in names:
            torch.manual_seed(0)
            base = LAYOUTS[name]()
            model = copy.deepcopy(base)
            fsdp_compile.backend(strategy).shard(model)
            eager = train(model, model, data, rank)
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            backend = fsdp_compile.backend(strategy, compiler="aot_eager")
            logged.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                backend.shard(model)
                compiled = train(model, torch.compile(model, backend=backend), data, rank)
            (record,) = backend.graphs
            units = {fqn: info.unit for fqn, info in backend.params.items()}
            out[name] = {
                "eager": eager, "compiled": compiled,
                "units": sorted(backend.units - {""}),
                "gather_buckets": [b.key for b in record.forward_buckets["unshard"]],
                "gather_bytes": [c.buffer_bytes for c in collectives(record.forward) if c.kind == "all_gather"],
                "unit_bytes": padded_unit_bytes(base, units, world),
                "warnings": [str(w.message) for w in caught if "fsdp_compile" in str(w.message)],
                "logged": list(logged),
                "report": backend.report(),
            }
    finally:
        logging.getLogger("fsdp_compile").removeHandler(handler)
    if rank != 0:  # the warnings are all another rank needs to report
        return {name: {"warnings": r["warnings"], "logged": r["logged"]} for name, r in out.items()}
    return out


@functools.cache
def layout_run(names: tuple[str, ...] = tuple(DEFAULT_RUN)) -> list[dict]:
    return run_workers(layout_worker, WORLD, "FULL_SHARD", list(names), STEPS)


def layout_result(layout: str) -> dict:
    # layout_run() as the other tests call it: functools.cache keys on the arguments as given.
    return (layout_run() if layout in DEFAULT_RUN else layout_run((layout,)))[0][layout]


@pytest.mark.parametrize("layout", TRAINED)
def test_default_buckets_per_layout(layout: str) -> None:
    out = layout_result(layout)
    assert out["units"] == sorted(EXPECTED_UNITS[layout])
    labels = sorted(unit or "<root>" for unit in out["unit_bytes"])
    # One bucket per unit, and a second for the root where forward reads it at both ends.
    assert sorted({unit_label(b) for b in out["gather_buckets"]}) == labels
    assert len(out["gather_buckets"]) == len(labels) + ("<root>:tail" in out["gather_buckets"])
    # Each forward all-gather carries one unit's parameters (rows padded for 2 ranks), the root's
    # in one or two, each parameter once ...
    blocks = Counter(size for unit, size in out["unit_bytes"].items() if unit)
    assert blocks <= Counter(out["gather_bytes"])
    assert sum(out["gather_bytes"]) == sum(out["unit_bytes"].values())
    # ... so the largest is at most two blocks plus the root's own parameters.
    assert max(out["gather_bytes"]) <= 2 * max(blocks, default=0) + out["unit_bytes"].get("", 0)


@pytest.mark.parametrize("layout", TRAINED)
def test_default_buckets_train_bitwise_like_the_eager_runtime(layout: str) -> None:
    out = layout_result(layout)
    assert_bitwise(out["compiled"]["grads0"], out["eager"]["grads0"], f"{layout} first-step gradients")
    assert_bitwise(out["compiled"]["params"], out["eager"]["params"], f"{layout} parameters")


def test_only_a_bucket_that_defeats_sharding_warns_once_on_rank_0() -> None:
    rank0, rank1 = layout_run()
    for layout in set(FITTING) & set(DEFAULT_RUN):
        assert rank0[layout]["warnings"] == rank0[layout]["logged"] == [], layout
        assert "!" not in rank0[layout]["report"], layout
    (warning,) = rank0["no_repeats"]["warnings"]
    assert rank0["no_repeats"]["logged"] == [warning]
    assert warning.startswith("fsdp_compile: bucket '<root>' holds 100% of the model's parameters (by element "
                              "count), and FULL_SHARD gathers a bucket whole")
    assert "bucket='module' found no repeated blocks in it. Pass a set of its classes, e.g. bucket={Embedding, LayerNorm, Linear}" in warning
    assert rank1["no_repeats"]["warnings"] == rank1["no_repeats"]["logged"] == []


def test_report_marks_the_oversized_bucket() -> None:
    report = layout_run()[0]["no_repeats"]["report"]
    gathers = [line for line in report.splitlines() if line.strip().startswith("gather <root>")]
    assert gathers and all("! 100% of all parameters" in line for line in gathers)
    explanations = [line.strip() for line in report.splitlines() if line.strip().startswith("! FULL_SHARD")]
    assert len(explanations) == 1
    assert explanations[0].startswith("! FULL_SHARD gathers this bucket whole, so sharding saves little of its "
                                      "memory. bucket='module' found no repeated blocks in it. Pass a set of its classes")


def warning_worker(rank: int, world: int) -> dict:
    """Shard the model without repeats (one bucket) under each strategy, twice per backend:
    which strategies warn, how often, and whether a model that fits its buckets stays quiet."""
    import warnings

    import fsdp_compile

    out: dict[str, list[str]] = {}
    cases = {strategy: NoRepeatLM for strategy in
             ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD_ZERO2")}
    cases["FULL_SHARD, blocks"] = ListLM
    cases["HYBRID_SHARD, shard groups of 1"] = NoRepeatLM  # nothing is sharded, nothing to defeat
    for case, layout in cases.items():
        strategy = case.split(",")[0]
        options = {"shard_size": 1 if "of 1" in case else world} if "HYBRID" in strategy else {}
        backend = fsdp_compile.backend(strategy, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                backend.shard(layout())
        out[case] = [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]
    return out


def test_warning_only_under_resharding_strategies_once_per_backend() -> None:
    rank0, rank1 = run_workers(warning_worker, WORLD)
    assert [len(rank0[case]) for case in rank0] == [1, 1, 0, 0, 0, 0, 0], rank0
    assert "HYBRID_SHARD gathers a bucket whole" in rank0["HYBRID_SHARD"][0]
    assert all(not messages for messages in rank1.values()), rank1
