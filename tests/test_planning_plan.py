"""plan() on small models in a fake world: rows, memory by role, sharing between candidates, bad input."""

from __future__ import annotations

import pytest
import torch

import fsdp_compile
from fsdp_compile.api import ShardingStrategy
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.planning import Cluster, ClusterError, plan
from fsdp_compile.planning.plan import model_state_bytes, require_fit

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, d_model=64)


def cpu_cluster(nodes=2, per_node=4, memory=2e9, **changes) -> Cluster:
    fields = {"name": "toy-cpu", "nodes": nodes, "devices_per_node": per_node, "device_memory": memory,
                  "peak_flops": {torch.float32: 5e10, torch.bfloat16: 5e10}, "memory_bandwidth": 1e10,
                  "intra_node_bandwidth": 1e9, "inter_node_bandwidth": 2e8, "intra_node_latency": 1e-5,
                  "inter_node_latency": 5e-5, "device_type": "cpu"}
    fields.update(changes)
    return Cluster(**fields)


def gpt_loss(out):
    return out.float().square().mean()


@pytest.fixture(scope="module")
def small_plan():
    with torch.device("meta"):
        model = GPT(CFG)
    tokens = torch.zeros(2, 32, dtype=torch.long)
    return model, plan(model, (tokens,), cluster=cpu_cluster(), loss_fn=gpt_loss, prefetch=(1,))


def test_one_row_per_strategy_with_every_field(small_plan):
    _, p = small_plan
    assert {r.strategy for r in p.rows} == {s.name for s in ShardingStrategy}
    for row in p.rows:
        assert row.traced and row.step_seconds > 0
        assert set(row.memory) == {"params", "grads", "optimizer", "gathered", "activations", "buffers"}
        assert row.exposed_comm_seconds <= row.comm_seconds + 1e-12
        assert row.peak_bytes == pytest.approx(sum(row.memory.values()))
        assert row.tokens_per_second == pytest.approx(2 * 32 / row.step_seconds)
    assert p.best is not None and p.best.chosen and sum(r.chosen for r in p.rows) == 1
    assert p.best.step_seconds == min(r.step_seconds for r in p.rows if r.fits)
    text = str(p)
    assert "HYBRID_SHARD_ZERO2" in text and "chosen:" in text and "not measured" in text


def test_runtime_work_per_parameter_is_part_of_the_step(small_plan):
    model, base = small_plan
    with torch.device("meta"):
        again = GPT(CFG)
    slower = plan(again, (torch.zeros(2, 32, dtype=torch.long),), cluster=cpu_cluster(runtime_per_tensor=1e-3),
                  loss_fn=gpt_loss, prefetch=(1,), strategies=["FULL_SHARD"])
    tensors = len(list(model.parameters()))
    assert slower.row("FULL_SHARD").step_seconds == pytest.approx(
        base.row("FULL_SHARD").step_seconds + tensors * 1e-3)


def test_model_states_follow_the_zero_formula(small_plan):
    model, _ = small_plan
    P = sum(p.numel() for p in model.parameters())
    n = 8
    no_shard = model_state_bytes(model, ShardingStrategy.NO_SHARD, n, 4, "adamw")
    assert no_shard["params"] + no_shard["grads"] + no_shard["optimizer"] == 16 * P
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        s = model_state_bytes(model, strategy, n, 4, "adamw")
        total = s["params"] + s["grads"] + s["optimizer"]
        # 16P/N, up to the padding of dim 0 to a multiple of N (FSDP2's layout)
        assert 16 * P / n <= total <= 16 * P / n * 1.1
    hybrid = model_state_bytes(model, ShardingStrategy.HYBRID_SHARD, n, 4, "adamw")
    assert hybrid["params"] == pytest.approx(4 * P / 4, rel=0.1)


def test_rows_hold_the_resident_model_states_of_the_zero_formulas():
    # ZeRO's setting: mixed precision (bf16 compute, fp32 reduction) and Adam, 16 bytes per
    # parameter in all. Our shards are the fp32 master parameters (4P), their gradients (4P)
    # and the two moments (8P); ZeRO counts fp16 parameters and gradients (2P + 2P) and 12P of
    # fp32 state instead: the same 16P, split otherwise.
    with torch.device("meta"):
        model = GPT(CFG)
    P = sum(p.numel() for p in model.parameters())
    n, per_node = 8, 4
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    p = plan(model, (torch.zeros(2, 32, dtype=torch.long),), cluster=cpu_cluster(), loss_fn=gpt_loss,
             mixed_precision=mp, prefetch=(1,))

    def total(row) -> float:
        return row.model_states["params"] + row.model_states["grads"] + row.model_states["optimizer"]

    # CFG's dimensions split evenly over 8 and 4 ranks: no padding, the formulas hold exactly.
    assert total(p.row("NO_SHARD")) == 16 * P  # DDP: 16P
    assert total(p.row("FULL_SHARD")) == 16 * P / n  # ZeRO-3: 16P/N
    assert total(p.row("HYBRID_SHARD")) == 16 * P / per_node  # ZeRO-3 within a node
    # ZeRO-2 keeps a bf16 copy of every parameter resident (2P + 14P/N); SHARD_GRAD_OP keeps only
    # the shards between steps (16P/N) and holds the gathered bf16 parameters from forward to
    # backward: at its peak, at most those 2P come on top. (ZeRO-1's 4P + 12P/N, whole gradients
    # with sharded optimizer state, is no strategy here.)
    zero2 = p.row("SHARD_GRAD_OP")
    assert total(zero2) == 16 * P / n
    assert p.row("FULL_SHARD").memory["gathered"] < zero2.memory["gathered"] <= 2 * P
    for row in p.rows:
        assert row.model_states["buffers"] == row.memory["buffers"] == 0
        assert row.model_states["optimizer"] == 2 * row.model_states["grads"]  # AdamW's two moments
        # At the backward peak, the grads also hold the full, unreduced gradients of a bucket.
        assert row.phase == "backward" and row.memory["grads"] > row.model_states["grads"]
        assert row.as_dict()["model_states"] == row.model_states


def test_the_optimizer_sets_the_optimizer_state_and_step():
    with torch.device("meta"):
        model = GPT(CFG)
    rows = {name: plan(model, (torch.zeros(2, 32, dtype=torch.long),), cluster=cpu_cluster(), loss_fn=gpt_loss,
                       strategies=["FULL_SHARD"], prefetch=(1,), optimizer=name).row("FULL_SHARD")
            for name in ("adamw", "sgd", "none")}
    adamw, sgd, none = rows["adamw"], rows["sgd"], rows["none"]
    assert adamw.model_states["optimizer"] == 2 * adamw.model_states["grads"] > 0
    assert sgd.model_states["optimizer"] == none.model_states["optimizer"] == 0
    assert sgd.memory["optimizer"] == none.memory["optimizer"] == 0
    # The graphs are the same; the step outside them is not: AdamW's update is dearer than
    # SGD's, and "none" has no optimizer step at all.
    assert adamw.comm_seconds == sgd.comm_seconds == none.comm_seconds
    assert adamw.step_seconds > sgd.step_seconds > none.step_seconds


def test_every_bucket_policy_given_is_planned():
    from fsdp_compile.inspection.graphinfo import collective_counts

    with torch.device("meta"):
        model = GPT(CFG)
    p = plan(model, (torch.zeros(2, 32, dtype=torch.long),), cluster=cpu_cluster(), loss_fn=gpt_loss,
             strategies=["FULL_SHARD"], prefetch=(1,), buckets=("module", "param", 1 << 16))
    rows = {r.bucket: r for r in p.rows}
    assert sorted(rows) == ["0.0625MiB", "module", "param"]
    assert p.bucket_policies == {"module": "module", "param": "param", "0.0625MiB": 1 << 16}
    gathers = {c.bucket_label(): collective_counts(t.records[0].forward)["all_gather"]
               for c, t in p._context.traced.items()}
    params = len(list(model.parameters()))
    # One forward gather per block and the root's two (embeddings; final norm and head); per
    # parameter; per 64 KiB of full parameters.
    assert gathers["module"] == CFG.n_layer + 2 and gathers["param"] == params
    assert gathers["module"] < gathers["0.0625MiB"] < params
    # Each collective pays its latency: one per parameter is the slowest.
    assert rows["param"].step_seconds > rows["module"].step_seconds


def test_memory_by_role_separates_the_strategies(small_plan):
    _, p = small_plan
    full, zero2, ddp = (p.row(s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
    # params: shards for the sharded strategies, whole parameters for NO_SHARD
    assert ddp.memory["params"] > 6 * full.memory["params"]
    # ZeRO-2 keeps gathered parameters from forward to backward; ZeRO-3 drops and regathers them
    assert zero2.memory["gathered"] > full.memory["gathered"]
    # FULL_SHARD gathers in backward again: more bytes on the wire
    assert sum(full.bytes_per_step.values()) > sum(zero2.bytes_per_step.values())
    # hybrid: the replica all-reduce crosses nodes, gathers stay inside one
    hybrid = p.row("HYBRID_SHARD")
    assert hybrid.bytes_per_step["inter"] < full.bytes_per_step["inter"]
    assert hybrid.bytes_per_step["intra"] > 0 and full.bytes_per_step["intra"] == 0


def test_replayed_candidates_equal_direct_traces():
    """Sharing the joint graph between strategies of one layout is exact."""
    from fsdp_compile.planning.trace import Candidate, trace_candidates
    from fsdp_compile.planning.world import fake_world

    with torch.device("meta"):
        model = GPT(CFG)
    tokens = torch.zeros(2, 32, dtype=torch.long)
    kwargs = {"world": 4, "devices_per_node": 4, "mixed_precision": None, "device_type": "cpu"}
    shared = [Candidate(ShardingStrategy.FULL_SHARD), Candidate(ShardingStrategy.SHARD_GRAD_OP),
              Candidate(ShardingStrategy.FULL_SHARD, bucket=1 << 14, prefetch=2)]
    with fake_world(4):
        together = trace_candidates(model, (tokens,), gpt_loss, shared, **kwargs)
        assert [together[c].replayed for c in shared] == [False, True, True]
        for candidate in shared[1:]:
            alone = trace_candidates(model, (tokens,), gpt_loss, [candidate], **kwargs)[candidate]
            for a, b in zip(alone.records, together[candidate].records):
                assert a.forward.code == b.forward.code
                assert a.backward.code == b.backward.code


def test_model_that_fits_nowhere_says_what_it_needs():
    with torch.device("meta"):
        model = GPT(CFG)
    P = sum(p.numel() for p in model.parameters())
    tokens = torch.zeros(2, 32, dtype=torch.long)
    # room for FULL_SHARD's model states (16P/8), not for its activations
    p = plan(model, (tokens,), cluster=cpu_cluster(memory=2.1 * P), loss_fn=gpt_loss, prefetch=(1,))
    assert p.best is None and not any(r.fits for r in p.rows)
    assert "no strategy fits in" in p.why and "KiB" in p.why
    for advice in ("more devices", "CPU offload", "activation checkpointing"):
        assert advice in p.why
    with pytest.raises(fsdp_compile.planning.PlanError, match="no strategy fits"):
        require_fit(p)


def test_strategies_whose_model_states_cannot_fit_are_not_traced():
    with torch.device("meta"):
        model = GPT(CFG)
    P = sum(p.numel() for p in model.parameters())
    tokens = torch.zeros(2, 32, dtype=torch.long)
    # room for 16P/8 plus activations but not for 16P: NO_SHARD is ruled out untraced
    p = plan(model, (tokens,), cluster=cpu_cluster(memory=8 * P), loss_fn=gpt_loss, prefetch=(1,),
             strategies=["NO_SHARD", "FULL_SHARD"])
    ddp = p.row("NO_SHARD")
    assert not ddp.traced and not ddp.fits and "not traced" in ddp.note
    assert ddp.step_seconds is None and ddp.model_states["optimizer"] == 8 * P
    assert p.row("FULL_SHARD").traced
    # trace_all=True traces it anyway: a prediction of its own, which still does not fit.
    everything = plan(model, (tokens,), cluster=cpu_cluster(memory=8 * P), loss_fn=gpt_loss, prefetch=(1,),
                      strategies=["NO_SHARD", "FULL_SHARD"], trace_all=True)
    ddp = everything.row("NO_SHARD")
    assert ddp.traced and not ddp.fits and ddp.note == "" and ddp.step_seconds > 0
    assert ddp.peak_bytes > ddp.model_states["params"] + ddp.model_states["grads"] + ddp.model_states["optimizer"]


def test_bad_arguments_are_named():
    model = torch.nn.Linear(4, 4)
    x = torch.zeros(2, 4)
    with pytest.raises(ClusterError, match="world_size=64 does not fit"):
        plan(model, (x,), cluster=cpu_cluster(), world_size=64)
    with pytest.raises(TypeError, match="cluster= must be an fsdp_compile.Cluster"):
        plan(model, (x,), cluster="h100")
    with pytest.raises(ValueError, match="optimizer='lion'"):
        plan(model, (x,), cluster=cpu_cluster(), optimizer="lion")
    with pytest.raises(ClusterError, match="no peak FLOP/s for torch.float16"):
        plan(model.half(), (x.half(),), cluster=cpu_cluster())


def test_attention_uses_the_cuda_kernel_on_gpu_clusters():
    from fsdp_compile.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=1, max_seq_len=64))
    tokens = torch.zeros(1, 64, dtype=torch.long)
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    gpu = Cluster.preset("a10g")
    p = plan(model, (tokens,), cluster=gpu, mixed_precision=mp, strategies=["FULL_SHARD"], prefetch=(1,),
             world_size=2)
    traced = next(iter(p._context.traced.values()))
    ops = {str(n.target) for r in traced.records for g in (r.forward, r.backward) for n in g.graph.nodes}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert not any("for_cpu" in op for op in ops)


@pytest.mark.slow
def test_max_batch_and_seq_len_are_solved_and_match_brute_force():
    cfg = GPTConfig(vocab_size=128, block_size=4096, n_layer=1, n_head=2, d_model=64)
    with torch.device("meta"):
        model = GPT(cfg)
    cluster = cpu_cluster(nodes=1, per_node=4, memory=3e7, inter_node_bandwidth=None, inter_node_latency=None)
    kwargs = {"cluster": cluster, "loss_fn": gpt_loss, "prefetch": (1,), "strategies": ["FULL_SHARD"]}
    p = plan(model, (torch.zeros(4, 32, dtype=torch.long),), **kwargs)
    batch = p.max_batch("FULL_SHARD")
    seq = p.max_seq_len("FULL_SHARD")
    assert 8 < batch < 1000 and 32 < seq < 4096
    expr = p.memory_expr("FULL_SHARD")
    (symbol,) = expr.free_symbols
    assert symbol.name == "batch"
    assert float(expr.subs(symbol, 4)) == pytest.approx(p.row("FULL_SHARD").peak_bytes, rel=1e-9)
    assert p.step_time_expr("FULL_SHARD").free_symbols
    for b, fits in ((batch, True), (batch + 1, False)):
        q = plan(model, (torch.zeros(b, 32, dtype=torch.long),), **kwargs)
        assert q.row("FULL_SHARD").fits is fits, b
    for s, fits in ((seq, True), (seq + 1, False)):
        q = plan(model, (torch.zeros(4, s, dtype=torch.long),), **kwargs)
        assert q.row("FULL_SHARD").fits is fits, s


@pytest.mark.slow
def test_max_seq_len_respects_the_models_own_bound():
    from fsdp_compile.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=1, max_seq_len=48))
    p = plan(model, (torch.zeros(1, 16, dtype=torch.long),), cluster=cpu_cluster(nodes=1, per_node=2, memory=1e9,
             inter_node_bandwidth=None, inter_node_latency=None), strategies=["FULL_SHARD"], prefetch=(1,))
    # memory would allow far longer sequences; the rotary table stops at 48 (Dynamo's guard on the size)
    assert p.max_seq_len("FULL_SHARD") == 48


def test_no_shard_with_mixed_precision_schedules_without_falling_back():
    """A bucket lowered to a cast only (no collective) is scheduled, not dropped to the eager runtime."""
    with torch.device("meta"):
        model = GPT(CFG)
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    p = plan(model, (torch.zeros(2, 32, dtype=torch.long),), cluster=cpu_cluster(), loss_fn=gpt_loss,
             mixed_precision=mp, strategies=["NO_SHARD"], prefetch=(1,))
    row = p.row("NO_SHARD")
    assert row.traced and "pass failed" not in row.note, row.note
    records = next(iter(p._context.traced.values())).records
    assert all(not r.fallbacks for r in records)


def test_activation_checkpointing_is_planned_and_replayed():
    """Checkpointed blocks: the replayed partition runs under the traced fake mode (RNG states)."""
    from fsdp_compile.models.llama import Llama, LlamaConfig

    rows = {}
    for checkpoint in (False, True):
        with torch.device("meta"):
            model = Llama(LlamaConfig(n_layers=2, max_seq_len=64, checkpoint_blocks=checkpoint))
        p = plan(model, (torch.zeros(2, 64, dtype=torch.long),), cluster=cpu_cluster(nodes=1, per_node=2,
                 inter_node_bandwidth=None, inter_node_latency=None), prefetch=(1,),
                 strategies=["FULL_SHARD", "SHARD_GRAD_OP"])
        rows[checkpoint] = p
        assert all(r.traced and not r.note for r in p.rows)
    # recomputing blocks keeps fewer activations and costs more compute
    assert rows[True].row("FULL_SHARD").memory["activations"] < rows[False].row("FULL_SHARD").memory["activations"]
    assert rows[True].row("FULL_SHARD").compute_seconds > rows[False].row("FULL_SHARD").compute_seconds
