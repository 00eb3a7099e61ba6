"""What sharding does to a model: storage per rank, shared and 0-d parameters, buffers, graph breaks."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from distributed import run_workers
from helpers import (
    GRAD_RTOL,
    PARAM_ATOL,
    TEST_CONFIG,
    WORLD,
    assert_bitwise,
    assert_grads_close,
    batches,
    fsdp2_model,
    full,
    hybrid_options,
    lm_loss,
    local_slice,
    local_storage_bytes,
    max_diff,
    train,
)
from torch import nn

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT, GPTConfig


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


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_each_rank_stores_its_share_of_the_parameters(strategy: str) -> None:
    world = 2
    for report in run_workers(storage_worker, world, strategy):
        if strategy == "NO_SHARD":
            assert report["local"] == report["full"]
        else:
            # Exactly the padded 1/N share FSDP2 stores: about half, plus padding rows.
            assert report["local"] == report["padded_share"]
            assert report["full"] / world <= report["local"] < report["full"] / world * 1.05


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


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_tied_and_scalar_parameters_and_buffers(strategy: str) -> None:
    steps = 4
    out = run_workers(tied_worker, 2, strategy, steps)[0]
    assert out["same_object"], "a parameter shared by two modules was sharded twice"
    # The tied emb/head weight counts once: + norm weight and bias + temperature.
    assert out["unique_params"] == 4
    sharded = "Shard(dim=0)" if strategy != "NO_SHARD" else "Replicate()"
    assert out["placements"]["emb.weight"] == (sharded,)
    assert out["placements"]["temperature"] == ("Replicate()",)  # 0-d: kept whole
    assert out["buffers_plain"] and out["scale_unchanged"]
    for mode in ("eager", "aot_eager"):
        assert out[mode]["still_tied"]
        assert_grads_close(out[mode]["grads0"], out["reference"]["grads0"], GRAD_RTOL, f"{mode} first-step")
        param_diff, name = max_diff(out[mode]["params"], out["reference"]["params"])
        assert param_diff <= PARAM_ATOL, f"{mode}: {name} differs by {param_diff}"
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "eager vs aot_eager")
    assert torch.equal(out["eager"]["eval_logits"], out["aot_eager"]["eval_logits"])


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


def test_graph_break_from_disabled_submodule_trains_correctly() -> None:
    out = run_workers(graph_break_worker, 2, "FULL_SHARD", 3)[0]
    assert out["aot_eager"]["graphs"] >= 2, "the disabled submodule did not split the graph"
    for mode in ("eager", "aot_eager"):
        assert_grads_close(out[mode]["grads0"], out["reference"]["grads0"], GRAD_RTOL, f"{mode} first-step")
        param_diff, name = max_diff(out[mode]["params"], out["reference"]["params"])
        assert param_diff <= PARAM_ATOL, f"{mode}: {name} differs by {param_diff}"
    assert_bitwise(out["eager"]["grads0"], out["aot_eager"]["grads0"], "eager vs aot_eager gradients")
    assert_bitwise(out["eager"]["params"], out["aot_eager"]["params"], "eager vs aot_eager")


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


def test_one_call_compile_equals_shard_then_compile() -> None:
    out = run_workers(convenience_worker, 2)[0]
    assert out["strategy"] == "SHARD_GRAD_OP" and out["graphs"] == 1
    assert_bitwise(out["got"], out["want"], "fsdp_compile.compile vs explicit")


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


@pytest.mark.parametrize("strategy", ["FULL_SHARD", pytest.param("NO_SHARD", marks=pytest.mark.slow),
                                      pytest.param("HYBRID_SHARD", marks=pytest.mark.slow)])
def test_tied_embeddings_and_a_frozen_block_are_bitwise_equal_to_fsdp2(strategy: str) -> None:
    """A parameter registered under two names (GPT-2's tied embedding and output head) is
    gathered once per forward and its gradient, summed over both uses by autograd, reduced
    once: FSDP2's semantics. Reducing each use separately and adding the reduced shards gives
    other rounding (first-step gradients 7e-9 off here), which AdamW at lr 1e-2 grows to 3e-5
    in three steps; and it reduce-scatters the tied weight twice."""

    out = run_workers(tied_fsdp2_worker, WORLD[strategy], strategy, 3, 1e-2)[0]
    assert out["tied"]
    for mode in ("eager", "aot_eager"):
        for step, (ours, theirs) in enumerate(zip(out[mode]["grads"], out["fsdp2"]["grads"])):
            assert_bitwise(ours, theirs, f"{mode} vs FSDP2 gradients of step {step + 1}")
        assert_bitwise(out[mode]["params"], out["fsdp2"]["params"], f"{mode} vs FSDP2 parameters after 3 steps")
    # One reduction of each trainable parameter, the tied one included, in the shard group
    # (bytes from shapes: padded rows x row size x 4, times the group size for a reduce-scatter).
    kind, size = ("all_reduce", WORLD[strategy]) if strategy == "NO_SHARD" else ("reduce_scatter", 2)
    reduced = sum(b for k, n, b in out["aot_eager"]["backward_collectives"] if k == kind and n == size)
    if kind == "all_reduce":
        expected = sum(4 * math.prod(s) for s in out["trainable_shapes"])
    else:
        expected = sum(4 * size * -(-s[0] // size) * math.prod(s[1:]) for s in out["trainable_shapes"])
    assert reduced == expected
    # Where it does not hold (docs/strategies.md, "What training computes"): a block applied twice in one forward. Each
    # call's gradient is reduced separately and the shards added; FSDP2 reduces the sum once.
    ours, theirs = out["block_twice"], out["block_twice_fsdp2"]
    assert any(not torch.equal(ours[n], theirs[n]) for n in ours if n.startswith("blocks.1."))
    assert_grads_close(ours, theirs, GRAD_RTOL, "a block applied twice, vs FSDP2")
