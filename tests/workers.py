"""Bodies of multi-process tests (importable by spawned workers) and their shared helpers."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT, GPTConfig

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


def graph_facts(backend: fsdp_compile.FSDPBackend, model: nn.Module) -> dict:
    """What the backend's (single) compiled graph pair communicates and keeps for backward."""
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
        "inflight": [(*inflight_from_order(g), s.budget if s else None) for g, s in
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


def peak_allocated(prof) -> int:
    """Most bytes the CPU allocator held at once during a profile, beyond what it held at the
    start: the "Total Allocated" its memory events carry (every thread's allocations)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


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
        out[mode] = train(model, forward, data, rank)
        out[mode]["graphs"] = len(backend.graphs)
        if mode != "eager":
            out[mode]["facts"] = graph_facts(backend, model)
            out[mode]["measured_memory"] = measured_step_memory(model, forward, data[0], rank)
    if rank == 0:
        out["initial"] = {n: p.detach().clone() for n, p in base.named_parameters()}
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out if rank == 0 else {}


class TiedLM(nn.Module):
    """Tied input/output embedding, a 0-d parameter and a buffer.

    No BatchNorm: its training-mode statistics are per-rank batch statistics, so data-parallel
    training legitimately differs from single-process training (as with DDP).
    """

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(idx)) * self.scale
        return self.head(h) / self.temperature


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


def storage_worker(rank: int, world: int, strategy: str) -> dict:
    from fsdp_compile.runtime.collectives import padded_rows

    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    padded_bytes = sum(
        padded_rows(p.shape[0], world) * (p.numel() // p.shape[0]) * p.element_size()
        for p in model.parameters()
    )
    fsdp_compile.backend(strategy).shard(model)
    return {"full": full_bytes, "padded_share": padded_bytes, "local": local_storage_bytes(model)}


def tied_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    """Shard TiedLM; report what sharding did and train it eagerly and compiled."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    base = TiedLM()
    cfg = GPTConfig(vocab_size=13)
    data = batches(cfg, world, steps)
    report: dict[str, Any] = {}
    for mode in ("eager", "aot_eager"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", **hybrid_options(strategy))
        backend.shard(model)
        report["same_object"] = model.head._parameters["weight"] is model.emb._parameters["weight"]
        report["unique_params"] = len(list(model.parameters()))
        report["placements"] = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()}
        report["buffers_plain"] = all(not isinstance(b, DTensor) for b in model.buffers())
        report["scale_unchanged"] = torch.equal(model.scale, base.scale)
        forward = model if mode == "eager" else torch.compile(model, backend=backend)
        report[mode] = train(model, forward, data, rank)
        report[mode]["still_tied"] = model.head._parameters["weight"] is model.emb._parameters["weight"]
        with torch.no_grad():  # an evaluation pass compiles an inference graph
            report[mode]["eval_logits"] = forward(local_slice(data[0][0], rank))
    if rank == 0:
        reference = copy.deepcopy(base)
        report["reference"] = train(reference, reference, data, None)
    return report


class TiedGPT(GPT):
    """The test GPT with its output head tied to the token embedding (GPT-2's layout)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.head.weight = self.tok_emb.weight


def tied_fsdp2_worker(rank: int, world: int, strategy: str, steps: int, lr: float) -> dict:
    """TiedGPT with blocks.0 frozen: the eager runtime, aot_eager and FSDP2, every step's gradients."""
    from fsdp_compile.inspection.graphinfo import collectives

    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = TiedGPT(TEST_CONFIG)
    base.blocks[0].requires_grad_(False)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in ("eager", "aot_eager", "fsdp2"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if mode == "fsdp2":
            forward = fsdp2_model(model, strategy, world)
        else:
            backend = fsdp_compile.backend(strategy, compiler="aot_eager", **hybrid_options(strategy))
            backend.shard(model)
            forward = model if mode == "eager" else torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        grads = []
        for x, y in data:
            lm_loss(forward(local_slice(x, rank)), local_slice(y, rank)).backward()
            grads.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
        out[mode] = {"grads": grads, "params": {n: full(p) for n, p in model.named_parameters()}}
        if mode == "aot_eager":
            (record,) = backend.graphs
            out[mode]["backward_collectives"] = [(c.kind, c.group_size, c.buffer_bytes)
                                                 for c in collectives(record.backward)]
    out["trainable_shapes"] = [tuple(p.shape) for p in base.parameters() if p.requires_grad]
    out["tied"] = base.head.weight is base.tok_emb.weight
    # The documented exception: a block applied twice reduces each call's gradient separately.
    torch.manual_seed(0)
    twice = BlockTwiceGPT(TEST_CONFIG)
    x, y = (local_slice(t, rank) for t in data[0])
    for mode in ("block_twice", "block_twice_fsdp2"):
        model = copy.deepcopy(twice)
        if mode == "block_twice_fsdp2":
            fsdp2_model(model, strategy, world)
        else:
            fsdp_compile.backend(strategy, **hybrid_options(strategy)).shard(model)
        lm_loss(model(x), y).backward()
        out[mode] = {n: full(p.grad) for n, p in model.named_parameters()}
    return out if rank == 0 else {}


class BlockTwiceGPT(GPT):
    """The test GPT applying its last block twice."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(self.blocks[-1](x)))


class EagerOnlyMLP(nn.Module):
    """An MLP whose forward Dynamo must not trace: it splits the model into two graphs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


def graph_break_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    base.blocks[0].mlp = EagerOnlyMLP(TEST_CONFIG.d_model)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in ("eager", "aot_eager"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", **hybrid_options(strategy))
        backend.shard(model)
        forward = model if mode == "eager" else torch.compile(model, backend=backend)
        out[mode] = train(model, forward, data, rank)
        out[mode]["graphs"] = len(backend.graphs)
    if rank == 0:
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out


def _group_ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def groups_worker(rank: int, world: int) -> dict:
    """Hybrid layouts from each way of describing them, plus training through one of them."""
    import datetime
    import os

    from torch.distributed.device_mesh import init_device_mesh

    def layout(backend) -> tuple:
        topo = backend.topology
        return _group_ranks(topo.shard_group), _group_ranks(topo.replicate_group)

    def shard_tiny(**options):
        backend = fsdp_compile.backend("HYBRID_SHARD", **options)
        backend.shard(nn.Linear(4, 4))
        return backend

    def timeouts(backend) -> list[float]:
        topo = backend.topology
        return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in (topo.shard_group, topo.replicate_group)]

    out = {}
    by_size = shard_tiny(shard_size=2)
    out["shard_size"] = layout(by_size)
    # Groups the backend creates get timeout=, else the default group's (tests: 300 s).
    out["timeouts"] = {"default": timeouts(by_size),
                       "given": timeouts(shard_tiny(shard_size=2, timeout=datetime.timedelta(seconds=123)))}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["local_world_size"] = layout(shard_tiny())
    del os.environ["LOCAL_WORLD_SIZE"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["mesh"] = layout(shard_tiny(mesh=mesh))
    # Groups given by the user, built in a non-contiguous layout: shard groups {0,2} and {1,3}.
    shard_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replicate_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pgs = (shard_groups[rank % 2], replicate_groups[rank // 2])
    out["process_groups"] = layout(shard_tiny(process_groups=pgs))
    out["flat"] = layout(_shard_flat())

    # The same training through user groups and through the equivalent mesh is bitwise equal.
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, 2)
    trained = {}
    for name, options in (("process_groups", {"process_groups": pgs}),
                          ("mesh", {"mesh": DeviceMeshFromLayout([[0, 2], [1, 3]])})):
        model = copy.deepcopy(base)
        fsdp_compile.backend("HYBRID_SHARD", compiler="aot_eager", **options).shard(model)
        trained[name] = train(model, model, data, rank)["params"]
    if rank == 0:
        reference = copy.deepcopy(base)
        trained["reference"] = train(reference, reference, data, None)["params"]
    out["trained"] = trained
    return out


def DeviceMeshFromLayout(layout: list[list[int]]):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(layout), mesh_dim_names=("replicate", "shard"))


def _shard_flat():
    backend = fsdp_compile.backend("FULL_SHARD")
    backend.shard(nn.Linear(4, 4))
    return backend


def expect_error(fn: Callable[[], Any]) -> str:
    """The error ``fn`` raises, as 'Type: message'; fails if it raises nothing."""
    try:
        fn()
    except Exception as exc:  # the tests check type and wording
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{fn} raised nothing")


def hybrid_errors_worker(rank: int, world: int) -> dict:
    """Bad hybrid layouts fail on every rank (no rank left waiting in a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    def shard_with(**options):
        return lambda: fsdp_compile.backend("HYBRID_SHARD", **options).shard(nn.Linear(4, 4))

    errors = {}
    errors["shard_size_not_dividing"] = expect_error(shard_with(shard_size=3))
    errors["no_node_size"] = expect_error(shard_with())
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pair[rank // 2]
    errors["replicas_inside_shard_group"] = expect_error(shard_with(process_groups=(mine, mine)))
    uneven = [dist.new_group([0]), dist.new_group([1, 2, 3])]
    errors["uneven_shard_groups"] = expect_error(
        shard_with(process_groups=(uneven[0] if rank == 0 else uneven[1], mine)))
    errors["one_group"] = expect_error(shard_with(process_groups=mine))
    flat_mesh = init_device_mesh("cpu", (world,))
    errors["flat_mesh_for_hybrid"] = expect_error(shard_with(mesh=flat_mesh))
    square = init_device_mesh("cpu", (2, 2))
    errors["square_mesh_for_flat"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", mesh=square).shard(nn.Linear(4, 4)))
    # Still in step afterwards: a collective completes on every rank.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    errors["still_in_step"] = flag.item() == world
    return errors


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


class RawWeight(nn.Module):
    """A parameter with no reset_parameters(): nothing can initialize it from the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def api_errors_worker(rank: int, world: int) -> dict:
    """Bad input to shard() and to compiled calls, at world 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    errors = {}
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    unsharded = Net()
    errors["not_sharded"] = expect_error(lambda: torch.compile(unsharded, backend=backend)(torch.randn(2, 4)))
    sharded = backend.shard(Net())
    errors["twice"] = expect_error(lambda: backend.shard(sharded))
    errors["not_a_module"] = expect_error(lambda: backend.shard(lambda x: x))
    errors["compiled_module"] = expect_error(lambda: backend.shard(torch.compile(Net())))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), RawWeight())
    errors["meta"] = expect_error(lambda: fsdp_compile.backend().shard(meta))
    tp = Net()
    mesh = init_device_mesh("cpu", (world,))
    tp.fc.weight = nn.Parameter(distribute_tensor(tp.fc.weight.detach(), mesh, [Shard(0)]))
    errors["foreign_dtensor"] = expect_error(lambda: fsdp_compile.backend().shard(tp))
    other = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    errors["other_backend"] = expect_error(lambda: torch.compile(sharded, backend=other)(torch.randn(2, 4)))

    replaced = backend.shard(Net())
    replaced.fc.weight = nn.Parameter(torch.randn(4, 4))  # nn.Module registers it as is
    errors["replaced_parameter"] = expect_error(lambda: replaced(torch.randn(2, 4)))
    return errors


def collectives_worker(rank: int, world: int) -> dict:
    """Run the collective semantics eagerly on a hybrid layout, logging the collectives issued."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_compile.runtime.collectives import (
        CommSpec,
        gather_params,
        reduce_grads,
        shard_bounds,
    )
    from fsdp_compile.sharding.groups import resolve_topology

    topo = resolve_topology(ShardingStrategy.HYBRID_SHARD, "cpu", shard_size=2)

    class LogCollectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default":
                group = args[-1]
                label = {topo.shard_group_name: "shard", topo.replicate_group_name: "replicate"}[group]
                self.calls.append((func.__name__.split(".")[0], label))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen), torch.randn(1, 2, generator=gen)]
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        spec = CommSpec(topo.shard_group_name, 2, True, topo.replicate_group_name, 2, None, dtype, True)
        shards = []
        for f in fulls:
            start, length = shard_bounds(f.shape[0], 2, topo.shard_rank)
            shards.append(f[start:start + length])
        gathered = gather_params(shards, [f.shape for f in fulls], spec)
        # Rank r contributes (r + 1) * full: the average over 4 ranks is 2.5 * full.
        grads = [f * (rank + 1) for f in fulls]
        with LogCollectives() as log:
            reduced = reduce_grads(grads, [s.shape[0] for s in shards], [torch.float32] * 3, spec)
        out[str(dtype)] = {
            "gathered_ok": all(torch.equal(g, f) for g, f in zip(gathered, fulls)),
            "reduced": reduced,
            "expected": [(s * 2.5) for s in shards],
            "calls": log.calls,
            "out_dtypes": [r.dtype for r in reduced],
        }
    return out


def one_rank_fails_worker(rank: int, world: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective."""
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))


def convenience_worker(rank: int, world: int) -> dict:
    """fsdp_compile.compile() against backend + shard + torch.compile, same data."""
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, 2)
    one_call = copy.deepcopy(base)
    compiled = fsdp_compile.compile(one_call, strategy="shard_grad_op", compiler="aot_eager")
    got = train(one_call, compiled, data, rank)
    torch._dynamo.reset()
    explicit = copy.deepcopy(base)
    backend = fsdp_compile.backend("SHARD_GRAD_OP", compiler="aot_eager")
    want = train(explicit, torch.compile(backend.shard(explicit), backend=backend), data, rank)
    return {"got": got["params"], "want": want["params"], "graphs": len(compiled.fsdp_backend.graphs),
            "strategy": compiled.fsdp_backend.strategy.name}


def attention_or_mlp(module: nn.Module) -> bool:
    """A callable bucket policy (as FSDP1's auto_wrap_policy): attention and MLP separately."""
    from fsdp_compile.models.gpt import MLP, CausalSelfAttention

    return isinstance(module, (CausalSelfAttention, MLP))


def bucket_policies() -> dict[str, Any]:
    from fsdp_compile.models.gpt import Block

    return {"module": "module", "param": "param", "bytes": 4096, "classes": {Block},
            "callable": attention_or_mlp}


def policy_worker(rank: int, world: int, strategy: str, policies: list[str], steps: int) -> dict:
    """The eager runtime (no buckets) and aot_eager under each bucket policy, on the same data."""
    from fsdp_compile.inspection.graphinfo import collectives

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    model = copy.deepcopy(base)
    fsdp_compile.backend(strategy, **hybrid_options(strategy)).shard(model)
    out["eager"] = train(model, model, data, rank)
    for name in policies:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", bucket=bucket_policies()[name],
                                       **hybrid_options(strategy))
        backend.shard(model)
        result = train(model, torch.compile(model, backend=backend), data, rank)
        (record,) = backend.graphs
        result["facts"] = graph_facts(backend, model)
        result["gather_bucket_bytes"] = [c.buffer_bytes for c in collectives(record.forward)
                                         if c.kind == "all_gather"]
        result["gather_bucket_sizes"] = [len({m.fqn for m in b.markers})
                                         for b in record.forward_buckets["unshard"]]
        out[name] = result
    return out if rank == 0 else {}


class AllNeeded(nn.Module):
    """Every parameter is needed by backward: no biases, and the input itself requires grad.

    Row counts (7, 3) do not divide 2 or 4, so every buffer carries padding.
    """

    def __init__(self, dim: int = 7, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim, bias=False), nn.LayerNorm(dim, bias=False)) for _ in range(depth))
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def theoretical_bytes(model: nn.Module, strategy: ShardingStrategy, shard: int, replicas: int,
                      compute: torch.dtype, reduce: torch.dtype) -> dict[str, int]:
    """Collective buffer bytes per rank per step that the strategy implies, from shapes alone
    (dim 0 padded up to a multiple of the shard group, as torch.chunk cuts it)."""
    padded = sum(-(-p.shape[0] // shard) * (p.numel() // p.shape[0]) for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    c, r = compute.itemsize, reduce.itemsize
    if strategy is ShardingStrategy.NO_SHARD:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": whole * r}
    gathers = 2 if strategy.reshard_after_forward else 1  # forward, and again in backward
    return {
        "all_gather": gathers * shard * padded * c,
        "reduce_scatter": shard * padded * r,
        "all_reduce": padded * r if replicas > 1 else 0,
    }


def bytes_worker(rank: int, world: int, strategy: str) -> dict:
    """Theory, compiled graphs and a profiled step, for fp32 and for bf16 compute / fp32 reduce."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_compile.inspection.graphinfo import collectives

    strategy = ShardingStrategy.parse(strategy)
    out = {}
    for label, mp in (("fp32", None), ("bf16", fsdp_compile.MixedPrecision(torch.bfloat16, torch.float32))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = AllNeeded()
        backend = fsdp_compile.backend(strategy, compiler="aot_eager", mixed_precision=mp,
                                       **hybrid_options(strategy))
        full_model = copy.deepcopy(model)
        backend.shard(model)
        topo = backend.topology
        compute = mp.param_dtype if mp else torch.float32
        theory = theoretical_bytes(full_model, strategy, topo.shard_size, topo.replicate_size,
                                   compute, torch.float32)
        compiled = torch.compile(model, backend=backend)

        def step():
            x = torch.randn(4, 7, requires_grad=True)
            compiled(x).square().mean().backward()

        step()
        (record,) = backend.graphs
        graph = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        for c in collectives(record.forward) + collectives(record.backward):
            graph[c.kind] += c.buffer_bytes
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        # Element counts and dtypes as the profiler recorded the collectives' inputs; an
        # all-gather's buffer is its output, the input times the group size.
        profiled = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        itemsize = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}
        for event in prof.events():
            if event.name.startswith("_c10d_functional::") and "wait" not in event.name:
                kind = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                        "all_reduce": "all_reduce"}[event.name.split("::")[1]]
                numel = 1
                for d in event.input_shapes[0]:
                    numel *= d
                profiled[kind] += numel * itemsize[event.input_dtypes[0]] * (
                    topo.shard_size if kind == "all_gather" else 1)
        out[label] = {"theory": theory, "graph": graph, "profiled": profiled}
    return out


# Matmul-like ops and how many leading arguments are the operands they multiply (the CPU
# attention backward also takes its fp32 logsumexp, which is not an operand).
MATMULS = {torch.ops.aten.mm.default: 2, torch.ops.aten.addmm.default: 3, torch.ops.aten.bmm.default: 2,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 5}


def mixed_precision_worker(rank: int, world: int, strategy: str, modes: list[str], steps: int) -> dict:
    """bf16 compute with fp32 reduction: every mode, FSDP2 with the same policy, fp32 reference.

    Modes ending in ``_default`` leave reduce_dtype unset (it defaults to param_dtype, bf16), for
    us and for FSDP2 alike."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in modes:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        kind = mode.removesuffix("_default")
        reduce_dtype = None if mode.endswith("_default") else torch.float32
        if kind == "fsdp2":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            forward = fsdp2_model(model, strategy, world, mp)
        else:
            policy = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            compiler = "aot_eager" if kind == "eager" else kind
            backend = fsdp_compile.backend(strategy, compiler=compiler, mixed_precision=policy,
                                           **hybrid_options(strategy))
            backend.shard(model)
            forward = model if kind == "eager" else torch.compile(model, backend=backend)
        result = train(model, forward, data, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = (local_slice(t, rank) for t in data[0])
        logits = forward(x)
        lm_loss(logits, y).backward()
        opt.step()
        result["dtypes"] = {
            "logits": logits.dtype,
            "shards": {p.dtype for p in model.parameters()},
            "grads": {p.grad.dtype for p in model.parameters()},
            "optimizer_state": {v.dtype for s in opt.state.values() for v in s.values() if v.dim()},
        }
        if kind not in ("eager", "fsdp2"):
            from fsdp_compile.inspection.graphinfo import collectives

            (record,) = backend.graphs
            result["fallbacks"] = record.fallbacks
            # Every (kind, dtype) pair: one kind may run in several dtypes.
            result["collective_dtypes"] = sorted(
                {(c.kind, str(c.dtype)) for c in collectives(record.forward) + collectives(record.backward)})
            # The dtypes the matmuls of the graphs handed to the inner compiler multiply.
            result["matmul_dtypes"] = sorted({
                str(a.meta["val"].dtype) for g in (record.forward, record.backward) for n in g.graph.nodes
                if n.op == "call_function" and n.target in MATMULS
                for a in n.args[:MATMULS[n.target]] if isinstance(a, torch.fx.Node)})
        out[mode] = result
    if rank == 0:
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out if rank == 0 else {}


class EchoNet(nn.Module):
    """Returns its output and the input it received (to see what the casts did)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x) * scale, x, scale


def casts_worker(rank: int, world: int) -> dict:
    out = {}
    cases = {
        "default": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16),
        "output_fp32": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        "no_input_cast": fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False),
    }
    for name, policy in cases.items():
        for mode in ("eager", "aot_eager"):
            torch._dynamo.reset()
            model = EchoNet()
            backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", mixed_precision=policy)
            backend.shard(model)
            forward = model if mode == "eager" else torch.compile(model, backend=backend)
            x = torch.randn(2, 4)
            try:
                y, seen, scale = forward(x, scale=torch.tensor(2.0))
                out[(name, mode)] = {"output": y.dtype, "input_seen": seen.dtype, "kwarg_seen": scale.dtype,
                                     "graphs": len(backend.graphs)}
            except Exception as exc:
                out[(name, mode)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def unscheduled_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    """aot_eager with the scheduling pass off, on the parity runs' data."""
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    backend = fsdp_compile.backend(strategy, compiler="aot_eager", schedule=False, **hybrid_options(strategy))
    backend.shard(model)
    out = train(model, torch.compile(model, backend=backend), data, rank)
    (record,) = backend.graphs
    out["scheduled"] = record.forward_schedule is not None
    return out if rank == 0 else {}


COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::native_layer_norm", "aten::native_layer_norm_backward",
               "aten::gelu", "aten::gelu_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::embedding_dense_backward")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_worker(rank: int, world: int, schedule: bool) -> dict:
    """Profile training steps; report how long gloo collectives ran while the main thread computed."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=67, block_size=64, n_layer=4, n_head=4, d_model=128)
    model = GPT(cfg)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", schedule=schedule)
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    x = torch.randint(0, cfg.vocab_size, (4, 64))
    for _ in range(2):
        compiled(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            compiled(x).sum().backward()
    events = prof.events()
    # The profiler numbers threads itself: the main thread is the one issuing collectives.
    main = next(e.thread for e in events if e.name.startswith("_c10d_functional::"))
    comms = _union([(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("gloo:")])
    computes = _union([(e.time_range.start, e.time_range.end) for e in events
                       if e.name in COMPUTE_OPS and e.thread == main])
    overlap = sum(max(0.0, min(ce, ke) - max(cs, ks)) for cs, ce in comms for ks, ke in computes)
    return {"overlap_us": overlap, "comm_us": sum(e - s for s, e in comms),
            "compute_us": sum(e - s for s, e in computes),
            "comms_on_main_thread": any(e.thread == main for e in events if e.name.startswith("gloo:"))}


def schedule_errors_worker(rank: int, world: int) -> dict:
    errors = {}
    torch._dynamo.reset()
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", max_inflight_bytes=1000)
    backend.shard(model)
    x = torch.randint(0, TEST_CONFIG.vocab_size, (2, SEQ))
    errors["small_budget"] = expect_error(lambda: torch.compile(model, backend=backend)(x))
    errors["unknown_unit"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", forward_prefetch={"blocks.0": ["blocks.7"]}).shard(GPT(TEST_CONFIG)))
    model = GPT(TEST_CONFIG)
    errors["unknown_module"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", backward_prefetch={model.blocks[1]: [model.blocks[1].mlp]}).shard(model))
    return errors


def dump_worker(rank: int, world: int, dump_dir: str, via_env: bool) -> dict:
    """One compiled training step of the test GPT with dumping on; returns backend.report()."""
    import os

    if via_env:
        os.environ["FSDP_COMPILE_DUMP"] = dump_dir
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    options = {} if via_env else {"dump_dir": dump_dir}
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", **options)
    backend.shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(torch.compile(model, backend=backend)(x), y).backward()
    return {"report": backend.report()}


def dump_error_worker(rank: int, world: int, dump_dir: str, strategy: str) -> str:
    torch._dynamo.reset()
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend(strategy, compiler="aot_eager", dump_dir=dump_dir)
    backend.shard(model)
    x = torch.randint(0, TEST_CONFIG.vocab_size, (2, SEQ))
    return expect_error(lambda: torch.compile(model, backend=backend)(x))


def eager_fallback_worker(rank: int, world: int, strategy: str, steps: int) -> dict:
    """compiler="eager", FSDP_COMPILE_EAGER=1 and aot_eager on the same data."""
    import os

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    options = hybrid_options(strategy)  # hybrid: 2 x 2, so the shard group really reduce-scatters
    out = {}
    for mode in ("eager", "env", "aot_eager"):
        torch._dynamo.reset()
        if mode == "env":
            os.environ["FSDP_COMPILE_EAGER"] = "1"
        model = copy.deepcopy(base)
        backend = fsdp_compile.backend(strategy, compiler="eager" if mode == "eager" else "aot_eager", **options)
        backend.shard(model)
        out[mode] = train(model, torch.compile(model, backend=backend), data, rank)
        out[mode]["compilers"] = [g.compiler for g in backend.graphs]
        out[mode]["shard_size"] = backend.topology.shard_size
        os.environ.pop("FSDP_COMPILE_EAGER", None)
    return out if rank == 0 else {}


def failing_pass(gm):
    raise ValueError("deliberately broken pass")


def failing_pass_worker(rank: int, world: int, phase: str, strict: bool, steps: int) -> dict:
    """A user pass that raises: the graph falls back to the eager runtime, or strict raises."""
    import warnings

    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", strict=strict,
                                   passes={phase: [failing_pass]})
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if strict:
            return {"error": expect_error(lambda: train(model, compiled, data, rank))}
        broken = train(model, compiled, data, rank)
    (record,) = backend.graphs
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    backend.shard(model)
    healthy = train(model, torch.compile(model, backend=backend), data, rank)
    from fsdp_compile.inspection.graphinfo import collective_counts, marker_counts

    graph = record.forward if phase == "forward" else record.backward
    return {"warnings": [str(w.message) for w in caught], "fallbacks": record.fallbacks,
            "broken": broken["params"], "healthy": healthy["params"],
            "markers": marker_counts(graph), "collectives": collective_counts(graph)}


def double_output(gm: torch.fx.GraphModule) -> None:
    """A user pass that changes results visibly: the forward graph's first output (the
    model's output) doubled. Rewrites in place."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, *rest = output.args[0]
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (first, 2))
    doubled.meta["val"] = first.meta["val"]
    output.args = ((doubled, *rest),)


def rebuilt(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A user pass that returns a new GraphModule instead of rewriting in place."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def user_pass_worker(rank: int, world: int, dump_dir: str) -> dict:
    """User passes on both phases, dumped; compiled output against the eager runtime's."""
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", dump_dir=dump_dir,
                                   passes={"forward": [double_output], "backward": [rebuilt]})
    backend.shard(model)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    compiled = torch.compile(model, backend=backend)(x)
    lm_loss(compiled, y).backward()
    eager = model(x)
    (record,) = backend.graphs
    output = next(n for n in record.forward.graph.nodes if n.op == "output")
    return {"doubled": torch.equal(compiled, 2 * eager), "fallbacks": record.fallbacks,
            "first_output": str(output.args[0][0].target)}


def overlapped_compute(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Per gathered bucket, the compute nodes between its all-gather and that gather's wait (in
    node order). Buckets are told apart by the tag lowering puts on their nodes."""
    from fsdp_compile.passes.graph import COMM_META

    nodes = list(gm.graph.nodes)
    issued = {n: i for i, n in enumerate(nodes) if n.target is _c10d.all_gather_into_tensor.default}
    out = {}
    for i, node in enumerate(nodes):
        if node.target is _c10d.wait_tensor.default and node.args[0] in issued:
            start = issued[node.args[0]]
            out[node.args[0].meta[COMM_META].bucket] = sum(
                1 for n in nodes[start + 1:i] if n.op == "call_function" and COMM_META not in n.meta)
    return out


def explicit_prefetch_worker(rank: int, world: int) -> dict:
    """prefetch=0, with and without an explicit order (names in forward, modules in backward)."""
    out = {}
    for name in ("explicit", "none"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(TEST_CONFIG)
        orders = {"forward_prefetch": {"blocks.0": ["blocks.1"]},
                  "backward_prefetch": {model.blocks[1]: [model.blocks[0]]}} if name == "explicit" else {}
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", prefetch=0, **orders)
        backend.shard(model)
        x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
        lm_loss(torch.compile(model, backend=backend)(x), y).backward()
        (record,) = backend.graphs
        out[name] = {"forward": overlapped_compute(record.forward), "backward": overlapped_compute(record.backward)}
    return out
