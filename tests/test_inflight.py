"""The invariant every graph handed to the inner compiler keeps (passes/inflight.py): nothing
reads a collective's output or writes its buffers before its wait. Checked on small traced
graphs here; every compiled graph of the suite goes through the same check in the pipeline."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_compile.passes.inflight import InflightBufferError, check_inflight_buffers

_c10d = torch.ops._c10d_functional
GROUP = "0"  # fake tracing never resolves the group


def traced(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def scheduled_gather_and_reduce(x, g):
    """A gather issued early and waited late, compute between: what scheduling produces."""
    gathered = _c10d.all_gather_into_tensor(x, 2, GROUP)
    reduced = _c10d.reduce_scatter_tensor(g * 2, "avg", 2, GROUP)
    y = (x * 3).sum()
    return _c10d.wait_tensor(gathered) + y, _c10d.wait_tensor(reduced)


def test_a_scheduled_graph_passes_and_counts_its_collectives() -> None:
    assert check_inflight_buffers(traced(scheduled_gather_and_reduce, (4,), (8,)).graph) == 2


def test_a_write_to_a_collectives_input_before_its_wait_is_refused() -> None:
    def f(x):
        flat = x * 1
        gathered = _c10d.all_gather_into_tensor(flat, 2, GROUP)
        flat[:2].add_(1)  # through a view: the same storage
        return _c10d.wait_tensor(gathered), flat

    with pytest.raises(InflightBufferError, match=r"writes to .* shares a buffer with collective all_gather"):
        check_inflight_buffers(traced(f, (4,)).graph)


def test_a_write_after_the_wait_is_allowed() -> None:
    def f(x):
        flat = x * 1
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, 2, GROUP))
        flat.add_(1)
        return gathered, flat

    assert check_inflight_buffers(traced(f, (4,)).graph) == 1


def test_a_read_of_the_output_before_the_wait_is_refused() -> None:
    def f(x):
        gathered = _c10d.all_gather_into_tensor(x, 2, GROUP)
        early = gathered.sum()
        return _c10d.wait_tensor(gathered), early

    with pytest.raises(InflightBufferError, match="its wait as its only user"):
        check_inflight_buffers(traced(f, (4,)).graph)


def test_an_unwaited_collective_is_refused() -> None:
    def f(x):
        _c10d.all_reduce(x, "sum", GROUP)
        return x * 2

    gm = traced(f, (4,))
    with pytest.raises(InflightBufferError, match="users are none"):
        check_inflight_buffers(gm.graph)
