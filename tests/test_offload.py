"""CPU offload where a CPU-only machine can check it: there the compute device is the
CPU, where every host/device copy is a no-op, so the copies themselves are checked in graphs
compiled for a compute device the machine lacks, traced with fake tensors.

What torch allows: a CUDA compute device cannot be traced on a CPU-only build (autograd asks
the CUDA runtime for stream metadata of every fake CUDA output and aborts the process), the
meta device can: it stands for "some device other than the host" here. The multi-process side
(shards, gradients and optimizer state in host memory after compiled steps, the markers
declaring the compute device, training equal to the reference) is in
tests/test_training_loop.py. Only a GPU can show that pinned copies overlap compute and what
the PCIe traffic costs: docs/results.md lists that as unmeasured.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp_compile
from fsdp_compile.api import CPUOffload
from fsdp_compile.runtime.collectives import CommSpec
from fsdp_compile.sharding.sharded_param import _place

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
TO_COPY = torch.ops.aten._to_copy.default
COPY_IN = torch.ops.fsdp_compile.copy_in.default


class TwoLayers(torch.nn.Module):
    """Two gathered 8 x 8 weights (4 x 8 shards), one bucket each, as a Dynamo graph reads them."""

    def __init__(self, spec: CommSpec) -> None:
        super().__init__()
        self.args = spec.op_args()

    def forward(self, x, s0, s1):
        w0 = torch.ops.fsdp_compile.unshard(s0, "w0", "b0", 8, *self.args)
        w1 = torch.ops.fsdp_compile.unshard(s1, "w1", "b1", 8, *self.args)
        return (torch.tanh(torch.tanh(x @ w0.t()) @ w1.t()),)


def compile_for(compute_device: str | None):
    """The backend's real pipeline (partition, reshard tags, lowering, scheduling) on a graph whose
    shards live in host memory and whose compute runs on ``compute_device``; one fake step."""
    spec = CommSpec("g", 2, True, "", 1, None, None, True, compute_device)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    gm = fx.symbolic_trace(TwoLayers(spec))
    with FakeTensorMode() as mode:
        x = torch.empty(3, 8, device=compute_device or "cpu")
        shards = [torch.empty(4, 8, requires_grad=True) for _ in range(2)]
    compiled = backend(gm, [x, *shards])
    with mode:
        compiled(x, *shards)[0].sum().backward()
        grad_devices = [s.grad.device.type for s in shards]
    (record,) = backend.graphs
    return record, grad_devices


def device_of(node: fx.Node) -> str:
    return node.meta["val"].device.type


def test_compiled_graphs_copy_shards_to_the_compute_device_and_gradients_back() -> None:
    record, grad_devices = compile_for("meta")
    for graph in (record.forward, record.backward):  # FULL_SHARD gathers again in backward
        copy_ins = [n for n in graph.graph.nodes if n.target is COPY_IN]
        assert copy_ins
        for copy_in in copy_ins:
            # Every shard is a host graph input copied to the compute device before the copy-in.
            for shard in copy_in.args[0]:
                assert shard.target is TO_COPY and device_of(shard) == "meta"
                assert shard.args[0].op == "placeholder" and device_of(shard.args[0]) == "cpu"
        for gather in (n for n in graph.graph.nodes if n.target is ALL_GATHER):
            assert device_of(gather) == "meta"
    # Each reduced gradient shard comes back to the host: the backward graph's gradient
    # outputs are device-to-host copies of what the reduce-scatter produced on the device.
    output = next(n for n in record.backward.graph.nodes if n.op == "output")
    grads = [g for g in output.args[0] if isinstance(g, fx.Node)]
    assert len(grads) == 2
    for grad in grads:
        assert grad.target is TO_COPY and device_of(grad) == "cpu" and device_of(grad.args[0]) == "meta"
        assert REDUCE_SCATTER in {n.target for n in _ancestors(grad)}
    assert grad_devices == ["cpu", "cpu"]


def test_host_to_device_copy_is_part_of_the_prefetched_gather() -> None:
    # The second bucket's copy is issued with its all-gather, before the first layer's matmul:
    # the copy overlaps compute like the gather does (on a GPU, from pinned memory).
    record, _ = compile_for("meta")
    nodes = list(record.forward.graph.nodes)
    copies = [i for i, n in enumerate(nodes) if n.target is TO_COPY]
    first_matmul = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default)
    assert len(copies) == 2 and copies[1] < first_matmul


def test_without_a_compute_device_nothing_is_copied() -> None:
    # The control: the same graphs with the shards where compute runs have no copy at all,
    # so the copies above come from the declared compute device.
    record, grad_devices = compile_for(None)
    for graph in (record.forward, record.backward):
        assert not [n for n in graph.graph.nodes if n.target is TO_COPY and device_of(n) != device_of(n.args[0])]
    assert grad_devices == ["cpu", "cpu"]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("source", ["cuda", "meta", "cpu"])
def test_offloaded_shards_are_placed_in_host_memory(source: str) -> None:
    """Where a parameter comes from a device (fake CUDA tensors: no CUDA needed to place them),
    its shard storage under offload is host memory; without offload it goes to the mesh's
    device (a CPU-built model sharded over NCCL trains on the GPU), and stays where it was
    when there is none (meta shards while planning)."""
    with FakeTensorMode():
        storage = torch.empty(4, 3, device=source)
        # Not pinned here: on a machine with CUDA, pinning a fake tensor fails (aten._pin_memory
        # has no fake-tensor kernel); the tests below pin real tensors.
        assert _place(storage, CPUOffload(pin_memory=False), torch.device("cuda", 0)).device.type == "cpu"
        assert _place(storage, None).device == storage.device
        if source != "meta":
            assert _place(storage, None, torch.device("cuda", 0)).device == torch.device("cuda", 0)


def test_pin_memory_pins_exactly_where_an_accelerator_can_use_it() -> None:
    storage = torch.zeros(4, 3)
    assert not _place(storage, CPUOffload(pin_memory=False)).is_pinned()
    # Page-locking needs an accelerator runtime; without one pin_memory=True is accepted and
    # the shards stay ordinary host memory (a CUDA machine pins them: next test).
    assert _place(storage, CPUOffload(pin_memory=True)).is_pinned() == torch.cuda.is_available()
    with pytest.raises(TypeError, match="CPUOffload\\(pin_memory=\\) takes a bool, got str"):
        CPUOffload(pin_memory="yes")
    with pytest.raises(TypeError, match="offload= must be an fsdp_compile.CPUOffload"):
        fsdp_compile.backend(offload=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pinned_shards_on_a_gpu_machine() -> None:
    shard = _place(torch.zeros(4, 3, device="cuda"), CPUOffload(pin_memory=True))
    assert shard.device.type == "cpu" and shard.is_pinned()
