"""Blocks torch cannot compile as one region run inline, and train as without regions.

Each block written the way other people write them (``model_zoo.py``) is compiled with regions
(``aot_eager``, ``regions=2``: three copies) and without, and must train bit for bit alike,
with one warning naming the class and the cause, and nothing compiled as a region for it. A
block that returns one of its inputs (T5's position bias) stays a region. An error that is not
the regions' is the user's to see, as without them; a function the user compiles around the
model compiles it whole, as before. A block refused after part of the step ran is not retried.
Under ``strict=True`` (the suite's default) only torch's refusals of a region are retried
inline: anything else (an Inductor error) raises. The Inductor defaults on these and on Hugging
Face models: ``test_model_zoo.py``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from distributed import run_workers
from helpers import assert_bitwise, compiled_regions, full
from model_zoo import VOCAB, BatchNormBlock, BlockStack, CountingBlock, GraphBreakBlock

import fsdp_compile
from fsdp_compile.passes.regions import inline_mutating_regions, is_region_call
from fsdp_compile.sharding import compile_regions as region_module
from fsdp_compile.sharding.compile_regions import (
    ModelRegions,
    RegionFallback,
    describe_failure,
    refused_by_torch,
    regions_supported,
)

pytestmark = pytest.mark.skipif(not regions_supported(), reason="this torch compiles no regions")

STEPS = 2
BLOCKS = {"batchnorm": BatchNormBlock, "buffer_update": CountingBlock, "graph_break": GraphBreakBlock}
# Why each is refused, as the warning says it, and when: while AOTAutograd traces (decided on
# the captured graph), or while Dynamo traces (the call is retried).
CAUSES = {"batchnorm": "update an input in place", "buffer_update": "aliases one of its inputs",
          "graph_break": "a graph break inside the block"}


class PassingBlock(torch.nn.Module):
    """T5's shape: returns the bias it was given beside its output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.tanh(self.fc(x) + bias), bias


class ResidualBlock(torch.nn.Module):
    """A block torch compiles as a region."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class PassingStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.bias = torch.nn.Parameter(torch.randn(16))
        self.blocks = torch.nn.ModuleList(PassingBlock(16) for _ in range(3))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, bias = self.embed(tokens), self.bias * 2
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.head(h)


def _model(name: str) -> torch.nn.Module:
    return PassingStack() if name == "passing" else BlockStack(BLOCKS[name])


def _train(model: torch.nn.Module, forward: Any, data: torch.Tensor) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = None
    for step in range(STEPS):
        logits = forward(data[step])
        F.cross_entropy(logits[:, :-1].flatten(0, 1), data[step][:, 1:].flatten()).backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": {n: full(p) for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def _sharded(base: torch.nn.Module, regions: int | bool) -> tuple[torch.nn.Module, fsdp_compile.FSDPBackend]:
    """A fresh FULL_SHARD copy of ``base`` under aot_eager, with regions or without."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=regions)
    backend.shard(model)
    return model, backend


def _record_fallback(run: dict, caught: list, backend: fsdp_compile.FSDPBackend) -> None:
    """What a run tells of blocks compiled inline: the warnings, the inlined classes, region calls."""
    run["warnings"] = [str(w.message) for w in caught if "compile inline" in str(w.message)]
    run["inlined"] = {c.name: c.reason for c in backend._state.region_fallback.inlined()}
    run["region_calls"] = compiled_regions(backend)[0]


def fallback_worker(rank: int, world: int, name: str) -> dict:
    torch.manual_seed(0)
    base = _model(name)
    data = torch.randint(0, VOCAB, (STEPS, 2, 8), generator=torch.Generator().manual_seed(1 + rank))
    out: dict[str, Any] = {}
    for regions in (2, False):
        model, backend = _sharded(base, regions)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _train(model, torch.compile(model, backend=backend), data)
        _record_fallback(run, caught, backend)
        run["report"] = backend.report()
        out[regions] = run
    return out


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_a_block_torch_refuses_compiles_inline_with_one_warning(name: str) -> None:
    out = run_workers(fallback_worker, 2, name)
    for rank, runs in enumerate(out):
        with_regions, without = runs[2], runs[False]
        for what in ("grads", "params", "buffers"):
            assert_bitwise(with_regions[what], without[what], f"{name} rank {rank} {what}: regions vs none")
        cls = BLOCKS[name].__name__
        assert list(with_regions["inlined"]) == [cls] and CAUSES[name] in with_regions["inlined"][cls]
        assert with_regions["region_calls"] == 0
        assert f"{cls} blocks compile inline, not as one region: " in with_regions["report"]
        # One warning, on rank 0 only (every rank logs it), naming the class, its blocks and why.
        expected = 1 if rank == 0 else 0
        assert len(with_regions["warnings"]) == expected, with_regions["warnings"]
        if expected:
            (warning,) = with_regions["warnings"]
            assert f"the {cls} blocks (blocks.0, blocks.1, blocks.2) compile inline" in warning
            assert CAUSES[name] in warning and "regions=False" in warning
        assert without["warnings"] == [] and without["inlined"] == {}
    if name == "buffer_update":  # the in-place update happened, once per block call
        assert all(runs[2]["buffers"][f"blocks.{i}.calls"].item() == STEPS for runs in out for i in range(3))


def test_a_block_returning_its_input_stays_a_region() -> None:
    # The body hands back a reference to the bias instead of the bias (which would alias its
    # input); the call site returns the bias itself.
    runs = run_workers(fallback_worker, 2, "passing")[0]
    assert runs[2]["region_calls"] > 0 and runs[2]["inlined"] == {} and runs[2]["warnings"] == []
    for what in ("grads", "params"):
        assert_bitwise(runs[2][what], runs[False][what], f"passing {what}: regions vs none")


class BrokenStack(BlockStack):
    """A model whose own code is wrong (a shape error), with blocks that are fine regions."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h.t())


def users_error_worker(rank: int, world: int, strict: bool) -> dict:
    torch.manual_seed(0)
    model = BrokenStack(ResidualBlock)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=2, strict=strict)
    backend.shard(model)
    try:
        torch.compile(model, backend=backend)(torch.randint(0, VOCAB, (2, 8)))
    except Exception as exc:
        notes = getattr(exc, "__notes__", [])
        return {"error": f"{type(exc).__name__}: {exc}", "notes": notes,
                "inlined": [c.name for c in backend._state.region_fallback.inlined()]}
    return {"error": None}


@pytest.mark.parametrize("strict", [False, True], ids=["retried", "strict"])
def test_an_error_that_is_not_the_regions_is_raised_as_without_them(strict: bool) -> None:
    out = run_workers(users_error_worker, 2, strict)[0]
    assert out["error"] is not None and "size" in out["error"], out["error"]
    assert out["inlined"] == []  # the classes tried inline went back to regions, or were never turned off
    if strict:  # not a refusal of torch's: raised at once, saying so
        assert len(out["notes"]) == 1 and "strict=True" in out["notes"][0], out["notes"]
        assert "ResidualBlock" in out["notes"][0] and "not retried" in out["notes"][0], out["notes"]
    else:
        assert any("failed too" in note for note in out["notes"]), out["notes"]


def nested_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = BlockStack(ResidualBlock)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=2)
    backend.shard(model)
    tokens = torch.randint(0, VOCAB, (2, 8))

    def loss_fn(t: torch.Tensor) -> torch.Tensor:
        return model(t).logsumexp(-1).mean()

    loss = torch.compile(loss_fn, backend=backend, fullgraph=True)(tokens)
    loss.backward()
    return {"graphs": len(backend.graphs), "regions": compiled_regions(backend),
            "inlined": [c.name for c in backend._state.region_fallback.inlined()]}


def test_a_function_compiled_around_the_model_compiles_it_whole() -> None:
    # The model's call catches what compiling it raises when torch.compile starts there; called
    # from a function being compiled, it is traced like any code: one graph (fullgraph=True would
    # raise at a break), and in it the three blocks' calls of one region body.
    out = run_workers(nested_worker, 2)[0]
    assert out["graphs"] == 1, out
    assert out["regions"] == (3, 1) and out["inlined"] == [], out


_BEFORE_THE_BLOCKS = [0]  # calls of the code before the blocks, in this process


@torch.compiler.disable
def _counted(x: torch.Tensor) -> torch.Tensor:
    _BEFORE_THE_BLOCKS[0] += 1
    return x


class SplitStack(BlockStack):
    """A graph break before the blocks (a call torch.compile skips, counting its calls): the
    blocks compile in a later frame than the embedding, after it ran."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = _counted(self.embed(tokens))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def split_step_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = SplitStack(GraphBreakBlock)
    data = torch.randint(0, VOCAB, (STEPS, 2, 8), generator=torch.Generator().manual_seed(1 + rank))
    out: dict[str, Any] = {}
    for regions in (2, False):
        model, backend = _sharded(base, regions)
        forward = torch.compile(model, backend=backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if regions:
                _BEFORE_THE_BLOCKS[0] = 0
                try:
                    forward(data[0])
                except Exception as exc:
                    out["first_call"] = {"error": f"{type(exc).__name__}: {exc}", "notes": getattr(exc, "__notes__", []),
                                         "ran_before_the_blocks": _BEFORE_THE_BLOCKS[0]}
            run = _train(model, forward, data)
        _record_fallback(run, caught, backend)
        out[regions] = run
    return out


def test_a_block_refused_after_part_of_the_step_ran_is_not_retried() -> None:
    # docs/limits.md: the first call raises, with a note, having run the code before the blocks
    # once (a retry would run it twice); later calls compile the blocks inline and train as
    # without regions.
    out = run_workers(split_step_worker, 2)
    for rank, runs in enumerate(out):
        first = runs.get("first_call")
        assert first is not None, f"rank {rank}: the first call did not raise"
        assert "graph break" in first["error"], first["error"]
        assert first["ran_before_the_blocks"] == 1, first
        (note,) = first["notes"]
        assert "GraphBreakBlock blocks as one region, after part of this step had run" in note, note
        assert "later calls compile those blocks inline" in note, note
        with_regions, without = runs[2], runs[False]
        assert list(with_regions["inlined"]) == ["GraphBreakBlock"]
        assert "after part of the step had run" in with_regions["inlined"]["GraphBreakBlock"]
        assert with_regions["region_calls"] == 0
        assert len(with_regions["warnings"]) == (1 if rank == 0 else 0), with_regions["warnings"]
        for what in ("grads", "params"):
            assert_bitwise(with_regions[what], without[what], f"rank {rank} {what}: regions vs none")


def _model_regions(strict: bool) -> tuple[ModelRegions, Any]:
    fallback = RegionFallback(strict=strict)
    region_class = fallback.region_class(ResidualBlock, ["blocks.0", "blocks.1"])
    return ModelRegions([region_class], fallback), region_class


def _inductor_error() -> BaseException:
    from torch._inductor.exc import InductorError

    return InductorError(RuntimeError("a lowering failed on the region's graph"), None)


def _refusals() -> dict[str, BaseException]:
    """What torch raised for the zoo's refused blocks (GraphBreakBlock, CountingBlock), shortened."""
    from torch._dynamo.exc import InternalTorchDynamoError, UncapturedHigherOrderOpError

    return {
        "graph_break": UncapturedHigherOrderOpError(
            "This higher order operator doesn't work unless it is captured completely with torch.compile. "
            "Got graph break/error:\n\nSkip calling `torch.compiler.disable()`d function"),
        "alias": InternalTorchDynamoError(
            "RuntimeError: An intermediate tensor 'iadd' created inside a higher-order op subgraph aliases an "
            "input or output, so it was not included in the subgraph outputs."),
    }


def test_only_torchs_refusals_of_a_region_are_told_apart() -> None:
    assert all(refused_by_torch(error) for error in _refusals().values())
    # The heading Dynamo gives any error inside a region body does not make one a refusal.
    assert not refused_by_torch(RuntimeError("Got graph break/error: an assertion inside torch"))
    assert not refused_by_torch(_inductor_error())
    wrapped = RuntimeError("raised while handling a refusal")
    wrapped.__context__ = _refusals()["graph_break"]
    assert not refused_by_torch(wrapped)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("cause", ["graph_break", "alias", "inductor"])
def test_strict_retries_only_torchs_refusals(strict: bool, cause: str) -> None:
    regions, region_class = _model_regions(strict)
    error = _refusals()[cause] if cause != "inductor" else _inductor_error()
    attempt = regions.begin()
    if strict and cause == "inductor":
        with pytest.raises(type(error)) as raised:
            regions.failed(attempt, error)
        assert region_class.enabled and region_class.reason is None  # no class was turned off
        (note,) = raised.value.__notes__
        assert "strict=True" in note and "ResidualBlock" in note and "not retried" in note, note
    else:  # the class goes inline and the call is tried again
        regions.failed(attempt, error)
        assert not region_class.enabled and region_class.reason is not None


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_strict_keeps_a_region_an_unexplained_error_hit_after_part_of_the_step_ran(strict: bool) -> None:
    regions, region_class = _model_regions(strict)
    attempt = regions.begin()
    region_module._tracing_region(region_class.key)  # what Dynamo runs as it traces the region
    regions.fallback.graph_runs += 1  # a graph of the step ran before the error
    error = _inductor_error()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(type(error)):
            regions.failed(attempt, error)
    (note,) = error.__notes__
    if strict:
        assert region_class.enabled and caught == [], caught
        assert "strict=True" in note and "stay regions" in note, note
    else:
        assert not region_class.enabled and "later calls compile those blocks inline" in note, note
        assert len([w for w in caught if "compile inline" in str(w.message)]) == 1


def region_inductor_error_worker(rank: int, world: int, strict: bool) -> dict:
    """Inductor made to fail on every graph that calls a region (its post-grad pass hook): an
    error torch's rules for regions do not explain."""
    import torch._inductor.config as inductor_config

    def fail_on_regions(graph: fx.Graph) -> None:
        if any(is_region_call(node) for node in graph.nodes):
            raise RuntimeError("an Inductor pass failed on a graph with regions")

    torch.manual_seed(0)
    model = BlockStack(ResidualBlock)
    backend = fsdp_compile.backend("FULL_SHARD", regions=2, strict=strict)
    backend.shard(model)
    out: dict[str, Any] = {"error": None, "notes": []}
    with inductor_config.patch(post_grad_custom_post_pass=fail_on_regions), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.compile(model, backend=backend)(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        except Exception as exc:
            out.update(error=f"{type(exc).__name__}: {exc}", notes=getattr(exc, "__notes__", []))
    out["inlined"] = {c.name: c.reason for c in backend._state.region_fallback.inlined()}
    out["warnings"] = [str(w.message) for w in caught if "compile inline" in str(w.message)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_an_inductor_error_on_regions_raises_under_strict(strict: bool) -> None:
    out = run_workers(region_inductor_error_worker, 2, strict)[0]
    if strict:
        assert out["error"] is not None and "an Inductor pass failed" in out["error"], out["error"]
        assert out["inlined"] == {} and out["warnings"] == []
        assert any("strict=True" in note for note in out["notes"]), out["notes"]
    else:  # compiled inline, and the warning quotes Inductor's error
        assert out["error"] is None, out["error"]
        assert list(out["inlined"]) == ["ResidualBlock"], out["inlined"]
        (warning,) = out["warnings"]
        assert "an Inductor pass failed" in warning, warning


def _captured(model: torch.nn.Module, x: torch.Tensor) -> fx.GraphModule:
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    # Running a captured region that writes an input under autograd raises: what the pass avoids.
    with contextlib.suppress(RuntimeError):
        torch.compile(model, backend=capture)(x)
    return graphs[0]


class _Regions(torch.nn.Module):
    def __init__(self, block: type[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(block(8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = _region(block, x)
        return x


@torch.compiler.nested_compile_region
def _region(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


@pytest.mark.parametrize("grad", [True, False])
def test_inline_mutating_regions_inlines_bodies_that_write_an_input_while_training(grad: bool) -> None:
    # The pass runs in the grad mode Dynamo traced in (the backend is called in it).
    torch._dynamo.reset()
    x = torch.randn(4, 8, requires_grad=True)
    mutating = _captured(_Regions(BatchNormBlock), x)
    plain = _captured(_Regions(ResidualBlock), x)
    assert sum(map(is_region_call, mutating.graph.nodes)) == 2
    with torch.set_grad_enabled(grad):
        found = inline_mutating_regions(mutating)
        assert inline_mutating_regions(plain) == [] and sum(map(is_region_call, plain.graph.nodes)) == 2
    if grad:  # BatchNorm writes its running statistics: AOTAutograd could not differentiate the call
        (inlined,) = found
        assert inlined.block_class is None  # called from a function, not from a module's forward
        assert "running" in inlined.written or "num_batches" in inlined.written, inlined.written
        assert not any(map(is_region_call, mutating.graph.nodes))
        assert any("batch_norm" in str(n.target) for n in mutating.graph.nodes)
    else:  # without gradients a region may write its inputs: kept
        assert found == [] and sum(map(is_region_call, mutating.graph.nodes)) == 2


def test_the_warning_says_what_torch_refused_in_plain_words() -> None:
    graph_break = RuntimeError("This higher order operator doesn't work unless it is captured completely with "
                               "torch.compile. Got graph break/error:\n\nSkip calling `torch.compiler.disable()`d "
                               "function\n  Explanation: ...")
    assert describe_failure(graph_break) == (
        "a graph break inside the block (a torch.compiler.disable'd call, a data-dependent branch) "
        "(RuntimeError: Skip calling `torch.compiler.disable()`d function)")
    alias = RuntimeError("An intermediate tensor 'iadd' created inside a higher-order op subgraph aliases an input "
                         "or output, so it was not included in the subgraph outputs. " + "x" * 300)
    text = describe_failure(alias)
    assert text.startswith("the block keeps a tensor that aliases one of its inputs") and text.endswith("...)")
    assert describe_failure(ValueError("something else")) == "ValueError: something else"
