"""Bodies of the training-loop tests (tests/test_training_loop.py), run on several processes.

One run per strategy exercises every feature in the eager runtime and compiled (aot_eager), so
the processes start once. Rank 0 returns what the tests check, including single-process
references trained on the global batch; other ranks return only what is rank-specific.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from workers import (
    LR,
    TEST_CONFIG,
    batches,
    expect_error,
    full,
    hybrid_options,
    lm_loss,
    local_slice,
)

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT, GPTConfig

MODES = ("eager", "aot_eager")
MAX_NORM = 0.5  # below the test GPT's gradient norms (about 1 to 1.5): clipping really scales


def make(base: nn.Module, strategy: ShardingStrategy, mode: str, **options: Any):
    """A sharded copy of ``base`` and how to call it in ``mode`` ("eager": the eager runtime,
    else compiled with that inner compiler): (model, forward, backend)."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    compiler = "aot_eager" if mode == "eager" else mode
    backend = fsdp_compile.backend(strategy, compiler=compiler, **hybrid_options(strategy), **options)
    backend.shard(model)
    forward = model if mode == "eager" else torch.compile(model, backend=backend)
    return model, forward, backend


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def gloo_events(fn: Callable[[], Any]) -> list[str]:
    """Names of the collectives gloo ran during ``fn()`` (the profiler sees every one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def graph_collectives(backend: fsdp_compile.FSDPBackend) -> list[dict]:
    from fsdp_compile.inspection.graphinfo import collective_counts

    return [{"forward": collective_counts(g.forward), "backward": collective_counts(g.backward)}
            for g in backend.graphs]


def reference_train(base: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]],
                    clip: float | None = None) -> dict:
    """Single-process AdamW on the global batch; each step concatenates its micro-batches."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": [], "clipped_grads": []}
    for micro in steps:
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        loss = lm_loss(model(x), y)
        loss.backward()
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        if clip is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            out["clipped_grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                         if p.grad is not None})
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------- gradient accumulation + clipping
# Each step's micro-batches. The last step runs all its micro-batches under no_sync and ends
# with backend.reduce_accumulated_gradients().
ACCUMULATION_PLAN = [[0], [1, 2], [3, 4, 5], [6, 7]]


def accumulation_case(rank: int, world: int, strategy: ShardingStrategy, mode: str, base: nn.Module) -> dict:
    """Step 1: one micro-batch, synchronized. Step 2: two micro-batches, the first under
    ``backend.no_sync()``. Step 3: three, with ``set_requires_gradient_sync``. Step 4: two, both
    without sync, reduced by ``reduce_accumulated_gradients()``. Every step is clipped with
    torch's own ``clip_grad_norm_`` (on the DTensor gradients) and, from the same gradients,
    with :func:`fsdp_compile.clip_grad_norm_`."""
    plan = ACCUMULATION_PLAN
    data = batches(TEST_CONFIG, world, 1 + plan[-1][-1])
    model, forward, backend = make(base, strategy, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"grads": [], "norms": [], "torch_norms": [], "clipped_grads": [],
                           "torch_clipped_grads": [], "no_sync_collectives": [], "synced_collectives": []}
    for step, micro in enumerate(plan):
        manual = step == len(plan) - 1
        for i, index in enumerate(micro):
            x, y = (local_slice(t, rank) for t in data[index])
            last = i == len(micro) - 1
            if last and not manual:
                # The positive control: the same profiler query sees this backward reduce.
                loss = lm_loss(forward(x), y) / len(micro)
                out["synced_collectives"].append(gloo_events(loss.backward))
            elif step == 1 or manual:
                with backend.no_sync():
                    loss = lm_loss(forward(x), y) / len(micro)
                    out["no_sync_collectives"] += gloo_events(loss.backward)
            else:
                backend.set_requires_gradient_sync(False)
                loss = lm_loss(forward(x), y) / len(micro)
                out["no_sync_collectives"] += gloo_events(loss.backward)
                backend.set_requires_gradient_sync(True)
        if manual:
            out["grads_before_manual_reduce"] = sum(p.grad is not None for p in model.parameters())
            backend.reduce_accumulated_gradients()
        out["grads"].append(full_grads(model))
        # torch's own clipping on our DTensor gradients, then ours from the same gradients.
        params = [p for p in model.parameters() if p.grad is not None]
        unclipped = [p.grad.to_local().clone() for p in params]
        torch_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        out["torch_norms"].append(float(torch_norm.full_tensor() if hasattr(torch_norm, "full_tensor") else torch_norm))
        out["torch_clipped_grads"].append(full_grads(model))
        with torch.no_grad():
            for p, g in zip(params, unclipped):
                p.grad.to_local().copy_(g)
        out["norms"].append(fsdp_compile.clip_grad_norm_(model, MAX_NORM).item())
        out["clipped_grads"].append(full_grads(model))
        opt.step()
        opt.zero_grad()
    out["params"] = full_params(model)
    out["graphs"] = len(backend.graphs)
    out["graph_collectives"] = graph_collectives(backend)
    if rank == 0:
        global_steps = [[data[i] for i in micro] for micro in plan]
        out["reference"] = reference_train(base, global_steps, clip=MAX_NORM)
    return out


# ---------------------------------------------------------------- frozen parameters
def freeze(model: nn.Module) -> nn.Module:
    """A whole frozen block, and a frozen weight whose bias trains (LoRA-style, one bucket)."""
    model.blocks[0].requires_grad_(False)
    model.blocks[1].mlp.fc.weight.requires_grad_(False)
    return model


def two_step_case(rank: int, world: int, strategy: ShardingStrategy, mode: str, base: nn.Module,
                  plan: tuple[tuple[int, ...], ...] = ((0,), (1,)),
                  **options: Any) -> tuple[dict, nn.Module, Callable, torch.optim.Optimizer, Any]:
    """AdamW steps over ``plan`` (each step's micro-batches, every backward synchronized: several
    micro-batches accumulate reduced gradients in param.grad); returns the record, the model,
    how to call it, its optimizer and its backend."""
    data = batches(TEST_CONFIG, world, 1 + max(i for micro in plan for i in micro))
    model, forward, backend = make(base, strategy, mode, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"losses": []}
    for step, micro in enumerate(plan):
        for index in micro:
            x, y = (local_slice(t, rank) for t in data[index])
            loss = lm_loss(forward(x), y)
            (loss / len(micro)).backward()
        if step == 0:
            out["grads0"] = full_grads(model)
            out["grad_is_none"] = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = full_params(model)
    out["graph_collectives"] = graph_collectives(backend)
    out["marker_compute_devices"] = marker_compute_devices(backend)
    if backend.graphs:
        from workers import graph_facts

        out["facts"] = graph_facts(backend, model)
    if rank == 0:
        out["reference"] = reference_train(base, [[data[i] for i in micro] for micro in plan])
    return out, model, forward, opt, backend


def frozen_case(rank: int, world: int, strategy: ShardingStrategy, mode: str, base: nn.Module) -> dict:
    frozen = freeze(copy.deepcopy(base))
    out, *_ = two_step_case(rank, world, strategy, mode, frozen)
    out["frozen"] = [n for n, p in frozen.named_parameters() if not p.requires_grad]
    out["initial"] = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    return out


# ---------------------------------------------------------------- activation checkpointing
def with_activation_checkpointing(base: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    model = copy.deepcopy(base)
    model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
    return model


def activation_checkpointing_case(rank: int, world: int, strategy: ShardingStrategy, mode: str,
                                  base: nn.Module) -> dict:
    out, *_ = two_step_case(rank, world, strategy, mode, with_activation_checkpointing(base))
    return out


# ---------------------------------------------------------------- CPU offload
def marker_compute_devices(backend: fsdp_compile.FSDPBackend, run: Callable[[], Any] | None = None) -> list:
    """The compute device every gather marker declares (its last argument): read from the Dynamo
    graphs the backend compiled, or, for the eager runtime, from the markers ``run()`` executes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def is_gather(target: Any) -> bool:
        return str(target).startswith("fsdp_compile.unshard")

    if run is None:
        return sorted({str(n.args[-1]) for g in backend.graphs for n in g.dynamo.graph.nodes
                       if n.op == "call_function" and is_gather(n.target)})

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_gather(func):
                self.seen.add(str(args[-1]))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        run()
    return sorted(log.seen)


def offload_case(rank: int, world: int, strategy: ShardingStrategy, mode: str, base: nn.Module) -> dict:
    """Step 1 accumulates two micro-batches with sync on (the accumulation offload allows),
    step 2 has one; then one more compiled (or eager) step to read where everything lives."""
    out, model, forward, opt, backend = two_step_case(rank, world, strategy, mode, base, plan=((0, 1), (2,)),
                                                      offload=fsdp_compile.CPUOffload(pin_memory=True))
    out["shard_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
    out["shards_pinned"] = sorted({p.to_local().is_pinned() for p in model.parameters()})
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])

    def step() -> None:
        lm_loss(forward(x), y).backward()

    if mode == "eager":
        out["marker_compute_devices"] = marker_compute_devices(backend, step)
    else:
        step()  # reading devices after a compiled step, not an eager one
        out["marker_compute_devices"] = marker_compute_devices(backend)
    out["grad_devices"] = sorted({p.grad.to_local().device.type for p in model.parameters()})
    opt.step()
    out["optimizer_state_devices"] = sorted({v.to_local().device.type if hasattr(v, "to_local") else v.device.type
                                             for s in opt.state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor) and v.dim()})
    out["no_sync_error"] = expect_error(lambda: backend.no_sync().__enter__())
    return out


# ---------------------------------------------------------------- checkpoints
def checkpoint_case(rank: int, world: int, strategy: ShardingStrategy, mode: str, base: nn.Module,
                    path: str) -> dict:
    """Save after 2 of 4 steps; a differently initialized model loads it and trains steps 3-4."""
    data = batches(TEST_CONFIG, world, 4)

    def run(model, forward, opt, steps) -> list[float]:
        losses = []
        for x, y in steps:
            loss = lm_loss(forward(local_slice(x, rank)), local_slice(y, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, forward, _ = make(base, strategy, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run(model, forward, opt, data[:2])
    out: dict[str, Any] = {}
    state = model.state_dict()
    out["state_dict_collectives"] = gloo_events(model.state_dict)
    out["state_dict_types"] = sorted({type(v).__name__ for v in state.values()})
    out["state_dict_local_numel"] = sum(v.to_local().numel() for v in state.values())
    out["saved_params"] = full_params(model)
    out["saved_exp_avg"] = {n: full(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
    fsdp_compile.save_checkpoint(path, model, opt, extra={"step": 2})
    out["uninterrupted_losses"] = run(model, forward, opt, data[2:])
    out["uninterrupted_params"] = full_params(model)

    torch.manual_seed(123)  # other initial values: everything must come from the checkpoint
    other = GPT(TEST_CONFIG)
    resumed, forward, _ = make(other, strategy, mode)
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    out["extra"] = fsdp_compile.load_checkpoint(path, resumed, opt)
    out["resumed_losses"] = run(resumed, forward, opt, data[2:])
    out["resumed_params"] = full_params(resumed)
    return out


def load_foreign_checkpoint(rank: int, world: int, strategy: ShardingStrategy, path: str) -> dict:
    """Load a checkpoint that another world size or strategy wrote, then train one step."""
    torch.manual_seed(321)
    model, forward, _ = make(GPT(TEST_CONFIG), strategy, "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    extra = fsdp_compile.load_checkpoint(path, model, opt)
    out = {"extra": extra, "params": full_params(model),
           "exp_avg": {n: full(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}}
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(forward(x), y).backward()
    opt.step()
    out["trained"] = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
    return out


def checkpoint_errors(rank: int, world: int, strategy: ShardingStrategy, path: str) -> dict:
    """Mismatched models, and a failed save that must leave the previous checkpoint intact."""
    errors: dict[str, Any] = {}
    deeper, _, _ = make(GPT(GPTConfig(vocab_size=67, block_size=19, n_layer=3, n_head=2, d_model=32)),
                        strategy, "eager")
    errors["missing"] = expect_error(lambda: fsdp_compile.load_checkpoint(path, deeper))
    wider, _, _ = make(GPT(GPTConfig(vocab_size=71, block_size=19, n_layer=2, n_head=2, d_model=32)),
                       strategy, "eager")
    errors["shape"] = expect_error(lambda: fsdp_compile.load_checkpoint(path, wider))
    errors["no_checkpoint"] = expect_error(lambda: fsdp_compile.load_checkpoint(path + "-nowhere", wider))

    torch.manual_seed(5)
    model, _, _ = make(GPT(TEST_CONFIG), strategy, "eager")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # An extra value torch.save cannot pickle: the save fails after the shards were written.
    errors["failed_save"] = expect_error(
        lambda: fsdp_compile.save_checkpoint(path, model, opt, extra={"step": 99, "bad": lambda: None}))
    errors["leftovers"] = sorted(os.listdir(os.path.dirname(path)))
    fsdp_compile.load_checkpoint(path, model, opt)
    errors["params_after_failed_save"] = full_params(model)
    return errors


# ---------------------------------------------------------------- full state dict
def full_state_dict_case(rank: int, world: int, strategy: ShardingStrategy, base: nn.Module) -> dict:
    out: dict[str, Any] = {}
    model, _, _ = make(base, strategy, "eager")
    state = fsdp_compile.full_state_dict(model)
    out["keys"] = sorted(state)
    out["devices"] = sorted({v.device.type for v in state.values()})
    everywhere = fsdp_compile.full_state_dict(model, rank0_only=False)
    out["everywhere_keys"] = sorted(everywhere)
    if rank == 0:
        plain = GPT(TEST_CONFIG)  # an ordinary single-device module
        plain.load_state_dict(state)
        out["plain_equals_base"] = all(torch.equal(plain.state_dict()[k], v) for k, v in base.state_dict().items())
        torch.manual_seed(77)
        edited = GPT(TEST_CONFIG).state_dict()  # new values to load back
    else:
        edited = {}
    # Every rank passes the values...
    target, _, _ = make(GPT(TEST_CONFIG), strategy, "eager")
    source = [edited]
    dist.broadcast_object_list(source, src=0)
    fsdp_compile.load_full_state_dict(target, source[0])
    out["loaded"] = full_params(target)
    # ... or only rank 0 does.
    target0, _, _ = make(GPT(TEST_CONFIG), strategy, "eager")
    fsdp_compile.load_full_state_dict(target0, edited, from_rank0=True)
    out["loaded_from_rank0"] = full_params(target0)
    out["edited"] = {k: v for k, v in source[0].items()}
    bad = dict(source[0])
    bad.pop("head.weight")
    bad["tok_emb.weight"] = torch.zeros(3, 3)
    out["mismatch_error"] = expect_error(lambda: fsdp_compile.load_full_state_dict(target, bad))
    return out


# ---------------------------------------------------------------- big-model initialization
class Stack(nn.Module):
    """Standard layers only, so ``reset_parameters`` is the whole initialization."""

    def __init__(self, vocab: int = 67, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(self.norm(x))


def gpt_init(module: nn.Module) -> None:
    """The test GPT's initialization as a per-module function (what a user passes as init_fn)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    GPT._init_weights(module)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def meta_init_case(rank: int, world: int, strategy: ShardingStrategy) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from workers import peak_allocated

    out: dict[str, Any] = {}
    # reset_parameters(): equals ordinary construction with the same seed.
    torch.manual_seed(11)
    reference = Stack()
    with torch.device("meta"):
        model = Stack()
    backend = fsdp_compile.backend(strategy, **hybrid_options(strategy))
    torch.manual_seed(11)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.shard(model)
    out["stack_measured_peak"] = peak_allocated(prof)  # what the allocator held at most during shard()
    out["stack_equal"] = all(torch.equal(full(p), reference.get_parameter(n)) for n, p in model.named_parameters())
    out["stack_peak"] = backend.init_peak_bytes
    out["stack_total"] = param_bytes(reference)
    root = sum(param_bytes(m) for m in (reference.emb, reference.norm, reference.out))
    out["stack_bound"] = root + param_bytes(reference.layers[0])
    out["stack_local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    # init_fn: equals the unsharded model initialized by the same function with the same seed.
    with torch.device("meta"):
        unsharded = GPT(TEST_CONFIG)
    unsharded.to_empty(device="cpu")
    torch.manual_seed(12)
    unsharded.apply(gpt_init)
    with torch.device("meta"):
        model = GPT(TEST_CONFIG)
    torch.manual_seed(12)
    fsdp_compile.backend(strategy, **hybrid_options(strategy)).shard(model, init_fn=gpt_init)
    out["gpt_equal"] = all(torch.equal(full(p), unsharded.get_parameter(n)) for n, p in model.named_parameters())
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    lm_loss(model(x), y).backward()  # the materialized model trains
    out["gpt_trains"] = all(p.grad is not None for p in model.parameters())

    with torch.device("meta"):
        lazy = Stack()
    out["init_fn_writes_nothing"] = expect_error(lambda: fsdp_compile.backend(strategy, **hybrid_options(strategy))
                                                 .shard(lazy, init_fn=lambda module: None))
    out["init_fn_without_meta"] = expect_error(lambda: fsdp_compile.backend(strategy, **hybrid_options(strategy))
                                               .shard(Stack(), init_fn=gpt_init))
    return out


# ---------------------------------------------------------------- the run per strategy
def loop_worker(rank: int, world: int, strategy: str, checkpoint_root: str, foreign: str | None,
                modes: tuple[str, ...] = MODES) -> dict:
    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    out: dict[str, Any] = {}
    for mode in modes:
        out[mode] = {
            "accumulation": accumulation_case(rank, world, strategy, mode, base),
            "frozen": frozen_case(rank, world, strategy, mode, base),
            "activation_checkpointing": activation_checkpointing_case(rank, world, strategy, mode, base),
            "offload": offload_case(rank, world, strategy, mode, base),
            "checkpoint": checkpoint_case(rank, world, strategy, mode, base, os.path.join(checkpoint_root, mode)),
        }
    if modes != MODES:
        return out if rank == 0 else {}
    out["checkpoint_errors"] = checkpoint_errors(rank, world, strategy, os.path.join(checkpoint_root, "aot_eager"))
    out["full_state_dict"] = full_state_dict_case(rank, world, strategy, base)
    out["meta_init"] = meta_init_case(rank, world, strategy)
    if foreign is not None:
        out["foreign"] = load_foreign_checkpoint(rank, world, strategy, foreign)
    out["errors"] = {
        "clip_zero": expect_error(lambda: fsdp_compile.clip_grad_norm_(base, 0.0)),
        "clip_negative": expect_error(lambda: fsdp_compile.clip_grad_norm_(base, -1)),
        "no_sync_before_shard": expect_error(lambda: fsdp_compile.backend(strategy).no_sync().__enter__()),
        "sync_not_bool": expect_error(lambda: make(base, strategy, "eager")[2].set_requires_gradient_sync(0)),
    }
    if rank != 0:
        # Only what differs by rank: rank 0 carries the rest.
        return {"full_state_dict": {k: out["full_state_dict"][k] for k in ("keys", "everywhere_keys")}}
    return out
