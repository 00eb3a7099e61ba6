"""Scaffolding shared by the test files: the test model and its data, training loops and
references, tolerances and the assertions that use them, what a compiled graph communicates,
and the multi-process runs several files read (each run once per test session).

Per-rank code that only one test file asserts on lives in that file, next to its test. Spawned
ranks import this module and the test modules by name (tests/conftest.py puts this folder on
``sys.path``), so module-level code here and in the test files stays cheap.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch._inductor.utils import run_and_get_code

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT, GPTConfig

# ---------------------------------------------------------------- tolerances
# Against a single-process reference: the reference averages the loss over the whole batch at
# once while data parallelism averages per-rank means, so gradients differ by float rounding
# (observed <= 6e-8; we allow 1e-6), and relative to each tensor's largest entry by at most
# 9e-7 (we allow 1e-5; a wrong constant factor such as a missing 1/N is off by 0.5). AdamW
# divides each update by the running gradient magnitude, which turns those rounding differences
# in near-zero gradients into parameter differences of up to ~1e-5 after 5 steps at lr 1e-3
# (observed <= 7e-6; we allow 5e-5, still 20x below one step's update of 1e-3).
GRAD_ATOL = 1e-6
# Per tensor, relative to its largest entry: observed <= 9e-7 (Inductor at 2x2).
GRAD_RTOL = 1e-5
PARAM_ATOL = 5e-5


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).abs().max().item(), n) for n in a)


def relative_grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-tensor max|a - b| / max|b| (a tensor of zeros must match exactly)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = (0.0, "")
    for name, value in a.items():
        diff = (value - b[name]).abs().max().item()
        scale = b[name].abs().max().item()
        worst = max(worst, (diff / scale if scale else (0.0 if diff == 0 else float("inf")), name))
    return worst


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, what: str) -> None:
    """Gradients equal up to rounding, relative to each tensor's largest entry: a constant factor
    (a missing or doubled 1/N, a lost micro-batch) is off by 50% or more, rounding by ~1e-7."""
    rel, name = relative_grad_diff(a, b)
    assert rel <= rtol, f"{what}: gradient of {name} differs by {rel:.2e} of its largest entry"


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    differing = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differing, f"{what}: not bitwise equal for {differing[:5]} (max diff {max_diff(a, b)})"


# ---------------------------------------------------------------- the test model, its data and training
# vocab 67 and block size 19 are prime: the embedding, head and position tables do not split
# evenly over 2 or 4 ranks, so padded shards are exercised on every rank count.
TEST_CONFIG = GPTConfig(vocab_size=67, block_size=19, n_layer=2, n_head=2, d_model=32)
PER_RANK_BATCH = 2
SEQ = 16
LR = 1e-3


def hybrid_options(strategy: ShardingStrategy | str) -> dict:
    """Hybrid strategies in tests: 2 'nodes' of 2 'devices' at world 4."""
    return {"shard_size": 2} if ShardingStrategy.parse(strategy).is_hybrid else {}


def batches(cfg: GPTConfig, world: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (all ranks' data concatenated) for ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(0, cfg.vocab_size, (world * PER_RANK_BATCH, SEQ + 1), generator=gen)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def local_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole value of a (possibly DTensor) tensor; collective for DTensors.

    Always a copy: for replicated DTensors ``full_tensor()`` returns the local tensor itself.
    """
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def train(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    data: list,
    rank: int | None,
) -> dict[str, Any]:
    """AdamW steps; returns losses, first-step gradients and final parameters (whole tensors).

    ``rank=None`` trains on the whole global batch (the single-process reference).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], {}
    for step, (x, y) in enumerate(data):
        if rank is not None:
            x, y = local_slice(x, rank), local_slice(y, rank)
        loss = lm_loss(forward(x), y)
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params}


def fsdp2_model(model: nn.Module, strategy: ShardingStrategy, world: int, mp_policy=None) -> nn.Module:
    """torch's own FSDP2 configured as ``strategy``: one unit per block plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy is ShardingStrategy.NO_SHARD:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    elif strategy.is_hybrid:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    options = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward, **options)
    fully_shard(model, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward, **options)
    return model


def expect_error(fn: Callable[[], Any]) -> str:
    """The error ``fn`` raises, as 'Type: message'; fails if it raises nothing."""
    try:
        fn()
    except Exception as exc:  # the tests check type and wording
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{fn} raised nothing")


# ---------------------------------------------------------------- what compiled graphs communicate and keep
_c10d = torch.ops._c10d_functional
COLLECTIVE_TARGETS = (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
                      _c10d.all_reduce.default)


def collective_buffer_bytes(node: torch.fx.Node) -> int:
    """An all-gather's output, else the input: the full buffer a collective holds."""
    value = node.meta["val"] if node.target is _c10d.all_gather_into_tensor.default else node.args[0].meta["val"]
    return value.numel() * value.element_size()


def inflight_from_order(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(most bytes of collectives issued and not yet waited at any point, the largest collective's
    bytes), from the graph's node order and its collectives' buffers alone."""
    live: dict[torch.fx.Node, int] = {}
    peak = largest = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in COLLECTIVE_TARGETS:
            live[node] = collective_buffer_bytes(node)
            largest = max(largest, live[node])
            peak = max(peak, sum(live.values()))
        elif node.target is _c10d.wait_tensor.default:
            live.pop(node.args[0], None)
    return peak, largest


def later_stage_bytes(gm: torch.fx.GraphModule) -> int:
    """The largest collective whose input comes out of another collective's wait (a hybrid
    strategy's all-reduce of its reduce-scatter's result), read off the graph; 0 if none."""
    def from_a_wait(node: torch.fx.Node, hops: int = 4) -> bool:
        if node.op == "call_function" and node.target is _c10d.wait_tensor.default:
            return True
        return hops > 0 and node.op == "call_function" and any(
            from_a_wait(i, hops - 1) for i in node.all_input_nodes)

    return max((collective_buffer_bytes(n) for n in gm.graph.nodes
                if n.op == "call_function" and n.target in COLLECTIVE_TARGETS
                and any(from_a_wait(i) for i in n.all_input_nodes)), default=0)


def _collective_order(steps) -> tuple[list[str], list[bool]]:
    """Issue and wait events ("I0", "W0", ... numbered in issue order) of ``(kind, key)`` steps,
    kind one of issue, wait, compute; and per collective whether compute ran while it was in flight."""
    issued: dict[Any, int] = {}
    in_flight: set[int] = set()
    events, overlapped = [], []
    for kind, key in steps:
        if kind == "issue":  # a key may come again: an in-place collective on a buffer waited before
            issued[key] = len(overlapped)
            in_flight.add(issued[key])
            events.append(f"I{issued[key]}")
            overlapped.append(False)
        elif kind == "wait" and key in issued:
            in_flight.discard(issued[key])
            events.append(f"W{issued[key]}")
        elif kind == "compute":
            for i in in_flight:
                overlapped[i] = True
    return events, overlapped


def collective_order_in_graph(gm: torch.fx.GraphModule) -> tuple[list[str], list[bool]]:
    """The graph's collectives in node order (see :func:`_collective_order`)."""
    from fsdp_compile.passes.graph import is_compute

    def steps():
        for node in gm.graph.nodes:
            if node.target in COLLECTIVE_TARGETS:
                yield "issue", node
            elif node.target is _c10d.wait_tensor.default:
                yield "wait", node.args[0]
            elif is_compute(node):
                yield "compute", None
    return _collective_order(steps())


_CODE_COLLECTIVE = re.compile(r"^(?:(\w+) = )?torch\.ops\._c10d_functional\.(?!wait_tensor)\w+\.default\((\w+)")
_CODE_WAIT = re.compile(r"^torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
# A kernel launch in Inductor's wrapper code: C++ and Triton kernels, extern kernels (mm),
# ATen fallbacks, region bodies. Our copy-in and copy-out are communication, as in the graph.
_CODE_KERNEL = re.compile(r"^(?:\w+ = )?(?:cpp_fused_\w+\(|extern_kernels\.|\w+\.run\(|torch\.ops\.aten\.|"
                          r"partitioned_\w+\()")


def collective_order_in_code(code: str) -> tuple[list[str], list[bool]]:
    """The collectives in the ``call`` function of Inductor's wrapper code, the order the
    compiled step really runs in after Inductor's own scheduling (see :func:`_collective_order`)."""
    def steps():
        start = code.index("def call(")
        indent = start - code.rfind("\n", 0, start) - 1
        for line in code[start:].splitlines()[1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                return  # the end of call
            line = line.strip()
            if wait := _CODE_WAIT.match(line):
                yield "wait", wait.group(1)
            elif collective := _CODE_COLLECTIVE.match(line):
                # Functional collectives return their output; in-place ones (all_reduce_) are
                # waited on through their input.
                yield "issue", collective.group(1) or collective.group(2)
            elif _CODE_KERNEL.match(line):
                yield "compute", None
    return _collective_order(steps())


def _fake_world_orders(strategy: str, device: str) -> None:
    """Rank 0 of a fake world of two in this process (it issues nothing, but the graphs and
    Inductor's code are those of two ranks): prints as JSON the collective order of our
    scheduled graphs and of Inductor's wrapper code, and how many graphs Inductor reordered
    for peak memory (read off its own log)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    reordered = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Reordering for peak memory"):
                reordered.append(record)

    log = logging.getLogger("torch._inductor.memory")
    log.setLevel(logging.INFO)
    log.addHandler(Count())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, block_size=16, n_layer=4, n_head=2, d_model=32)).to(device)
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backend = fsdp_compile.backend(strategy, compiler="inductor", mixed_precision=mp)
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    idx = torch.randint(0, 67, (2, 17), device=device)

    def step() -> None:
        lm_loss(compiled(idx[:, :-1]), idx[:, 1:]).backward()

    _, codes = run_and_get_code(step)
    (record,) = backend.graphs
    print(json.dumps({**inductor_order(record, codes), "reordered_for_memory": len(reordered)}))
    dist.destroy_process_group()


def inductor_orders_in_a_fake_world(strategy: str, device: str, workdir: Path) -> dict:
    """:func:`_fake_world_orders` in a fresh process with its own Inductor cache."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]),
           "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"), "OMP_NUM_THREADS": "1"}
    code = f"import helpers; helpers._fake_world_orders({strategy!r}, {device!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def inductor_order(record, codes: list[str]) -> dict:
    """The collective order of a compiled graph pair and of Inductor's wrapper code for it
    (forward's first), for :func:`assert_inductor_keeps_the_order`."""
    return {"codes": len(codes),
            "graph": [collective_order_in_graph(g) for g in (record.forward, record.backward)],
            "code": [collective_order_in_code(c) for c in codes]}


def assert_inductor_keeps_the_order(order: dict) -> None:
    """Inductor's wrapper code issues and waits for the collectives in our graphs' order, and
    every collective our schedule overlaps with compute still has a kernel in flight with it."""
    assert order["codes"] == 2, "expected one forward and one backward module"
    for phase, (graph_events, graph_overlap), (code_events, code_overlap) in zip(
            ("forward", "backward"), order["graph"], order["code"]):
        assert code_events == graph_events, f"{phase}: ours {' '.join(graph_events)}; Inductor's {' '.join(code_events)}"
        lost = [i for i, (ours, theirs) in enumerate(zip(graph_overlap, code_overlap)) if ours and not theirs]
        assert lost == [], f"{phase}: collectives {lost} no longer overlap compute"


def compiled_regions(backend: fsdp_compile.FSDPBackend) -> tuple[int, int]:
    """(region calls, distinct bodies) in the forward graphs the backend compiled, after every
    pass of ours: what ran, where Dynamo's captured graph has the calls our passes inline too."""
    from fsdp_compile.passes.regions import is_region_call

    calls = [node for record in backend.graphs if record.forward is not None
             for node in record.forward.graph.nodes if is_region_call(node)]
    return len(calls), len({(id(c.graph), c.args[0].target) for c in calls})


def graph_facts(backend: fsdp_compile.FSDPBackend, model: nn.Module, inductor_code: list[str] | None = None) -> dict:
    """What the backend's (single) compiled graph pair communicates and keeps for backward; with
    Inductor's wrapper code of the pair (forward's first), the order of the collectives in our
    graphs and in that code."""
    from fsdp_compile.inspection.graphinfo import (
        collective_counts,
        marker_counts,
        missed_overlaps,
        saved_gathered_parameters,
    )

    (record,) = backend.graphs
    fw_buckets, bw_buckets = record.forward_buckets, record.backward_buckets
    memories = (record.forward_memory, record.backward_memory)
    return {
        # (peak in flight, largest collective) read off the node order, and the pass's budget.
        "inflight": [(*inflight_from_order(g), later_stage_bytes(g), s.budget if s else None) for g, s in
                     ((record.forward, record.forward_schedule), (record.backward, record.backward_schedule))],
        "backward_gather_bytes": sum(collective_buffer_bytes(n) for n in record.backward.graph.nodes
                                     if n.target is _c10d.all_gather_into_tensor.default),
        "parameter_memory": max(r["param"] + r["gathered"] + r["grad"] for m in memories for r in m.role_timeline),
        "missed_overlaps": missed_overlaps(record.forward) + missed_overlaps(record.backward),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "markers": {"forward": marker_counts(record.forward), "backward": marker_counts(record.backward)},
        "forward": collective_counts(record.forward),
        "backward": collective_counts(record.backward),
        "saved_gathered": saved_gathered_parameters(record.forward),
        "gather_buckets": [b.key for b in fw_buckets["unshard"]],
        "regather_buckets": [b.key for b in bw_buckets["unshard"]],
        "reduce_buckets": [b.key for b in bw_buckets["reduce_grad"]],
        "reduce_specs": sorted({b.spec for b in bw_buckets["reduce_grad"]}, key=repr),
        "reduced_params": sum(len(b.markers) for b in bw_buckets["reduce_grad"]),
        "inductor_order": None if inductor_code is None else inductor_order(record, inductor_code),
    }


def measured_step_memory(model: nn.Module, forward: Callable, batch: tuple, rank: int) -> dict[str, int]:
    """Parameter memory of one training step, read off the real tensors: the parameter storage
    this rank holds, the gathered parameters autograd keeps from forward to backward (saved
    tensors of the backward graph whose values are a whole parameter, or its transpose), and
    the gradient storage after backward."""
    full_params = [full(p) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    x, y = (local_slice(t, rank) for t in batch)
    loss = lm_loss(forward(x), y)
    resident = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    kept = saved_parameter_bytes(loss, full_params, resident)
    loss.backward()
    grads = local_storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    return {"params": local_storage_bytes(model.parameters()), "kept_gathered": kept, "grads": grads}


def saved_parameter_bytes(loss: torch.Tensor, full_params: list[torch.Tensor], resident: set[int]) -> int:
    """Bytes of the distinct storages autograd saved for backward that hold a whole parameter,
    other than the parameters' own (``resident``: their storages' addresses)."""
    def is_parameter(t: torch.Tensor) -> bool:
        return any(t.dtype == p.dtype and ((t.shape == p.shape and torch.equal(t, p)) or
                                           (t.dim() == 2 and t.shape == p.t().shape and torch.equal(t, p.t())))
                   for p in full_params)

    seen, total, visited, stack = set(resident), 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for t in getattr(node, "saved_tensors", None) or ():
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen and is_parameter(t):
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return total


def local_storage_bytes(tensors: nn.Module | Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a module's parameters), local shards
    for DTensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensors, nn.Module):
        tensors = tensors.parameters()
    seen, total = set(), 0
    for p in tensors:
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# ---------------------------------------------------------------- runs several test files read
# Hybrid strategies run as 2 "nodes" x 2 "devices".
WORLD = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 2, "NO_SHARD": 2, "HYBRID_SHARD": 4, "HYBRID_SHARD_ZERO2": 4}
STRATEGIES = list(WORLD)
STEPS = 5


def parity_worker(rank: int, world: int, strategy: str, modes: list[str], steps: int) -> dict:
    """Train the test GPT with each mode on the same data; rank 0 also trains the reference."""
    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in modes:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if mode == "fsdp2":
            fsdp2_model(model, strategy, world)
            out[mode] = train(model, model, data, rank)
            continue
        compiler = "aot_eager" if mode == "eager" else mode
        backend = fsdp_compile.backend(strategy, compiler=compiler, **hybrid_options(strategy))
        backend.shard(model)
        forward = model if mode == "eager" else torch.compile(model, backend=backend)
        # Inductor's wrapper code is the order its compiled step runs in (after its own scheduling).
        out[mode], codes = run_and_get_code(train, model, forward, data, rank)
        out[mode]["graphs"] = len(backend.graphs)
        if mode != "eager":
            out[mode]["facts"] = graph_facts(backend, model, codes if mode == "inductor" else None)
            out[mode]["measured_memory"] = measured_step_memory(model, forward, data[0], rank)
    if rank == 0:
        out["initial"] = {n: p.detach().clone() for n, p in base.named_parameters()}
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out if rank == 0 else {}


@functools.cache
def parity_run(strategy: str) -> dict:
    """Rank 0's results of training with every mode, FSDP2 and the single-process reference."""
    modes = ["eager", "aot_eager", "inductor", "fsdp2"]
    return run_workers(parity_worker, WORLD[strategy], strategy, modes, STEPS)[0]


def marker_compute_devices(backend: fsdp_compile.FSDPBackend, run: Callable[[], Any] | None = None) -> list:
    """The compute device every gather marker declares (in its spec, the last argument): read from
    the Dynamo graphs the backend compiled, or, for the eager runtime, from the markers ``run()``
    executes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_compile.runtime.collectives import CommSpec

    def device(spec: str) -> str:
        return str(CommSpec.from_op_args(spec).compute_device)

    def is_gather(target: Any) -> bool:
        return str(target).startswith("fsdp_compile.unshard")

    if run is None:
        return sorted({device(n.args[-1]) for g in backend.graphs for n in g.dynamo.graph.nodes
                       if n.op == "call_function" and is_gather(n.target)})

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_gather(func):
                self.seen.add(device(args[-1]))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        run()
    return sorted(log.seen)
