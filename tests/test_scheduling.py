"""The scheduling pass and the memory estimate on small hand-made graphs (traced fake)."""

from __future__ import annotations

import pytest
import torch
from helpers import inflight_from_order
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_compile  # noqa: F401  (registers the markers)
from fsdp_compile.api import parse_policy
from fsdp_compile.inspection.memory_estimate import estimate_memory
from fsdp_compile.passes.lowering import lower_markers
from fsdp_compile.passes.scheduling import ScheduleOptions, schedule_collectives
from fsdp_compile.runtime.collectives import CommSpec

SPEC = CommSpec("g", 2, True, "", 1, None, None, True)
BUCKET_BYTES = 8 * 8 * 4  # each layer's 8 x 8 fp32 weight, gathered from a 4 x 8 shard


def chain(layers: int = 3):
    """x -> tanh(x @ w_i.t()) for gathered weights w_i, one bucket each, lowered."""
    def f(x, *shards):
        for i, s in enumerate(shards):
            w = torch.ops.fsdp_compile.unshard(s, f"b{i}.w", f"b{i}", 8, *SPEC.op_args())
            x = torch.tanh(x @ w.t())
        return x
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), *[torch.randn(4, 8) for _ in range(layers)])
    lower_markers(gm, parse_policy("module"))
    return gm


def order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def by_bucket(schedule):
    return {c.bucket: c for c in schedule.collectives}


def test_prefetch_one_issues_each_gather_when_the_previous_bucket_starts() -> None:
    gm = chain()
    sched = by_bucket(schedule_collectives(gm, ScheduleOptions(prefetch=1)))
    names = order(gm)
    # b1 is gathered while b0's layer computes, b2 while b1's does.
    assert sched["b1"].issued_before == sched["b0"].waited_before == "t"
    assert sched["b2"].issued_before == sched["b1"].waited_before == "t_1"
    assert names.index("all_gather_into_tensor_1") < names.index("mm") < names.index("wait_tensor_1")
    assert names.index("all_gather_into_tensor_2") < names.index("mm_1") < names.index("wait_tensor_2")
    for bucket in ("b1", "b2"):
        assert sched[bucket].overlapped_nodes > 0


def test_prefetch_zero_gathers_right_before_use() -> None:
    gm = chain()
    sched = schedule_collectives(gm, ScheduleOptions(prefetch=0))
    assert all(c.overlapped_nodes == 0 for c in sched.collectives)
    names = order(gm)
    for i in ("", "_1", "_2"):
        assert names.index(f"wait_tensor{i}") == names.index(f"all_gather_into_tensor{i}") + 1


def test_budget_delays_prefetch_instead_of_breaking() -> None:
    # Bytes in flight read off the laid-out graph (collective to wait), not the pass's records.
    gm = chain(4)
    sched = schedule_collectives(gm, ScheduleOptions(prefetch=3, max_inflight_bytes=BUCKET_BYTES))
    assert sched.budget == BUCKET_BYTES and inflight_from_order(gm)[0] <= BUCKET_BYTES
    assert any(c.prefetch_delayed for c in sched.collectives)
    unlimited = chain(4)
    free = schedule_collectives(unlimited, ScheduleOptions(prefetch=3, max_inflight_bytes=10 * BUCKET_BYTES))
    assert inflight_from_order(unlimited)[0] > BUCKET_BYTES and not any(c.prefetch_delayed for c in free.collectives)


def test_default_budget_is_two_buckets() -> None:
    # prefetch=3 asks for four gathers in flight; the default max_inflight_bytes (twice the
    # largest bucket of the graph) allows two.
    gm = chain(4)
    sched = schedule_collectives(gm, ScheduleOptions(prefetch=3))
    assert sched.budget == 2 * BUCKET_BYTES
    assert inflight_from_order(gm) == (2 * BUCKET_BYTES, BUCKET_BYTES)


def test_explicit_prefetch_order() -> None:
    gm = chain()
    sched = by_bucket(schedule_collectives(gm, ScheduleOptions(prefetch=0, explicit_prefetch={"b0": ["b2"]})))
    assert sched["b2"].issued_before == sched["b0"].waited_before  # named: gathered when b0 starts
    assert sched["b1"].overlapped_nodes == 0  # not named, prefetch 0


def test_budget_smaller_than_a_bucket_and_negative_prefetch_are_errors() -> None:
    with pytest.raises(ValueError, match=rf"max_inflight_bytes=100 is smaller than bucket 'b0' \({BUCKET_BYTES} bytes"):
        schedule_collectives(chain(), ScheduleOptions(max_inflight_bytes=100))
    with pytest.raises(ValueError, match="prefetch=-1 must be an int >= 0"):
        schedule_collectives(chain(), ScheduleOptions(prefetch=-1))


def test_reduction_is_issued_when_its_gradients_exist_and_waited_late() -> None:
    def f(x, g0, g1):
        a = torch.tanh(x) * g0
        r0 = torch.ops.fsdp_compile.reduce_grad(a, "p0", "b0", 4, torch.float32, *SPEC.op_args())
        b = torch.tanh(a) @ torch.tanh(a).t()
        b = torch.tanh(b[:, :8] * g1)
        r1 = torch.ops.fsdp_compile.reduce_grad(b, "p1", "b1", 4, torch.float32, *SPEC.op_args())
        return r0, r1
    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    lower_markers(gm, parse_policy("module"))
    sched = by_bucket(schedule_collectives(gm, ScheduleOptions()))
    names = order(gm)
    # r0's reduce-scatter goes out before the compute producing b and is waited at the end.
    assert names.index("reduce_scatter_tensor") < names.index("mm")
    assert sched["b0"].overlapped_nodes > 0
    assert names.index("wait_tensor") > names.index("tanh_3")


def test_a_reduction_waits_for_an_older_one_rather_than_issuing_late() -> None:
    # Three reductions, each issued as its gradient exists, under a budget of one bucket: the
    # budget is kept by waiting for the older reduction where the next one issues, not by
    # delaying the next one until its use.
    def f(x, g0, g1, g2):
        a = torch.tanh(x) * g0
        r0 = torch.ops.fsdp_compile.reduce_grad(a, "p0", "b0", 4, torch.float32, *SPEC.op_args())
        b = torch.tanh(a) * g1
        r1 = torch.ops.fsdp_compile.reduce_grad(b, "p1", "b1", 4, torch.float32, *SPEC.op_args())
        c = torch.tanh(b) * g2
        r2 = torch.ops.fsdp_compile.reduce_grad(c, "p2", "b2", 4, torch.float32, *SPEC.op_args())
        return r0, r1, r2, torch.tanh(c) @ torch.tanh(c).t()
    gm = make_fx(f, tracing_mode="fake")(*[torch.randn(8, 8) for _ in range(4)])
    lower_markers(gm, parse_policy("module"))
    reduction_bytes = 8 * 8 * 4
    sched = by_bucket(schedule_collectives(gm, ScheduleOptions(max_inflight_bytes=reduction_bytes)))
    assert inflight_from_order(gm) == (reduction_bytes, reduction_bytes)
    # Each issued before the compute right after its gradient, as without a budget ...
    assert [sched[b].issued_before for b in ("b0", "b1", "b2")] == ["tanh_1", "tanh_2", "tanh_3"]
    # ... and the older one waited there; the last stays in flight to the graph's end.
    assert sched["b0"].waited_before == sched["b1"].issued_before
    assert sched["b1"].waited_before == sched["b2"].issued_before
    assert sched["b2"].waited_before == "output"
    names = order(gm)
    assert names.index("wait_tensor") < names.index("reduce_scatter_tensor_1")
    assert names.index("wait_tensor_1") < names.index("reduce_scatter_tensor_2")


def test_a_prefetch_is_issued_before_the_wait_it_follows_where_the_budget_allows() -> None:
    # A link carries one collective at a time: issued after b1's wait returns, b2's gather would
    # leave the link idle for the return and the issue.
    gm = chain()
    schedule_collectives(gm, ScheduleOptions(prefetch=1))
    names = order(gm)
    assert names.index("all_gather_into_tensor_2") < names.index("wait_tensor_1")
    # b0 is issued where it is waited (nothing computes before it): it goes first on the link.
    assert names.index("all_gather_into_tensor") < names.index("wait_tensor") < names.index("all_gather_into_tensor_1")
    assert inflight_from_order(gm)[0] <= 2 * BUCKET_BYTES
    # A budget of one bucket has no room for both: the wait comes first.
    tight = chain()
    schedule_collectives(tight, ScheduleOptions(prefetch=1, max_inflight_bytes=BUCKET_BYTES))
    names = order(tight)
    assert names.index("wait_tensor_1") < names.index("all_gather_into_tensor_2")
    assert inflight_from_order(tight)[0] <= BUCKET_BYTES


def test_a_reduction_lets_the_next_prefetch_onto_the_link_first() -> None:
    # Backward's shape: b2's layer, its gradient reduced, more compute, then b1's and b0's layers.
    # Issued as soon as its gradient exists, the reduce-scatter would go out before b0's prefetch,
    # and b0's gather would queue behind it on the link.
    def f(x, g, s0, s1, s2):
        w2 = torch.ops.fsdp_compile.unshard(s2, "b2.w", "b2", 8, *SPEC.op_args())
        x = torch.tanh(x @ w2.t())
        r = torch.ops.fsdp_compile.reduce_grad(x * g, "p", "r", 4, torch.float32, *SPEC.op_args())
        y = torch.tanh(torch.tanh(x))
        w1 = torch.ops.fsdp_compile.unshard(s1, "b1.w", "b1", 8, *SPEC.op_args())
        x = torch.tanh(y @ w1.t())
        w0 = torch.ops.fsdp_compile.unshard(s0, "b0.w", "b0", 8, *SPEC.op_args())
        return torch.tanh(x @ w0.t()), r
    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8), *[torch.randn(4, 8) for _ in range(3)])
    lower_markers(gm, parse_policy("module"))
    sched = by_bucket(schedule_collectives(gm, ScheduleOptions()))
    names = order(gm)
    b0_gather = names.index("all_gather_into_tensor_2")
    assert b0_gather < names.index("reduce_scatter_tensor") < names.index("mm_1")
    assert names.index("tanh_2") < b0_gather
    assert sched["r"].waited_before == "output" and sched["r"].overlapped_nodes > 0


def test_memory_estimate_counts_live_storages() -> None:
    def f(x):
        y = x * 2          # 64 bytes while x (held by the caller) is live
        v = y.view(4, 4)   # a view: no new storage
        z = v + 1          # y is still live here: x + y + z
        return z * 3
    gm = make_fx(f, tracing_mode="fake")(torch.randn(16))
    estimate = estimate_memory(gm)
    assert estimate.peak_bytes == 3 * 64
    assert estimate.peak_by_role["activation"] == 3 * 64
    assert estimate.timeline[-1] == ("output", 2 * 64)  # x and the result


def test_memory_estimate_prices_torchs_own_collectives_apart_from_ours() -> None:
    """A collective torch put into the graph (tensor parallelism's all-gather, untagged) holds
    its buffer under the role ``tp_comm``, not as an activation; ours stays ``gathered``."""
    c10d = torch.ops._c10d_functional

    def f(x, shard):
        w = torch.ops.fsdp_compile.unshard(shard, "b0.w", "b0", 8, *SPEC.op_args())
        h = torch.tanh(x @ w.t())
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(h, 4, "tp"))  # as sequence parallelism's
        return torch.tanh(g).sum()
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(4, 8))
    lower_markers(gm, parse_policy("module"))
    estimate = estimate_memory(gm)
    # Counted as ours are: the collective's buffer and the value its wait returns, here the
    # gathered (12, 8) fp32 activation; ours: the flat 8 x 8 fp32 buffer and its wait's value.
    assert estimate.max_by_role["tp_comm"] == 2 * (4 * 3 * 8 * 4)
    assert estimate.max_by_role["gathered"] == 2 * BUCKET_BYTES
    # In flight: ours only, what the schedule bounds (theirs, 384 bytes, would be the peak).
    assert estimate.peak_inflight_bytes == BUCKET_BYTES
    tp_comm = [r["tp_comm"] for r in estimate.role_timeline]
    names = [name for name, _ in estimate.timeline]
    # From the collective to the last use of its result (the tanh after the wait).
    assert [n for n, b in zip(names, tp_comm) if b] == ["all_gather_into_tensor", "wait_tensor", "tanh_1"]


def test_a_bucket_without_a_collective_stays_in_place() -> None:
    """NO_SHARD with mixed precision: the marker only casts (no collective). The pass must not
    fail on such a graph (max() of no collective sizes), which would drop it to the eager runtime."""
    cast = CommSpec("", 1, False, "r", 2, torch.bfloat16, None, False)

    def f(x, whole, shard):
        w0 = torch.ops.fsdp_compile.unshard(whole, "w0", "b0", 8, *cast.op_args())
        w1 = torch.ops.fsdp_compile.unshard(shard, "w1", "b1", 8, *SPEC.op_args())
        return torch.tanh(x.bfloat16() @ w0.t()).float() @ w1.t()
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(8, 8), torch.randn(4, 8))
    lower_markers(gm, parse_policy("module"))
    before = [n.name for n in gm.graph.nodes if n.meta.get("fsdp_comm") and n.meta["fsdp_comm"].bucket == "b0"]
    sched = schedule_collectives(gm, ScheduleOptions())
    assert [c.bucket for c in sched.collectives] == ["b1"]
    assert before and [n.name for n in gm.graph.nodes if n.name in before] == before


def test_inflight_tree_answers_as_a_plain_list():
    """The scheduler's bytes-in-flight tree (range add, range max, first/last position over a
    limit) against a plain list, on random operations: it must place every collective where the
    list-based walk it replaces did."""
    import random

    from fsdp_compile.passes.scheduling import _Inflight

    rng = random.Random(0)
    for size in (1, 2, 7, 64, 129):
        tree, plain = _Inflight(size), [0] * size
        for _ in range(300):
            lo = rng.randrange(size)
            hi = rng.randrange(lo, size + 1)
            value = rng.choice((-3, 1, 2, 5, 8))
            tree.add(lo, hi, value)
            for t in range(lo, hi):
                plain[t] += value
            lo, hi = sorted((rng.randrange(size + 1), rng.randrange(size + 1)))
            limit = rng.randrange(-5, 40)
            over = [t for t in range(lo, hi) if plain[t] > limit]
            assert tree.first_above(lo, hi, limit) == (over[0] if over else hi)
            assert tree.last_above(lo, hi, limit) == (over[-1] if over else None)
            if hi > lo:
                assert tree.max(lo, hi) == max(plain[lo:hi])
            t = rng.randrange(size)
            assert tree[t] == plain[t]
        assert tree.peak() == max(plain)


def test_a_hybrid_reduction_goes_across_nodes_early_and_stays_in_flight() -> None:
    # HSDP's reduction: a reduce-scatter in the node, then an all-reduce across nodes of its
    # result. The reduce-scatter is waited where the next gather is (the link has carried it by
    # then), so the all-reduce goes out there, and it stays in flight under the next blocks'
    # compute: waited where it was issued, backward would wait for the slow link block by block.
    spec = CommSpec("g", 2, True, "r", 2, None, None, True)

    def f(x, g, *shards):
        grads = []
        for i, s in enumerate(shards):
            w = torch.ops.fsdp_compile.unshard(s, f"b{i}.w", f"b{i}", 8, *spec.op_args())
            x = torch.tanh(torch.tanh(x @ w.t()))
            grads.append(torch.ops.fsdp_compile.reduce_grad((x * g).t() @ x, f"b{i}.w", f"r{i}", 4,
                                                            torch.float32, *spec.op_args()))
        return x, *grads
    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8), *[torch.randn(4, 8) for _ in range(4)])
    lower_markers(gm, parse_policy("module"))
    schedule = schedule_collectives(gm, ScheduleOptions())
    assert schedule.budget == 2 * BUCKET_BYTES + 2 * BUCKET_BYTES // 2  # two buckets, two all-reduces
    names = order(gm)
    ar = [i for i, n in enumerate(names) if n.startswith("all_reduce")]
    waits = {n.args[0].name: names.index(n.name) for n in gm.graph.nodes if n.name.startswith("wait_tensor")}
    first_ar = names[ar[0]]
    # the first all-reduce goes out right after b2's gather is waited, before b3's is issued ...
    assert waits["all_gather_into_tensor_2"] < ar[0] < names.index("all_gather_into_tensor_3")
    # ... and compute runs before its wait (it is not waited where it is issued)
    assert any(n.startswith(("mm", "tanh")) for n in names[ar[0] + 1:waits[first_ar]]), names[ar[0]:waits[first_ar] + 1]
    assert inflight_from_order(gm)[0] <= schedule.budget


def test_a_hybrid_reduction_without_gathers_around_goes_across_nodes_at_the_next_gradient() -> None:
    # HYBRID_SHARD_ZERO2's backward gathers nothing: the reduce-scatter is waited where the next
    # bucket's gradients exist, not at the graph's end, so the all-reduces do not all go out at
    # once at the end, each waited where it is issued.
    spec = CommSpec("g", 2, True, "r", 2, None, None, False)

    def f(x, g):
        grads = []
        for i in range(4):
            x = torch.tanh(torch.tanh(x @ g))
            grads.append(torch.ops.fsdp_compile.reduce_grad(x.t() @ x, f"b{i}.w", f"r{i}", 4, torch.float32,
                                                            *spec.op_args()))
        return x, *grads
    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    lower_markers(gm, parse_policy("module"))
    schedule_collectives(gm, ScheduleOptions())
    names = order(gm)
    waits = {n.args[0].name: names.index(n.name) for n in gm.graph.nodes if n.name.startswith("wait_tensor")}
    first_ar = min(i for i, n in enumerate(names) if n.startswith("all_reduce"))
    # the first all-reduce goes out before the second reduce-scatter ...
    assert first_ar < names.index("reduce_scatter_tensor_1"), names
    # ... and compute runs while it is in flight
    assert any(n.startswith(("mm", "tanh")) for n in names[first_ar + 1:waits[names[first_ar]]])


def test_a_float8_gathers_amax_all_reduce_goes_out_when_the_shards_exist() -> None:
    """Its all-gather waits for it: issued beside the all-gather, the all-reduce would queue behind
    what the link still carries, and compute would wait for all of it."""
    float8 = CommSpec("g", 2, True, "", 1, None, None, True, float8=torch.float8_e4m3fn)

    def f(x, *shards):
        for i, s in enumerate(shards):
            w = torch.ops.fsdp_compile.unshard(s, f"b{i}.w", f"b{i}", 8, *float8.op_args())
            x = torch.tanh(x @ w.t())
        return x
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), *[torch.randn(4, 8) for _ in range(3)])
    lower_markers(gm, parse_policy("module"))
    schedule_collectives(gm, ScheduleOptions(prefetch=1))
    names = order(gm)
    first_compute = min(names.index(n) for n in names if n.startswith("mm"))
    reduces = [n for n in names if n.startswith("all_reduce")]
    gathers = [n for n in names if n.startswith("all_gather_into_tensor")]
    assert len(reduces) == len(gathers) == 3
    assert all(names.index(r) < first_compute for r in reduces), names
    # the last bucket's all-gather still goes out one bucket ahead, not at the start
    assert names.index("mm") < names.index(gathers[-1]), names
