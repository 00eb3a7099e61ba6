"""What a rank's compute does per second, timed the way a training step runs it: matmul and fused-attention FLOP/s, a
step's memory-bound operators' bytes per second, and the clocks and the slowest rank's value every timing goes through
(why: :mod:`.calibrate`).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_clock(device: torch.device):
    """The thread's CPU time where ops run on this thread alone (one intra-op thread), else the wall clock."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _node_ranks() -> int:
    """The job's ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``, else the world's size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))


def _compute_seconds(fn, repeats: int, device: torch.device, *, typical: bool = False, share: float = 1.0) -> float:
    """How long ``fn`` keeps this rank's compute busy: the fastest repeat on the compute clock (the median with
    ``typical``), stretched by ``share``, the rank's share of a core, when that clock is the thread's (which does not
    see the sharing; a step's wall clock does)."""
    clock = _compute_clock(device)
    samples = _samples(fn, repeats, device, clock)
    return _stretched(statistics.median(samples) if typical else min(samples), clock, share)


def _stretched(seconds: float, clock, share: float) -> float:
    return seconds / share if clock is time.thread_time else seconds


# Rewritten between the timings of :func:`_cold_seconds`: more than a core's caches hold, and the size of the bandwidth
# calibration's pool, so the next timing's operands come from memory.
_EVICT_ELEMENTS = 64 << 20  # 256 MB


def _cold_seconds(fn, repeats: int, device: torch.device, share: float = 1.0) -> float:
    """:func:`_compute_seconds` with the caches filled with other data before each repeat: for work a step runs long
    after it last touched its operands (the optimizer after a backward)."""
    clock = _compute_clock(device)
    evict = torch.zeros(_EVICT_ELEMENTS, device=device)
    fn()
    samples = []
    for _ in range(repeats):
        evict.add_(1.0)
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        samples.append(clock() - start)
    return _stretched(min(samples), clock, share)


def _samples(fn, repeats: int, device: torch.device, clock=time.perf_counter) -> list[float]:
    """``repeats`` timings of ``fn`` on ``clock`` after one warm-up run."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        samples.append(clock() - start)
    return samples


def _fastest_time(fn, repeats: int, device: torch.device, clock=time.perf_counter) -> float:
    """The fastest of ``repeats`` runs of ``fn`` (why: :mod:`.calibrate`)."""
    return min(_samples(fn, repeats, device, clock))


def _typical_time(fn, repeats: int, device: torch.device) -> float:
    """The median wall time of ``repeats`` runs of ``fn`` (why: :mod:`.calibrate`)."""
    return statistics.median(_samples(fn, repeats, device))


def _slowest(value: float, group: Any) -> float:
    """The largest of every rank's ``value`` (all ranks get the same number)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _sync_ranks(group: Any, share: float) -> None:
    """Ranks with a core each start a timing together, as they compute in training; ranks that share cores (``share``
    below 1) take turns instead (the host model's ``compute_in_turns``)."""
    if share >= 1.0 and dist.is_initialized():
        dist.barrier(group=group)


# (m, k, n) of the matmuls a transformer's linear layers run: tokens x d_model against a d_model x (1..4 d_model)
# weight, and the backward's transposed layouts of the same sizes.
_CPU_MATMULS = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (512, 256, 1024), (512, 1024, 256),
                (2048, 512, 1536))
# (tokens, features) of a transformer step's activations on a CPU: d_model and 4 d_model wide.
_CPU_ACTIVATIONS = ((512, 256), (512, 1024), (1024, 512), (1024, 2048))
_GPU_MATMULS = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 16384), (8192, 16384, 4096))


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, repeats: int, group: Any = None,
                         share: float = 1.0) -> float:
    """FLOP/s of a training step's matmuls: each shape in its three layouts (``x @ w.T``, ``g @ w``, ``g.T @ x``), all
    in sequence on distinct operands as a step runs them once each, the median pass's total FLOPs over its time (a loop
    over each shape read faster than a step's matmuls ran)."""
    pairs = []
    flops = 0
    for m, k, n in _CPU_MATMULS if device.type == "cpu" else _GPU_MATMULS:
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        g = torch.randn(m, n, device=device).to(dtype)
        pairs += [(x, w.t()), (g, w), (g.t(), x)]
        flops += 3 * 2 * m * k * n

    def sequence() -> None:
        for a, b in pairs:
            torch.mm(a, b)

    _sync_ranks(group, share)
    return flops / _compute_seconds(sequence, repeats, device, typical=True, share=share)


# (batch, heads, sequence, head dim) of the attention the calibration runs: a CPU demo's GPT block (4 x 256 tokens, 8
# heads of 64) and a GPU training run's (4 x 2048 tokens, 32 of 128).
_CPU_ATTENTION = (4, 8, 256, 64)
_GPU_ATTENTION = (4, 32, 2048, 128)


def measure_attention_flops(dtype: torch.dtype, device: torch.device, repeats: int, group: Any = None,
                            share: float = 1.0) -> float:
    """FLOP/s of fused causal attention, forward and backward, as torch's flop counter counts them: softmax and masking
    beside the matmuls give it a rate of its own."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = _CPU_ATTENTION if device.type == "cpu" else _GPU_ATTENTION
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device=device).to(dtype)
    flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)

    def forward_backward() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    _sync_ranks(group, share)
    return flops / _compute_seconds(forward_backward, repeats, device, typical=True, share=share)


def measure_memory_bandwidth(device: torch.device, repeats: int, group: Any = None, share: float = 1.0) -> float:
    """Bytes per second a training step's memory-bound operators move: a GPU's large copy (what data sheets quote); on a
    CPU the median over a transformer step's non-matmul operators at its activations' sizes, each on cold inputs (as in
    a graph: a hot buffer times the caches, and a single copy misses the operators bound by the vector units)."""
    if device.type != "cpu":
        src = torch.ones(256 << 20, device=device)
        dst = torch.empty_like(src)
        _sync_ranks(group, share)
        seconds = _compute_seconds(lambda: dst.copy_(src), repeats, device, share=share)
        return 2 * src.numel() * src.element_size() / seconds  # read + write
    aten = torch.ops.aten
    pool = torch.empty(64 << 20, device=device).uniform_()  # 256 MB: beyond any last-level cache
    rates = []
    for rows, cols in _CPU_ACTIVATIONS:
        numel = rows * cols
        starts = range(0, pool.numel() - 2 * numel + 1, 2 * numel)  # each timing reads its own slice
        weight, bias = torch.ones(cols, device=device), torch.zeros(cols, device=device)
        ops = (  # (operator, number of inputs, passes over one activation's bytes)
            (lambda x, y: x + y, 2, 3), (lambda x, y: x * y, 2, 3), (aten.gelu, 1, 2),
            (aten.gelu_backward, 2, 3),
            (lambda x, w=weight, b=bias: aten.native_layer_norm(x, [w.numel()], w, b, 1e-5), 1, 2),
            (lambda x: aten._softmax(x, -1, False), 1, 2), (lambda x: aten.sum(x, [0]), 1, 1),
            (lambda x, y: torch.cat([x, y]), 2, 4), (lambda x: x.t().contiguous(), 1, 2))
        for op, inputs, passes in ops:
            cold = iter(starts)

            def run(op=op, inputs=inputs, cold=cold, numel=numel, rows=rows, cols=cols) -> None:
                start = next(cold, None)
                if start is None:  # the pool is used up: start over (long evicted by now)
                    start = 0
                op(*(pool[start + i * numel: start + (i + 1) * numel].view(rows, cols) for i in range(inputs)))

            _sync_ranks(group, share)
            rates.append(passes * numel * pool.element_size() / _compute_seconds(run, repeats, device, share=share))
    return statistics.median(rates)
