"""The plain tensors that stand for the sharded parameters in forward (``LocalShards``).

Graphs read one plain leaf per parameter, not the DTensor (a DTensor input costs Dynamo and
AOTAutograd a subclass input per parameter: see docs/design.md, "Leaves"). What
users do to the DTensor parameters must still reach the graphs: freezing and unfreezing after
the model was compiled, in-place updates, replacing a parameter (an error that names it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import GRAD_RTOL, TEST_CONFIG, assert_grads_close, batches, expect_error, full, lm_loss, local_slice
from torch import nn

import fsdp_compile
from fsdp_compile.models.gpt import GPT

FROZEN = "blocks.0."


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _step(forward: Any, model: nn.Module, batch: tuple, rank: int | None) -> dict[str, torch.Tensor]:
    x, y = batch if rank is None else (local_slice(t, rank) for t in batch)
    lm_loss(forward(x), y).backward()
    grads = _grads(model)
    for p in model.parameters():
        p.grad = None
    return grads


def leaves_worker(rank: int, world: int, mode: str) -> dict:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    backend.shard(model)
    forward = torch.compile(model, backend=backend) if mode == "compiled" else model
    data = batches(TEST_CONFIG, world, 4)
    out: dict[str, Any] = {"ours": [], "reference": []}

    def both(batch: tuple) -> None:
        out["ours"].append(_step(forward, model, batch, rank))
        out["reference"].append(_step(reference, reference, batch, None))

    both(data[0])
    for m in (model, reference):  # frozen after the model was compiled
        m.blocks[0].requires_grad_(False)
    both(data[1])
    both(data[2])  # the graph compiled for the frozen block
    for m in (model, reference):
        m.blocks[0].requires_grad_(True)
    both(data[3])
    with torch.no_grad():  # in place on the DTensor: the next forward reads it
        for m in (model, reference):
            dict(m.named_parameters())["blocks.1.mlp.fc.weight"].mul_(0.5)
    both(data[0])
    out["graph_inputs"] = [
        type(n.meta["example_value"]).__name__
        for record in backend.graphs for n in record.dynamo.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
        and isinstance(n.meta["example_value"], DTensor)
    ]
    out["graphs"] = len(backend.graphs)
    out["parameters"] = sorted(n for n, _ in model.named_parameters())
    out["gather_inputs"] = gather_inputs(backend, forward, data[0], rank)
    model.blocks[1].mlp.fc._parameters["weight"] = nn.Parameter(torch.zeros(3))
    x, y = (local_slice(t, rank) for t in data[0])
    out["replaced"] = expect_error(lambda: lm_loss(forward(x), y).backward())
    return out


def gather_inputs(backend: Any, forward: Any, batch: tuple, rank: int) -> dict[str, list[str]]:
    """What each gather marker reads, by parameter: the type of its input. Compiled, from the
    graphs Dynamo captured (a graph input, or something the graph computed, as a DTensor's
    ``to_local()``); in the eager runtime, from the markers one forward runs."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def is_gather(target: Any) -> bool:
        return str(target).startswith("fsdp_compile.unshard")

    seen: dict[str, set[str]] = {}
    if backend.graphs:
        for record in backend.graphs:
            for n in record.dynamo.graph.nodes:
                if n.op == "call_function" and is_gather(n.target):
                    source = n.args[0]
                    value = source.meta.get("example_value")
                    kind = "DTensor" if isinstance(value, DTensor) else (
                        "graph input" if source.op == "placeholder" else f"computed ({source.target})")
                    seen.setdefault(n.args[1], set()).add(kind)
        return {fqn: sorted(kinds) for fqn, kinds in seen.items()}

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_gather(func):  # one parameter's marker, or a bucket's (reads that run as Python)
                shards, fqns = (args[0], args[1]) if isinstance(args[0], list) else ([args[0]], [args[1]])
                for shard, fqn in zip(shards, fqns):
                    seen.setdefault(fqn, set()).add("DTensor" if isinstance(shard, DTensor) else "plain tensor")
            return func(*args, **(kwargs or {}))

    x, _ = (local_slice(t, rank) for t in batch)
    with torch.no_grad(), Log():
        forward(x)
    return {fqn: sorted(kinds) for fqn, kinds in seen.items()}


@pytest.fixture(scope="module", params=["eager", "compiled"])
def leaves_run(request) -> tuple[str, dict]:
    return request.param, run_workers(leaves_worker, 2, request.param)[0]


def test_freezing_and_unfreezing_after_compile_reach_the_gradients(leaves_run) -> None:
    mode, out = leaves_run
    for step, (ours, ref) in enumerate(zip(out["ours"], out["reference"])):
        assert sorted(ours) == sorted(ref), f"{mode} step {step}: which parameters got gradients"
        assert_grads_close(ours, ref, GRAD_RTOL, f"{mode} step {step}")
    assert not any(n.startswith(FROZEN) for n in out["ours"][1]), "a frozen block got gradients"
    assert not any(n.startswith(FROZEN) for n in out["ours"][2])
    assert any(n.startswith(FROZEN) for n in out["ours"][3]), "an unfrozen block got no gradients"


class _FreezeProbe(nn.Module):
    """A module of its own, so that its compiled code shares no cache entry with another test's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _plain_compile_recompiles_when_a_parameter_is_frozen() -> bool:
    """Whether this torch's Dynamo guards on a parameter's ``requires_grad`` (2.13 does; 2.11
    reuses the graph, and autograd still leaves the frozen parameter without a gradient)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    probe = _FreezeProbe()
    compiled = torch.compile(probe, backend=counter)
    compiled(torch.ones(2)).sum().backward()
    probe.requires_grad_(False)
    compiled(torch.ones(2))
    return counter.frame_count == 2


def test_forward_reads_plain_tensors_not_dtensors(leaves_run) -> None:
    mode, out = leaves_run
    # Every parameter is gathered, each from a plain tensor: compiled, a graph input of its
    # own (not a DTensor input, nor a to_local() the graph computes); in the eager runtime,
    # a plain tensor handed to the marker.
    plain = ["graph input"] if mode == "compiled" else ["plain tensor"]
    assert out["gather_inputs"] == {name: plain for name in out["parameters"]}
    assert out["graph_inputs"] == []
    if mode == "compiled":
        # As many graphs as plain torch.compile makes for the same freezing: one per
        # requires_grad state where torch guards on it (all trainable, blocks.0 frozen; all
        # trainable again is the first graph's guards), else one.
        assert out["graphs"] == (2 if _plain_compile_recompiles_when_a_parameter_is_frozen() else 1)


def test_a_replaced_parameter_is_an_error_that_names_it(leaves_run) -> None:
    _, out = leaves_run
    assert out["replaced"].startswith("RuntimeError")
    assert "'blocks.1.mlp.fc.weight' was replaced by a plain tensor after the model was sharded" in out["replaced"]
    assert "load_state_dict()" in out["replaced"]



def release_worker(rank: int, world: int) -> int:
    """A sharded model that trained (eager runtime) and was dropped: how many of its parameters
    are still alive after a collection. The leaves must not keep them alive through their
    gradient hooks (held in C++, out of the collector's sight) or the leaf-owner registry.

    Compiled models are not checked: Dynamo itself keeps every compiled graph of a frame as a
    global of the frame's module (with a cleanup hook it does not run on ``reset()``)."""
    import gc
    import weakref

    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    backend.shard(model)
    x, y = batches(TEST_CONFIG, world, 1)[0]
    lm_loss(model(local_slice(x, rank)), local_slice(y, rank)).backward()
    refs = [weakref.ref(p) for p in model.parameters()]
    del model, backend
    gc.collect()
    return sum(r() is not None for r in refs)


def test_a_dropped_model_releases_its_parameters() -> None:
    # Kept alive, the parameters hold their process group's gloo threads past
    # destroy_process_group(), where they can abort the interpreter's shutdown (a gloo work
    # freeing a Python tensor after finalization began: "terminate called without an active
    # exception").
    assert run_workers(release_worker, 2) == [0, 0]

