"""Blocks torch cannot compile as one region run inline, and train as without regions.

Each block written the way other people write them (``model_zoo.py``) is compiled with regions
(``aot_eager``, ``regions=2``: three copies) and without, and must train bit for bit alike,
with one warning naming the class and the cause, and nothing compiled as a region for it. A
block that returns one of its inputs (T5's position bias) stays a region. An error that is not
the regions' is the user's to see, as without them; a function the user compiles around the
model compiles it whole, as before. The Inductor defaults on these and on Hugging Face models:
``test_model_zoo.py``.
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
from fsdp_compile.passes.region_mutations import inline_mutating_regions
from fsdp_compile.passes.regions import is_region_call
from fsdp_compile.sharding.region_fallback import describe_failure
from fsdp_compile.sharding.regions import regions_supported

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


def fallback_worker(rank: int, world: int, name: str) -> dict:
    torch.manual_seed(0)
    base = _model(name)
    data = torch.randint(0, VOCAB, (STEPS, 2, 8), generator=torch.Generator().manual_seed(1 + rank))
    out: dict[str, Any] = {}
    for regions in (2, False):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=regions)
        backend.shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _train(model, torch.compile(model, backend=backend), data)
        run["warnings"] = [str(w.message) for w in caught if "compile inline" in str(w.message)]
        run["inlined"] = {c.name: c.reason for c in backend._state.region_fallback.inlined()}
        run["region_calls"] = compiled_regions(backend)[0]
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


def users_error_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = BrokenStack(ResidualBlock)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", regions=2)
    backend.shard(model)
    try:
        torch.compile(model, backend=backend)(torch.randint(0, VOCAB, (2, 8)))
    except Exception as exc:
        notes = getattr(exc, "__notes__", [])
        return {"error": f"{type(exc).__name__}: {exc}", "notes": notes,
                "inlined": [c.name for c in backend._state.region_fallback.inlined()]}
    return {"error": None}


def test_an_error_that_is_not_the_regions_is_raised_as_without_them() -> None:
    out = run_workers(users_error_worker, 2)[0]
    assert out["error"] is not None and "size" in out["error"], out["error"]
    assert out["inlined"] == []  # the classes tried inline went back to regions
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
    return {"graphs": len(backend.graphs), "region_calls": compiled_regions(backend)[0]}


def test_a_function_compiled_around_the_model_compiles_it_whole() -> None:
    # The model's call catches what compiling it raises when torch.compile starts there; called
    # from a function being compiled, it is traced like any code: one graph, regions inside.
    out = run_workers(nested_worker, 2)[0]
    assert out == {"graphs": 1, "region_calls": out["region_calls"]} and out["region_calls"] > 0


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
