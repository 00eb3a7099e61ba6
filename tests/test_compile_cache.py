"""Warm restarts through the compile cache (fsdp_compile.compilation.cache), both directions.

A restarted job (new processes) with the same model, strategy, world, groups, options and
package version loads its compiled graphs and trains bit for bit as the first job did; any
change that changes what our passes produce misses. Inductor compiles are expensive on CPU:
the default run has one cold/warm pair on a tiny model, a dumping run over the warm cache, two
aot_eager runs (which no cache serves) and key and bad-input checks without compiling; every
change compiled end to end is under ``-m slow``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn

import fsdp_compile
from fsdp_compile.sharding.compile_regions import regions_supported

CHANGES = ["strategy", "bucket", "mixed_precision", "schedule", "regions", "version", "user_pass"]
# Options that change what the passes produce and are checked through the key alone (no compile).
KEY_CHANGES = ["offload", "prefetch", "max_inflight_bytes", "forward_prefetch", "backward_prefetch",
               "disable_passes"]
# regions=False changes what the passes produce only on a torch that compiles regions at all
# (regions_supported(): torch >= 2.13); on an older one every block is inlined either way.
REGIONS_CHANGE_THE_PASSES = regions_supported()


class TinyNet(nn.Module):
    """Small enough for a quick Inductor compile; dim 0 of 5 and 3 split unevenly over 2 ranks
    (rank-dependent local shards, the case AOTAutograd's own key does not tell apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 5)
        self.proj = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.proj(self.head(x))


class UuidPass:
    """A user pass that leaves the graph as it is, keyed by ``tag``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        return None

    def uuid(self) -> str:
        return self.tag


def noop_pass(gm: torch.fx.GraphModule) -> None:
    return None


def backend_options(change: str) -> tuple[str, dict[str, Any]]:
    """(strategy, options) of the baseline run or of one change to it."""
    strategy, options = "FULL_SHARD", {}
    if change == "strategy":
        strategy = "SHARD_GRAD_OP"
    elif change == "bucket":
        options["bucket"] = "param"
    elif change == "mixed_precision":
        options["mixed_precision"] = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    elif change == "schedule":
        options["schedule"] = False
    elif change == "regions":
        options["regions"] = False
    elif change == "offload":
        options["offload"] = fsdp_compile.CPUOffload()
    elif change == "prefetch":
        options["prefetch"] = 2
    elif change == "max_inflight_bytes":
        options["max_inflight_bytes"] = 1 << 20
    elif change == "forward_prefetch":
        options["forward_prefetch"] = {"blocks.0": ["blocks.1"]}
    elif change == "backward_prefetch":
        options["backward_prefetch"] = {"blocks.1": ["blocks.0"]}
    elif change == "disable_passes":
        options["disable_passes"] = ["schedule_collectives"]
    elif change == "user_pass":
        options["passes"] = {"backward": [UuidPass("a")]}
    elif change == "user_pass_changed":
        options["passes"] = {"backward": [UuidPass("b")]}
    elif change == "user_pass_without_uuid":
        options["passes"] = {"backward": [noop_pass]}
    return strategy, options


def cache_run(rank: int, world: int, cache_dir: str, change: str = "", steps: int = 2) -> dict:
    """Train TinyNet for ``steps`` SGD steps under Inductor with ``cache_dir``; report what the
    cache did and everything a bitwise comparison needs."""
    if change == "version":
        fsdp_compile.api.__version__ = fsdp_compile.api.__version__ + "+test"
    torch.manual_seed(0)
    model = TinyNet()
    strategy, options = backend_options(change)
    compiler = "aot_eager" if change == "aot_eager" else "inductor"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = fsdp_compile.backend(strategy, compiler=compiler, cache_dir=cache_dir, **options)
        backend.shard(model)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, grads = [], []
        for _ in range(steps):
            x = torch.randn(4, 8, generator=gen)
            # In fp32 whatever the compute dtype (torch 2.11's mse_loss backward rejects a bf16
            # input beside an fp32 target).
            loss = F.mse_loss(compiled(x).float(), torch.zeros(4, 3))
            loss.backward()
            grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    key, _, _ = backend.compiler.cache_key()
    return {"key": key, "cache": [g.cache for g in backend.graphs], "stats": dict(backend.cache_stats),
            "losses": losses, "grads": grads,
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "warnings": [str(w.message) for w in caught if "fsdp_compile" in str(w.message)],
            "report": backend.report(), "lowered": [g.forward is not None for g in backend.graphs]}


def aot_eager_twice(rank: int, world: int, cache_dir: str) -> list[dict]:
    """Two aot_eager compiles of the same model in one process with ``cache_dir``: the second is
    where a cache the first had written would be read."""
    return [cache_run(rank, world, cache_dir, "aot_eager") for _ in range(2)]


def cache_keys(rank: int, world: int, changes: list[str]) -> dict[str, str | None]:
    """The compile-cache key each change gives (no compile), with a fresh model each time."""
    keys = {}
    for change in changes:
        if change == "version":
            saved = fsdp_compile.api.__version__
            fsdp_compile.api.__version__ = saved + "+test"
        torch.manual_seed(0)
        model = TinyNet()
        strategy, options = backend_options(change)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend = fsdp_compile.backend(strategy, compiler="inductor", **options)
            backend.shard(model)
            key, _, _ = backend.compiler.cache_key()
        keys[change or "baseline"] = key
        if change == "version":
            fsdp_compile.api.__version__ = saved
    return keys


def assert_same_training(a: dict, b: dict) -> None:
    for step, (la, lb) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert torch.equal(la, lb), f"loss of step {step} differs"
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"gradient of {name} differs at step {step}"
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"parameter {name} differs"


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    cache = tmp_path_factory.mktemp("compile_cache")
    cold = run_workers(cache_run, 2, str(cache), fresh=True)
    warm = run_workers(cache_run, 2, str(cache), fresh=True)
    return cold, warm, cache


def test_restart_loads_the_compilation_and_trains_bitwise_equal(cold_and_warm) -> None:
    cold, warm, cache = cold_and_warm
    for rank in range(2):
        assert cold[rank]["cache"] == ["miss"], cold[rank]
        assert warm[rank]["cache"] == ["hit"], warm[rank]
        # Uneven shards: each rank has its own entry, and loads its own (AOTAutograd's key
        # alone would hand one rank the other's graph).
        assert_same_training(cold[rank], warm[rank])
        assert "loaded from the compile cache" in warm[rank]["report"]
        assert "forward:" in cold[rank]["report"] and "forward:" not in warm[rank]["report"]
    assert (cache / "fsdp_compile_cache.json").exists()


@pytest.mark.slow  # a third fresh two-rank run, Inductor compiling
def test_dumping_reads_no_cache_entry(cold_and_warm, tmp_path: Path) -> None:
    # The warm cache holds this very compilation, which the warm run loaded; a dumping run must
    # compile instead (a hit runs no passes, so it would dump no graph) and train the same.
    cold, warm, cache = cold_and_warm
    dump = tmp_path / "dump"
    out = run_workers(cache_run, 2, str(cache), env={"FSDP_COMPILE_DUMP": str(dump)}, fresh=True)
    for rank in range(2):
        assert warm[rank]["cache"] == ["hit"]
        (state,) = out[rank]["cache"]
        assert state.startswith("off: dumping graphs"), state
        assert out[rank]["stats"] == {"hits": 0, "misses": 0, "off": 1}, out[rank]["stats"]
        assert out[rank]["lowered"] == [True]  # the passes ran: the lowered forward exists
        assert_same_training(cold[rank], out[rank])
        # What a hit would have left out: each phase's graph after every pass.
        for phase in ("forward", "backward"):
            passes = sorted(p.name for p in (dump / f"rank{rank}" / "graph0" / phase).glob("*.py"))
            assert passes and passes[0] == "00_partitioned.py", (phase, passes)


def test_only_inductor_is_cached(tmp_path: Path) -> None:
    # aot_eager with cache_dir=: no lookup and no entry, so the second compile in the same
    # process (where an entry the first wrote would be read) runs the passes again.
    cache = tmp_path / "cache"
    runs = run_workers(aot_eager_twice, 2, str(cache), fresh=True)
    for rank_runs in runs:
        for out in rank_runs:
            assert out["cache"] == [""], out["cache"]
            assert out["stats"] == {"hits": 0, "misses": 0, "off": 0}, out["stats"]
            assert out["lowered"] == [True]
            assert "loaded from the compile cache" not in out["report"]
        assert_same_training(*rank_runs)
    # Nothing but the directory's version manifest: no AOTAutograd or Inductor entry, and no
    # collective sequence, which a compile writes beside an entry it stores.
    assert sorted(p.name for p in cache.iterdir()) == ["fsdp_compile_cache.json"]


def test_every_change_that_changes_the_passes_changes_the_key() -> None:
    keys = run_workers(cache_keys, 2, ["", "", *CHANGES, *KEY_CHANGES, "user_pass_changed",
                                       "user_pass_without_uuid"])
    for rank_keys in keys:
        baseline = rank_keys["baseline"]
        assert baseline is not None
        # Where regions are not compiled, regions=False is the baseline's compilation: the same
        # key is right there (a hit on the same graphs), and a different one a needless miss.
        assert (rank_keys["regions"] != baseline) == REGIONS_CHANGE_THE_PASSES, rank_keys
        others = [k for name, k in rank_keys.items()
                  if name != "baseline" and (name != "regions" or REGIONS_CHANGE_THE_PASSES)]
        assert len(set(others)) == len(others), rank_keys
        assert baseline not in others
    # The ranks hold different (uneven) shards: their keys differ.
    assert keys[0]["baseline"] != keys[1]["baseline"]


def group_keys(rank: int, world: int) -> dict[str, str]:
    """The key of rank 0's FULL_SHARD over a group of two, at world 4: paired with rank 1, and
    paired with rank 2 (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    keys = {}
    for layout, pairs in (("pairs_01", ([0, 1], [2, 3])), ("pairs_02", ([0, 2], [1, 3]))):
        groups = [dist.new_group(ranks) for ranks in pairs]
        mine = next(g for g, ranks in zip(groups, pairs) if rank in ranks)
        torch.manual_seed(0)
        model = TinyNet()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend = fsdp_compile.backend("FULL_SHARD", compiler="inductor", process_groups=mine)
            backend.shard(model)
            keys[layout], _, _ = backend.compiler.cache_key()
    return keys


def test_group_layout_and_world_size_change_the_key() -> None:
    # Rank 0 holds the same shards (TinyNet over a group of two) in all three runs: only the
    # group's members or the world size differ.
    at_4 = run_workers(group_keys, 4)[0]
    at_2 = run_workers(cache_keys, 2, [""])[0]["baseline"]
    assert at_4["pairs_01"] != at_4["pairs_02"]
    assert at_4["pairs_01"] != at_2


def test_same_configuration_gives_the_same_key_in_another_process(cold_and_warm) -> None:
    # The cold and the warm run are two fresh processes per rank with the same configuration.
    cold, warm, _ = cold_and_warm
    for rank in range(2):
        assert cold[rank]["key"] is not None
        assert cold[rank]["key"] == warm[rank]["key"], rank


def test_unwritable_cache_dir_warns_and_compiles_cold(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match=r"cache_dir=.*cannot be written.*cold"):
        backend = fsdp_compile.backend("FULL_SHARD", cache_dir=blocker / "cache")
    assert not backend.cache_state.enabled
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(blocker / "cache")


def test_cache_dir_of_another_version_warns(tmp_path: Path) -> None:
    (tmp_path / "fsdp_compile_cache.json").write_text(json.dumps({"fsdp_compile": "0.0.1", "torch": "1.0"}))
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        with pytest.warns(RuntimeWarning, match=r"another version.*fsdp_compile 0\.0\.1.*never reused"):
            backend = fsdp_compile.backend("FULL_SHARD", cache_dir=tmp_path)
        assert backend.cache_state.enabled
        assert json.loads((tmp_path / "fsdp_compile_cache.json").read_text())["fsdp_compile"] == fsdp_compile.__version__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fsdp_compile.backend("FULL_SHARD", cache_dir=tmp_path)  # now it is this version's
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def test_bad_cache_dir_argument_is_named() -> None:
    with pytest.raises(TypeError, match="cache_dir="):
        fsdp_compile.backend("FULL_SHARD", cache_dir=3)


@pytest.mark.slow
@pytest.mark.parametrize("change", [
    pytest.param(c, marks=pytest.mark.skipif(c == "regions" and not REGIONS_CHANGE_THE_PASSES,
                                             reason="this torch compiles no regions"))
    for c in CHANGES])
def test_each_change_misses_end_to_end(cold_and_warm, change: str) -> None:
    _, _, cache = cold_and_warm
    out = run_workers(cache_run, 2, str(cache), change, fresh=True)
    for rank in range(2):
        assert out[rank]["cache"] == ["miss"], (change, out[rank])


@pytest.mark.slow
def test_world_size_change_misses(cold_and_warm) -> None:
    _, _, cache = cold_and_warm
    out = run_workers(cache_run, 4, str(cache), fresh=True)
    assert all(r["cache"] == ["miss"] for r in out), out


@pytest.mark.slow
def test_user_pass_without_uuid_turns_the_cache_off_with_a_warning(cold_and_warm) -> None:
    _, _, cache = cold_and_warm
    out = run_workers(cache_run, 2, str(cache), "user_pass_without_uuid", fresh=True)
    for rank in range(2):
        (state,) = out[rank]["cache"]
        assert state.startswith("off: user pass") and "uuid()" in state, state
        assert any("compile cache off" in w for w in out[rank]["warnings"]), out[rank]["warnings"]


@pytest.mark.slow
def test_unwritable_cache_dir_still_trains_like_the_cached_run(cold_and_warm, tmp_path: Path) -> None:
    cold, _, _ = cold_and_warm
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = run_workers(cache_run, 2, str(blocker / "cache"), fresh=True)
    for rank in range(2):
        assert out[rank]["cache"][0].startswith("off: cache_dir="), out[rank]["cache"]
        assert any("cannot be written" in w for w in out[rank]["warnings"])
        assert_same_training(cold[rank], out[rank])
