"""``Cluster.measure()``: calibrate the planner's numbers on the machine it runs on.

Collective over the group: every rank runs the same measurements in the same order, at the
same time (a barrier before each: in training the ranks compute side by side and share the
machine's caches and memory), and each timing is the slowest rank's (a step waits for the
slowest rank), so all ranks get the same cluster.

Each compute timing is the fastest of several repeats: noise (other processes, interrupts)
only ever adds time, so the fastest repeat is the closest to what the machine does. Matmuls
and attention are the exception: a step runs each of them once, after other operators, so
they are timed as a pass over every shape and the median pass counts (:func:`_matmul_flops`). A
collective's time is the median: its spread is the collective's own (the backend's threads
waking on every rank, fresh buffers), a step pays the typical one, and on this project's CPU
machine the median 1-16 MB gloo collective took 1.2-4x the fastest. On a CPU whose ops
run on one thread, compute is timed by the thread's CPU time, not the wall clock: on a shared
machine a rank waits for a core whenever other jobs hold it, and that wait belongs to the
other jobs, not to the operator (``bench/plan_accuracy.py`` measures it separately). When the
job's own ranks outnumber the cores (a 2 x 2 hybrid world on 2 cores), each rank gets a share
of a core: the compute calibrations run in turns, a core per rank (:func:`_in_turns`), and
compute times, and the CPU time communication takes from compute, are stretched by that share
(:func:`_cpu_share`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx

from .numbers import COLLECTIVE_KINDS, ClusterError, MeasuredCollective, fit_line

if TYPE_CHECKING:
    from .cluster import Cluster

_c10d = torch.ops._c10d_functional


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_clock(device: torch.device):
    """The clock compute is timed by: the thread's CPU time where an op runs on this thread
    alone (a CPU with one intra-op thread), else the wall clock."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _cpu_share(device: torch.device) -> float:
    """The share of a core each rank's compute gets from its own job: below 1 when this node's
    ranks (times their intra-op threads) outnumber the cores they may run on, e.g. a 2 x 2
    hybrid world on 2 cores. The thread's CPU time does not see that sharing; the wall clock
    of the training step does."""
    return 1.0 if device.type != "cpu" else min(1.0, _cores_per_thread())


def _cores_per_thread() -> float:
    """This node's cores over the compute threads its ranks run (ranks x intra-op threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return cores / (max(ranks, 1) * torch.get_num_threads())


def _compute_seconds(fn, repeats: int, device: torch.device, *, typical: bool = False) -> float:
    """How long ``fn`` keeps this rank's compute busy: the fastest repeat on the compute clock
    (the median with ``typical``), stretched by the rank's share of a core when that clock is
    the thread's."""
    clock = _compute_clock(device)
    samples = _samples(fn, repeats, device, clock)
    seconds = statistics.median(samples) if typical else min(samples)
    return seconds / _cpu_share(device) if clock is time.thread_time else seconds


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
    """The fastest of ``repeats`` runs of ``fn`` (see the module docstring)."""
    return min(_samples(fn, repeats, device, clock))


def _typical_time(fn, repeats: int, device: torch.device) -> float:
    """The median wall time of ``repeats`` runs of ``fn`` (see the module docstring)."""
    return statistics.median(_samples(fn, repeats, device))


def _slowest(value: float, group: Any) -> float:
    """The largest of every rank's ``value`` (all ranks get the same number)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


# (m, k, n) of the matmuls a transformer's linear layers run: tokens x d_model against a
# d_model x (1..4 d_model) weight, and the backward's transposed layouts of the same sizes.
_CPU_MATMULS = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (512, 256, 1024), (512, 1024, 256),
                (2048, 512, 1536))
# (tokens, features) of a transformer step's activations on a CPU: d_model and 4 d_model wide.
_CPU_ACTIVATIONS = ((512, 256), (512, 1024), (1024, 512), (1024, 2048))
_GPU_MATMULS = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 16384), (8192, 16384, 4096))


def _sync_ranks(group: Any, sync: bool) -> None:
    if sync and dist.is_initialized():
        dist.barrier(group=group)


def _matmul_flops(dtype: torch.dtype, device: torch.device, repeats: int, group: Any = None,
                  sync: bool = True) -> float:
    """FLOP/s of the matmuls a training step runs, run the way a step runs them.

    Each shape runs in three layouts: ``x @ w.T`` (forward), ``g @ w`` (input gradient),
    ``g.T @ x`` (weight gradient). A step runs each of its matmuls once, after other operators
    have filled the caches with other data, so the calibration runs all of them in sequence,
    every operand distinct, and takes the median pass: total FLOPs over its time, which weighs
    each shape by its share of the work as a step's time does. (Timing each shape in a loop
    and keeping the fastest repeat read 98 GFLOP/s on this project's CPU where the matmuls of a
    training step ran at 84-94.)
    """
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

    _sync_ranks(group, sync)
    return flops / _compute_seconds(sequence, repeats, device, typical=True)


# (batch, heads, sequence, head dim) of the attention the calibration runs: a CPU demo's GPT
# block (4 x 256 tokens, 8 heads of 64) and a GPU training run's (4 x 2048 tokens, 32 of 128).
_CPU_ATTENTION = (4, 8, 256, 64)
_GPU_ATTENTION = (4, 32, 2048, 128)


def _attention_flops(dtype: torch.dtype, device: torch.device, repeats: int, group: Any = None,
                     sync: bool = True) -> float:
    """FLOP/s of fused causal attention, forward and backward, as torch's flop counter counts
    them (the formulas the cost model applies): attention kernels run softmax and masking
    beside their matmuls and reach a rate of their own (on this project's CPU, about 70 GFLOP/s
    where the matmuls reach 90-98)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = _CPU_ATTENTION if device.type == "cpu" else _GPU_ATTENTION
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device=device).to(dtype)
    flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)

    def forward_backward() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    _sync_ranks(group, sync)
    return flops / _compute_seconds(forward_backward, repeats, device, typical=True)


def _memory_bandwidth(device: torch.device, repeats: int, group: Any = None, sync: bool = True) -> float:
    """Bytes per second the memory-bound operators of a training step move.

    On a GPU: one large copy (what the data sheets quote). On a CPU: the median over the
    non-matmul operators a transformer step runs (elementwise, activation, normalization,
    softmax, reductions, concatenation, transposing copies) at the sizes of its activations,
    each on *cold* inputs. In a graph an operator reads what others wrote long before, and
    writes a freshly allocated output; a loop over one hot buffer would time the caches, not
    the memory (about twice as fast here), and a single large copy misses that many of these
    operators are bound by the CPU's vector units, not by memory.
    """
    if device.type != "cpu":
        src = torch.ones(256 << 20, device=device)
        dst = torch.empty_like(src)
        _sync_ranks(group, sync)
        seconds = _compute_seconds(lambda: dst.copy_(src), repeats, device)
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

            _sync_ranks(group, sync)
            rates.append(passes * numel * pool.element_size() / _compute_seconds(run, repeats, device))
    return statistics.median(rates)


def _op_overhead(device: torch.device, repeats: int) -> float:
    """Seconds per operator of a graph run as Python (aot_eager), on tiny tensors."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    value = x
    count = 200
    for _ in range(count):
        value = graph.call_function(torch.ops.aten.add.Tensor, (value, x))
    graph.output(value)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    tiny = torch.ones(1, device=device)
    return _compute_seconds(lambda: gm(tiny), repeats, device) / count


def _sharded_params(count: int, numel: int, group: Any, device: torch.device) -> list[torch.nn.Parameter]:
    """``count`` zero parameters of ``numel`` local elements each, DTensors sharded on dim 0 over
    ``group`` as the backend's parameters are (no communication: each rank makes its own)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    return [torch.nn.Parameter(DTensor.from_local(torch.zeros(numel, device=device), mesh, [Shard(0)],
                                                  run_check=False)) for _ in range(count)]


def _optimizer_step(optimizer: str, group: Any, device: torch.device, repeats: int,
                    sync: bool = True) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per shard byte) of one real ``optimizer`` step
    over DTensor shards on ``group``, as the backend's sharded parameters are: a line through
    a step over many small tensors (per-tensor dispatch) and one over few large ones (bytes)."""
    def step_seconds(count: int, numel: int) -> float:
        params = _sharded_params(count, numel, group, device)
        grads = _sharded_params(count, numel, group, device)
        for p, g in zip(params, grads):
            p.grad = g.detach().fill_(1.0)
        opt = (torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4))
        _sync_ranks(group, sync)
        return _compute_seconds(opt.step, repeats, device)

    many, few = (64, 1 << 10), (4, 1 << 20)
    t_many, t_few = step_seconds(*many), step_seconds(*few)
    bytes_many, bytes_few = many[0] * many[1] * 4, few[0] * few[1] * 4
    # Solve t = tensors * a + bytes * b through both points; clipped at 0 like fit_line.
    per_byte = max((t_few - t_many * few[0] / many[0]) / (bytes_few - bytes_many * few[0] / many[0]), 0.0)
    per_tensor = max((t_many - bytes_many * per_byte) / many[0], 0.0)
    return per_tensor, per_byte


def _runtime_per_tensor(group: Any, device: torch.device, repeats: int, sync: bool = True) -> float:
    """Seconds per sharded parameter per training step spent outside the compiled graphs: each
    graph call first checks every leaf against its DTensor parameter
    (:meth:`~fsdp_compile.sharding.local_shards.LocalShards.refresh`), and backward accumulates each
    reduced gradient into its leaf, whose hook wraps it into a DTensor ``.grad``. Timed as a
    real autograd round trip through :class:`LocalShards` at two parameter counts (the slope:
    per tensor), like the optimizer step, so the graphs' own work is not counted twice."""
    from ..sharding.local_shards import LocalShards

    def round_trip_seconds(count: int) -> float:
        params = _sharded_params(count, 64, group, device)
        shards = LocalShards()
        for index, param in enumerate(params):
            shards.add(f"p{index}", param)
        leaves = list(shards.leaves.values())

        def step() -> None:
            shards.refresh()
            torch.stack([leaf.sum() for leaf in leaves]).sum().backward()
            for p in params:
                p.grad = None

        _sync_ranks(group, sync)
        return _compute_seconds(step, repeats, device)

    few, many = 8, 32
    return max((round_trip_seconds(many) - round_trip_seconds(few)) / (many - few), 0.0)


def _in_turns(calibrate, group: Any, device: torch.device):
    """Run a compute calibration ``calibrate(sync)`` on every rank of ``group`` and return this
    rank's result.

    Side by side (``sync=True``: the calibration barriers before each timing) when every rank
    has a core, as ranks compute in training. When this node's ranks outnumber its cores (a
    2 x 2 hybrid world on 2 cores) they take turns, as many at a time as there are cores:
    ranks time-slicing one core evict each other's caches within a single short timing, which
    a training step's long operators do not suffer, so each calibration sees a core of its
    own and the sharing is modelled once, by stretching compute with :func:`_cpu_share`."""
    share = _cpu_share(device)
    if share >= 1.0 or not dist.is_initialized():
        return calibrate(True)
    turns = math.ceil(1.0 / share)
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank()
    result = None
    for turn in range(turns):
        if local_rank % turns == turn:
            result = calibrate(False)
        dist.barrier(group=group)
    return result


def _wire_bytes(kind: str, buffer_bytes: int, n: int) -> float:
    share = (n - 1) / n
    return buffer_bytes * share * (2 if kind == "all_reduce" else 1)


def ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def _run_collective(kind: str, buffer: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather":
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(buffer, n, group_name))
    if kind == "reduce_scatter":
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(buffer, "sum", n, group_name))
    return _c10d.wait_tensor(_c10d.all_reduce(buffer, "sum", group_name))


_COLLECTIVE_REPEATS = 9  # a median needs more samples than a minimum


def _collectives(group: Any, device: torch.device, sizes: tuple[int, ...],
                 repeats: int) -> dict[str, MeasuredCollective]:
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    fits = {}
    for kind in COLLECTIVE_KINDS:
        samples = []
        for size in sizes:
            # all-gather's buffer is its output; each rank contributes 1/n of it
            numel = max(n, size // 4 // n * n)
            local = torch.ones(numel // n if kind == "all_gather" else numel, device=device)
            dist.barrier(group=group)
            seconds = _slowest(_typical_time(lambda kind=kind, local=local: _run_collective(kind, local, n, name),
                                             max(repeats, _COLLECTIVE_REPEATS), device), group)
            samples.append((numel * 4, seconds))
        latency, per_byte = fit_line([(_wire_bytes(kind, b, n), s) for b, s in samples])
        fits[kind] = MeasuredCollective(step_latency=latency / max(ring_steps(kind, n), 1),
                                        bandwidth=1.0 / per_byte, group_size=n, samples=tuple(samples))
    return fits


def allocation_records(prof: Any) -> list[tuple[int, int, int]]:
    """Every CPU allocation and free a profile (``profile_memory=True``) recorded, on any
    thread, as ``(time ns, address, bytes)`` in time order (frees negative)."""
    from torch._C._profiler import _EventType

    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            records.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(records)


def allocator_peak(records: list[tuple[int, int, int]]) -> int:
    """The largest running sum of allocations minus frees, in bytes beyond what was allocated
    before the first record.

    Records are ordered by timestamps taken on the threads that allocate and free: a free
    recorded on one thread can carry a later time than an allocation on another thread that
    already reuses its address. An address is never handed out twice, so an allocation of an
    address still live in the sum closes the earlier allocation first; summed naively, the
    buffer counts twice (on this project's CPU machine: 2-5 MiB spikes in some steps of a
    2 x 2 hybrid world, up to 14% of the step's peak).
    """
    live: dict[int, int] = {}
    running = peak = 0
    for _, address, nbytes in records:
        if nbytes > 0:
            running += nbytes - live.pop(address, 0)
            live[address] = nbytes
        else:
            # a free of memory allocated before the records began is counted as it is
            running -= live.pop(address, -nbytes)
        peak = max(peak, running)
    return peak


def _allocated_peak(fn, device: torch.device) -> tuple[float, Any]:
    """Bytes the allocator handed out at the peak while ``fn`` ran, beyond what was allocated
    before it (the profiler's memory events on a CPU, the caching allocator's peak on a GPU),
    and ``fn``'s result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before), result
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return float(allocator_peak(allocation_records(prof))), result


def _collective_workspace(group: Any, device: torch.device) -> dict[str, float]:
    """Bytes the backend allocates beside each collective's result, per byte of its buffer
    (the all-gather's output; the input of the others), by the allocator."""
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    numel = (1 << 20) // n * n
    shares = {}
    for kind in COLLECTIVE_KINDS:
        local = torch.ones(numel // n if kind == "all_gather" else numel, device=device)
        buffer_bytes = numel * local.element_size()
        _run_collective(kind, local, n, name)  # warm-up: first-call allocations are not per collective
        dist.barrier(group=group)
        peak, result = _allocated_peak(lambda kind=kind, local=local: _run_collective(kind, local, n, name), device)
        extra = max(peak - result.numel() * result.element_size(), 0.0) / buffer_bytes
        shares[kind] = _slowest(round(extra, 2), group)
    return shares


def _overlap(group: Any, device: torch.device, repeats: int) -> float:
    """Fraction of a collective's time hidden when it runs beside compute (1: fully hidden)."""
    if device.type == "cpu":
        return _cpu_overlap(group, device, repeats)
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    a = torch.randn(384, 384, device=device)
    buffer = torch.ones(4 << 20, device=device)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    def comm() -> None:
        _run_collective("all_reduce", buffer, n, name)

    def both() -> None:
        work = _c10d.all_reduce(buffer, "sum", name)
        compute()
        _c10d.wait_tensor(work)

    dist.barrier(group=group)
    t_compute = _slowest(_fastest_time(compute, repeats, device), group)
    dist.barrier(group=group)
    t_comm = _slowest(_fastest_time(comm, repeats, device), group)
    dist.barrier(group=group)
    t_both = _slowest(_fastest_time(both, repeats, device), group)
    hidden = t_compute + t_comm - t_both
    return min(max(hidden / min(t_compute, t_comm), 0.0), 1.0)


def _cpu_overlap(group: Any, device: torch.device, repeats: int) -> float:
    """``comm_overlap`` on a CPU: the share of a collective's time that costs no CPU.

    A CPU backend (gloo) moves and reduces bytes with CPU threads of its own, plus copies on
    the issuing thread. When this node's ranks already occupy every core with compute, that
    CPU time is taken from compute however the schedule hides the collective, so only the
    rest of its time (waiting on the peers, the loopback) can hide. Measured from clocks, not
    from a race between compute and a collective (whose outcome the scheduler decides
    differently from run to run): this process's CPU time over all its threads during
    collectives of each kind, over their wall time, for the slowest rank. With a core to
    spare per rank, communication threads do not take compute's cores: 1.
    """
    if _cores_per_thread() > 1.0:
        return 1.0
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    cpu = wall = 0.0
    for kind in COLLECTIVE_KINDS:
        for numel in (1 << 20, 1 << 22):  # 4 and 16 MB: the buckets of a training step
            local = torch.ones(numel // n if kind == "all_gather" else numel, device=device)
            _run_collective(kind, local, n, name)
            for _ in range(repeats):
                dist.barrier(group=group)
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                _run_collective(kind, local, n, name)
                cpu += time.process_time() - start_cpu
                wall += time.perf_counter() - start_wall
    busy = _slowest(cpu / wall if wall > 0 else 0.0, group)
    # Where ranks share cores (2 x 2 on 2 cores), communication threads get a rank's share of
    # a core like compute does: the compute they displace is stretched by the same share.
    return min(max(1.0 - busy / _cpu_share(device), 0.0), 1.0)


def _cpu_memory_per_rank() -> float:
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        raise ClusterError("cannot read this machine's memory size; pass device_memory= to Cluster.measure()") from None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return total_kib * 1024 / max(ranks, 1)


def measure_cluster(cls: type[Cluster], *, group: Any, sizes: tuple[int, ...] | None, repeats: int,
                    dtypes: tuple[torch.dtype, ...], nodes: int, device: torch.device | str | None,
                    device_memory: float | None) -> Cluster:
    if not dist.is_initialized():
        raise ClusterError("Cluster.measure() measures the current process groups: call "
                           "torch.distributed.init_process_group() first (torchrun sets it up)")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    world = dist.get_world_size(group)
    if world % nodes:
        raise ClusterError(f"nodes={nodes} does not divide the group's {world} ranks")
    if sizes is None:
        sizes = (1 << 16, 1 << 18, 1 << 20, 1 << 22) if device.type == "cpu" else (1 << 20, 1 << 24, 1 << 27)
    # _slowest takes the largest value: negated, it gives the slowest rank's rate
    # Two rounds over the dtypes, the faster kept: a slowdown of the machine lasting seconds
    # (another tenant, frequency scaling) can outlast all repeats of one round, not both rounds.
    flops: dict[torch.dtype, float] = {}
    for _ in range(2):
        for dtype in dtypes:
            rate = -_slowest(-_in_turns(lambda sync, dtype=dtype: _matmul_flops(dtype, device, repeats, group, sync),
                                        group, device), group)
            flops[dtype] = max(flops.get(dtype, 0.0), rate)
    attention = {dtype: -_slowest(-_in_turns(
        lambda sync, dtype=dtype: _attention_flops(dtype, device, repeats, group, sync), group, device), group)
        for dtype in dtypes}
    bandwidth = -_slowest(-_in_turns(lambda sync: _memory_bandwidth(device, repeats, group, sync), group, device),
                          group)
    overhead = (_slowest(_in_turns(lambda sync: _op_overhead(device, repeats), group, device), group)
                if device.type == "cpu" else 0.0)
    optimizer_step = {
        name: tuple(_slowest(v, group) for v in _in_turns(
            lambda sync, name=name: _optimizer_step(name, group, device, repeats, sync), group, device))
        for name in ("adamw", "sgd")}
    runtime_per_tensor = _slowest(_in_turns(lambda sync: _runtime_per_tensor(group, device, repeats, sync),
                                            group, device), group)
    collectives = _collectives(group, device, sizes, repeats)
    workspace = _collective_workspace(group, device)
    overlap = _overlap(group, device, repeats)
    if device_memory is None:
        device_memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                         else _cpu_memory_per_rank())
    ring = collectives["all_gather"]
    where = f"measured on this machine ({time.strftime('%Y-%m-%d %H:%M')}, world {world}, {device.type})"
    return cls(
        name=f"measured-{device.type}", nodes=nodes, devices_per_node=world // nodes,
        device_memory=float(device_memory), peak_flops=flops, memory_bandwidth=bandwidth,
        intra_node_bandwidth=ring.bandwidth, inter_node_bandwidth=ring.bandwidth,
        intra_node_latency=ring.step_latency, inter_node_latency=ring.step_latency,
        collective_latency=0.0, reserved_memory=0.0, op_overhead=overhead, comm_overlap=overlap,
        runtime_per_tensor=runtime_per_tensor, attention_flops=attention,
        device_type=device.type, measured_collectives=collectives, optimizer_step=optimizer_step,
        collective_workspace=workspace,
        sources={key: where for key in ("peak_flops", "attention_flops", "memory_bandwidth", "collectives",
                                         "op_overhead", "comm_overlap", "optimizer_step", "runtime_per_tensor",
                                         "collective_workspace", "device_memory")})
