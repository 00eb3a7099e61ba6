"""A graph break inside a block: the graphs after it compile, and every parameter keeps its bucket.

A block whose forward breaks the graph (a ``torch.compiler.disable``d call, an ``.item()``
branch) inside the loop over blocks makes Dynamo run that loop, and the root's code around it,
as Python. Each block's forward then compiles as a frame of its own (its parameters one bucket,
as without the break), and each root parameter read there would compile as a graph of one read.
Instead such a read runs as Python and gathers its whole bucket (sharding/sharded_class.py: eager_read):
one all-gather for the root's parameters in forward, one reduce-scatter in backward. Counted
from the collectives gloo ran (torch's profiler), with regions off and with the defaults, and
checked against single-process training; no graph falls back (the suite runs strict).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from distributed import run_workers
from helpers import full
from model_zoo import VOCAB, BlockStack, GraphBreakBlock

import fsdp_compile
from fsdp_compile.compilation.inputs import lone_read
from fsdp_compile.runtime.collectives import CommSpec

BLOCKS = 3
STEPS = 2


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _collectives(prof) -> dict[str, int]:
    """The functional collectives a profiled step issued, by kind (compiled and eager alike)."""
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    counts = dict.fromkeys(kinds.values(), 0)
    for event in prof.profiler.kineto_results.events():
        op = event.name().removeprefix("_c10d_functional::")
        if op in kinds and event.name().startswith("_c10d_functional::"):
            counts[kinds[op]] += 1
    return counts


def graph_break_worker(rank: int, world: int, compiler: str, regions: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    base = BlockStack(GraphBreakBlock)
    data = torch.randint(0, VOCAB, (STEPS + 1, world, 2, 10), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler=compiler, **({} if regions else {"regions": False}))
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    grads = []
    for step in range(STEPS):
        _loss(compiled(data[step, rank]), data[step, rank]).backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        model.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # a step after compiling
        _loss(compiled(data[STEPS, rank]), data[STEPS, rank]).backward()
    out = {"grads": grads, "collectives": _collectives(prof),
           "python_reads": sorted(g.python_read for g in backend.graphs if g.python_read),
           "fallbacks": [f for g in backend.graphs for f in g.fallbacks]}
    if rank == 0:
        reference = copy.deepcopy(base)
        out["reference"] = []
        for step in range(STEPS):
            loss = sum(_loss(reference(data[step, r]), data[step, r]) for r in range(world)) / world
            loss.backward()
            out["reference"].append({n: p.grad.clone() for n, p in reference.named_parameters()})
            reference.zero_grad()
    return out


@pytest.mark.parametrize("compiler,regions", [("aot_eager", False), ("inductor", True)],
                         ids=["aot_eager-no_regions", "inductor-defaults"])
def test_after_a_graph_break_every_parameter_is_gathered_with_its_bucket(compiler: str, regions: bool) -> None:
    out = run_workers(graph_break_worker, 2, compiler, regions)[0]
    assert out["fallbacks"] == []
    # The root's reads, each a frame Dynamo compiled on its own, ran as Python.
    assert out["python_reads"] == ["embed.weight", "head.bias", "head.weight", "norm.bias", "norm.weight"]
    # Forward: one all-gather for the root, one per block; backward: FULL_SHARD gathers the
    # blocks again (the root's gathered parameters are still held by autograd), and reduces one
    # bucket per block and one for the root. Read by read, the root alone would take 5 of each.
    assert out["collectives"] == {"all_gather": 1 + 2 * BLOCKS, "reduce_scatter": 1 + BLOCKS}, out["collectives"]
    for step, (ours, ref) in enumerate(zip(out["grads"], out["reference"])):
        largest = max(g.abs().max().item() for g in ref.values())
        worst = max(((ours[n] - g).abs().max().item(), n) for n, g in ref.items())
        assert worst[0] <= 1e-5 * largest, f"step {step}: gradient of {worst[1]} off by {worst[0] / largest:.2e}"


def eager_runtime_worker(rank: int, world: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = BlockStack(GraphBreakBlock)
    fsdp_compile.backend("FULL_SHARD", regions=False).shard(model)
    tokens = torch.randint(0, VOCAB, (2, 10))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _loss(model(tokens), tokens).backward()
    return _collectives(prof)


def test_the_eager_runtime_gathers_and_reduces_by_bucket() -> None:
    # Without torch.compile every read runs as Python: one collective per unit each way.
    assert run_workers(eager_runtime_worker, 2)[0] == {"all_gather": 1 + BLOCKS, "reduce_scatter": 1 + BLOCKS}


_SPEC = CommSpec("g", 2, True, "", 1, None, None, True)


def _graph(fn, *inputs) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_lone_read_is_a_graph_of_one_read_returned_as_it_is() -> None:
    def one_read(shard):
        return (torch.ops.fsdp_compile.unshard(shard, "w", "", 8, *_SPEC.op_args()),)

    def read_and_use(shard):
        return (torch.ops.fsdp_compile.unshard(shard, "w", "", 8, *_SPEC.op_args()) * 2,)

    gm = _graph(one_read, torch.randn(4, 3))
    marker = lone_read(gm)
    assert marker is not None and marker.args[1] == "w"
    assert lone_read(_graph(read_and_use, torch.randn(4, 3))) is None
