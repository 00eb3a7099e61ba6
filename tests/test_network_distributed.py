"""The emulated network at work: timing, order, data, training and counts on real ranks.

An emulated network is only worth its figures if (a) no collective completes before its modeled
time, (b) collectives on one link take turns while the intra- and inter-node links run side by
side, (c) what arrives is exactly what plain gloo delivers, in training too, and (d) its counts
are the collectives the compiled graphs hold. Each rank makes its own default group through the
network (``run_workers(..., default_group=False)``); plain gloo runs beside it on a
``new_group(backend="gloo")`` of the same ranks, so both see the same inputs in one process.

Timings are checked against the modeled start and end the works carry: from below exactly (a
loaded CI machine makes anything slower, never faster), and from above with slack
(``LATE_SLACK``): a wait returns no later than the later of the modeled end and gloo's own
completion, plus a quarter of the collective's modeled time and 50 ms for waking up on a
shared 2-core machine. An emulation that slept twice its model would miss that bound by the
whole modeled time, 0.1-0.4 s in these cases.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from helpers import TEST_CONFIG, assert_bitwise, batches, expect_error, fsdp2_model, full, lm_loss, local_slice

import fsdp_compile
from fsdp_compile.models.gpt import GPT

PG_TIMEOUT = datetime.timedelta(seconds=120)
# Slow enough that a 256 KiB collective is modeled at 15-60 ms, far above gloo's own time for it
# on loopback (about 1 ms): a wait that did not sleep would end well before the model.
SLOW = {"intra_node": "10MB/s", "inter_node": "2MB/s", "latency": "2ms"}
SLOW_LATENCY = 2e-3
_c10d = torch.ops._c10d_functional
# How late after its modeled end (or gloo's own completion, if later) a wait may return: the
# wake-up of a sleeping thread and the scheduler of a loaded 2-core machine. Proportional part
# and floor, in seconds.
LATE_SLACK = (0.25, 0.05)


def _returned_in_time(returned: float, work: Any) -> tuple[bool, str]:
    """Whether a wait that returned at ``returned`` (``time.monotonic()``) came within
    ``LATE_SLACK`` of the later of ``work``'s modeled end and gloo's completion, and what it was."""
    due = max(work.modeled_end, work.gloo_done_at or 0.0)
    allowed = LATE_SLACK[0] * work.seconds + LATE_SLACK[1]
    return returned - due <= allowed, (f"returned {returned - work.modeled_end:+.3f}s after its modeled end "
                                       f"({work.seconds:.3f}s modeled, gloo done at {due - work.modeled_end:+.3f}s), "
                                       f"allowed {allowed:.3f}s after the later")


def _end() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _wait_observed(work: Any) -> None:
    """Until the network has seen gloo finish ``work`` (its stats count it then)."""
    deadline = time.monotonic() + 60
    while work.gloo_done_at is None and time.monotonic() < deadline:
        time.sleep(0.001)


# ---------------------------------------------------------------- eager collectives at world 2
def _operations(world: int, rank: int, x: torch.Tensor) -> dict[str, tuple[str, int, Any]]:
    """name -> (kind, buffer bytes, run(group) -> output tensors): each API once, waited."""
    n, nbytes = world, x.numel() * x.element_size()

    def all_reduce(g):
        out = x.clone()
        dist.all_reduce(out, group=g)
        return [out]

    def all_gather_into_tensor(g):
        out = x.new_empty(n * x.numel())
        dist.all_gather_into_tensor(out, x, group=g)
        return [out]

    def reduce_scatter_tensor(g):
        out = x.new_empty(x.numel() // n)
        dist.reduce_scatter_tensor(out, x, group=g)
        return [out]

    def all_gather(g):
        outs = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(outs, x, group=g, async_op=True).wait()
        return outs

    def broadcast(g):
        out = x.clone()
        dist.broadcast(out, src=0, group=g)
        return [out]

    def reduce(g):
        out = x.clone()
        dist.reduce(out, dst=0, group=g)
        return [out]

    def all_to_all_single(g):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=g)
        return [out]

    def barrier(g):
        dist.barrier(group=g)
        return []

    def point_to_point(g):
        out = torch.zeros_like(x)
        if rank == 0:
            dist.send(x, dst=1, group=g)
        else:
            dist.recv(out, src=0, group=g)
        return [out]

    def functional_all_gather(g):
        return [_c10d.wait_tensor(_c10d.all_gather_into_tensor(x, n, g.group_name))]

    def functional_reduce_scatter(g):
        return [_c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", n, g.group_name))]

    def functional_all_reduce(g):
        return [_c10d.wait_tensor(_c10d.all_reduce(x, "sum", g.group_name))]

    def all_reduce_future(g):
        out = x.clone()
        return dist.all_reduce(out, group=g, async_op=True).get_future().wait()

    return {
        "all_reduce": ("all_reduce", nbytes, all_reduce),
        "all_gather_into_tensor": ("all_gather", n * nbytes, all_gather_into_tensor),
        "reduce_scatter_tensor": ("reduce_scatter", nbytes, reduce_scatter_tensor),
        "all_gather": ("all_gather", n * nbytes, all_gather),
        "broadcast": ("broadcast", nbytes, broadcast),
        "reduce": ("reduce", nbytes, reduce),
        "all_to_all_single": ("all_to_all", nbytes, all_to_all_single),
        "barrier": ("barrier", 0, barrier),
        "send/recv": ("send" if rank == 0 else "recv", nbytes, point_to_point),
        "functional all_gather": ("all_gather", n * nbytes, functional_all_gather),
        "functional reduce_scatter": ("reduce_scatter", nbytes, functional_reduce_scatter),
        "functional all_reduce": ("all_reduce", nbytes, functional_all_reduce),
        "all_reduce get_future": ("all_reduce", nbytes, all_reduce_future),
    }


class _CountingTime:
    """Stands in for the ``time`` module inside the network: counts sleeps."""

    def __init__(self) -> None:
        self.sleeps = 0
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        time.sleep(seconds)


def eager_worker(rank: int, world: int) -> dict:
    from fsdp_compile.network import completion, emulated

    out: dict[str, Any] = {"errors": {}}
    errors = out["errors"]
    # Set-up errors, before any group exists (the world size comes from WORLD_SIZE).
    errors["devices_per_node"] = expect_error(
        lambda: fsdp_compile.EmulatedNetwork(**SLOW, devices_per_node=3).init_process_group(timeout=PG_TIMEOUT))
    os.environ["LOCAL_WORLD_SIZE"] = "two"
    errors["LOCAL_WORLD_SIZE"] = expect_error(
        lambda: fsdp_compile.EmulatedNetwork(**SLOW).init_process_group(timeout=PG_TIMEOUT))
    del os.environ["LOCAL_WORLD_SIZE"]
    net = fsdp_compile.EmulatedNetwork(**SLOW)
    errors["backend"] = expect_error(lambda: net.init_process_group(backend="gloo"))

    net.init_process_group(timeout=PG_TIMEOUT)
    errors["twice"] = expect_error(lambda: fsdp_compile.EmulatedNetwork("1GB/s").init_process_group())
    pg = dist.group.WORLD
    out["world"] = {"type": type(pg).__name__, "backend": dist.get_backend(), "link": pg.link}
    plain = dist.new_group(list(range(world)), backend="gloo", timeout=PG_TIMEOUT)
    out["plain_type"] = type(plain).__name__

    # (a) each API: no earlier than the model, gloo's data, counted once.
    x = torch.randn(64 * 1024, generator=torch.Generator().manual_seed(rank))  # 256 KiB
    net.reset_stats()
    expected_counts: dict[str, int] = {}
    out["ops"] = {}
    for name, (kind, nbytes, run) in _operations(world, rank, x).items():
        reference = run(plain)
        start = time.monotonic()
        got = run(pg)
        elapsed = time.monotonic() - start
        expected_counts[kind] = expected_counts.get(kind, 0) + 1
        out["ops"][name] = {"elapsed": elapsed, "modeled": net.seconds(kind, nbytes, world, "intra"),
                            "bitwise": len(got) == len(reference) and all(map(torch.equal, got, reference))}
    out["counts"] = net.stats().counts()
    out["expected_counts"] = expected_counts

    # (a') and no later than the model allows (LATE_SLACK): each kind, modeled at 0.1-0.4 s.
    big = torch.randn(512 * 1024, generator=torch.Generator().manual_seed(rank))  # 2 MiB
    timed = {
        "all_reduce": lambda: dist.all_reduce(big.clone(), async_op=True),
        "all_gather": lambda: dist.all_gather_into_tensor(big.new_empty(world * big.numel()), big, async_op=True),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(big.new_empty(big.numel() // world), big,
                                                             async_op=True),
        "broadcast": lambda: dist.broadcast(big.clone(), src=0, async_op=True),
    }
    out["in_time"] = {}
    for name, issue in timed.items():
        dist.barrier(group=plain)
        work = issue()
        work.wait()
        returned = time.monotonic()
        _wait_observed(work)
        out["in_time"][name] = (work.seconds, *_returned_in_time(returned, work))

    # (b) back to back on one link, from two groups on it: the second waits for the first.
    other = dist.new_group(list(range(world)), timeout=PG_TIMEOUT)
    dist.barrier(group=plain)
    start = time.monotonic()
    first = dist.all_reduce(x.clone(), async_op=True)
    second = dist.all_gather_into_tensor(x.new_empty(world * x.numel()), x, group=other, async_op=True)
    first.wait()
    first_done = time.monotonic()
    second.wait()
    second_done = time.monotonic()
    _wait_observed(first)
    _wait_observed(second)
    out["serial"] = {
        "first_elapsed": first_done - start, "both_elapsed": second_done - start,
        "first": net.seconds("all_reduce", x.nbytes, world), "second": net.seconds("all_gather", world * x.nbytes, world),
        "second_start": second.modeled_start, "first_end": first.modeled_end,
        "links": (first.link, second.link), "other_group": type(other).__name__,
        "in_time": [_returned_in_time(first_done, first), _returned_in_time(second_done, second)],
    }

    # A wait before the modeled end sleeps (a sleep or two, not a spin); one after it returns at once.
    clock = _CountingTime()
    emulated.time = completion.time = clock
    try:
        dist.barrier(group=plain)
        work = dist.all_reduce(torch.randn(256 * 1024), async_op=True)  # 1 MiB: modeled ~0.2 s
        work.wait()
        _wait_observed(work)
        # Gloo takes ~1 ms for this; only a machine stalled for 0.2 s would finish it after the end.
        out["before_end"] = {"sleeps": clock.sleeps, "gloo_overran": work.gloo_done_at > work.modeled_end}
        work = dist.all_reduce(x.clone(), async_op=True)
        while time.monotonic() < work.modeled_end + 0.01:
            time.sleep(0.01)
        _wait_observed(work)
        clock.sleeps = 0
        work.wait()
        out["sleeps_after_end"] = clock.sleeps
    finally:
        emulated.time = completion.time = time

    # Overruns: a peer that comes 0.3 s late makes gloo finish long after a ~3 ms model.
    dist.barrier(group=plain)
    net.reset_stats()
    net.record()
    if rank == 1:
        time.sleep(0.3)
    work = dist.all_reduce(torch.ones(1024), async_op=True)
    work.wait()
    _wait_observed(work)
    stats = net.stats()
    out["overrun"] = {"modeled": work.seconds, "total": stats.overruns(), "summary": stats.overrun_summary(),
                      "table": str(stats), "recorded": len(net.recorded()),
                      "causes": fsdp_compile.network.lateness_causes(net)}
    net.record(False)

    # A running network at a new speed: the groups made before it use the new link at once.
    dist.barrier(group=plain)
    net.set_links(intra_node="5MB/s")
    start = time.monotonic()
    work = dist.all_reduce(x.clone(), async_op=True)
    work.wait()
    returned = time.monotonic()
    _wait_observed(work)
    out["set_links"] = {"elapsed": returned - start, "seconds": work.seconds,
                        "expected": SLOW_LATENCY + 2 * (world - 1) / world * x.nbytes / 5e6,
                        "in_time": _returned_in_time(returned, work)}
    _end()
    return out


@functools.cache
def eager_run() -> list[dict]:
    return run_workers(eager_worker, 2, default_group=False)


def test_every_group_is_emulated() -> None:
    for r in eager_run():
        assert r["world"] == {"type": "EmulatedProcessGroup", "backend": "emulated", "link": "intra"}
        assert r["serial"]["other_group"] == "EmulatedProcessGroup"  # new_group follows the default group
        assert r["plain_type"] == "ProcessGroup"  # backend="gloo" still gets plain gloo


def test_no_collective_completes_before_its_modeled_time() -> None:
    for rank, r in enumerate(eager_run()):
        for name, op in r["ops"].items():
            assert op["modeled"] >= 0.002, name  # a real bound: at least the latency
            assert op["elapsed"] >= op["modeled"], f"rank {rank} {name}: done after {op['elapsed']:.4f}s, " \
                                                   f"modeled {op['modeled']:.4f}s"


def test_no_collective_completes_much_after_its_modeled_time() -> None:
    """The upper bound the figures measured on the network rest on: an emulation that slept too
    long would make every strategy look communication-bound (slack: ``LATE_SLACK``)."""
    for rank, r in enumerate(eager_run()):
        for name, (seconds, in_time, what) in r["in_time"].items():
            assert seconds >= 0.1, name  # long enough that sleeping twice it exceeds the slack
            assert in_time, f"rank {rank} {name}: {what}"
        for in_time, what in r["serial"]["in_time"]:
            assert in_time, f"rank {rank}, two collectives on one link: {what}"
        in_time, what = r["set_links"]["in_time"]
        assert in_time, f"rank {rank}, after set_links: {what}"


def test_collectives_deliver_exactly_what_gloo_delivers() -> None:
    for rank, r in enumerate(eager_run()):
        differ = [name for name, op in r["ops"].items() if not op["bitwise"]]
        assert not differ, f"rank {rank}: {differ} differ from plain gloo"


def test_stats_count_each_collective_once_by_kind() -> None:
    for rank, r in enumerate(eager_run()):
        assert r["counts"] == r["expected_counts"], rank


def test_collectives_on_one_link_take_turns() -> None:
    for rank, r in enumerate(eager_run()):
        s = r["serial"]
        assert s["links"] == ("intra", "intra")
        assert s["first_elapsed"] >= s["first"]
        # The second, issued while the first was on the link, ends no earlier than both durations.
        assert s["both_elapsed"] >= s["first"] + s["second"], f"rank {rank}: {s}"
        assert s["second_start"] >= s["first_end"], f"rank {rank}: {s}"


def test_waits_sleep_until_the_end_and_return_at_once_after_it() -> None:
    for r in eager_run():
        before = r["before_end"]
        assert 1 <= before["sleeps"] <= 2 or before["gloo_overran"], before
        assert r["sleeps_after_end"] == 0


def test_stats_report_overruns() -> None:
    late_peer_waited_for = eager_run()[0]["overrun"]
    total = late_peer_waited_for["total"]
    assert total.observed == 1 and total.count == 1, late_peer_waited_for["table"]
    # Rank 1 came 0.3 s late; rank 0's gloo could not finish before it.
    assert 0.2 <= total.max_seconds == total.total_seconds, late_peer_waited_for["table"]
    assert late_peer_waited_for["summary"].startswith("emulation overran in 1 of 1 observed collectives")
    # ... and the ranks' issue times say so: rank 0's lateness is the late peer's, not gloo's. (The
    # late rank itself may finish a few ms after its own ~3 ms model on a loaded machine: gloo's.)
    causes = late_peer_waited_for["causes"]
    assert late_peer_waited_for["recorded"] == 1
    assert causes.collectives == 2 and causes.late >= 1, causes
    assert 0.2 <= causes.from_peers_seconds <= causes.lateness_seconds, causes.summary()


def test_a_running_network_takes_new_link_speeds() -> None:
    for rank, r in enumerate(eager_run()):
        changed = r["set_links"]
        assert changed["seconds"] == pytest.approx(changed["expected"], rel=1e-9), rank
        assert changed["elapsed"] >= changed["seconds"], rank


def test_bad_set_up_is_refused_with_a_way_out() -> None:
    errors = eager_run()[0]["errors"]
    assert errors["devices_per_node"].startswith("ValueError: devices_per_node=3 does not divide the world size 2")
    assert errors["LOCAL_WORLD_SIZE"].startswith("ValueError: LOCAL_WORLD_SIZE='two' is not a positive int")
    assert errors["backend"].startswith("TypeError: EmulatedNetwork.init_process_group() chooses the backend")
    assert "a default process group already exists (backend 'emulated')" in errors["twice"]
    assert "destroy_process_group() first" in errors["twice"]


# ---------------------------------------------------------------- training at world 2
def _train(model: torch.nn.Module, forward: Any, data: list, rank: int, net: Any = None) -> dict:
    """Two AdamW steps; with ``net``, the network's stats over the second forward and backward
    (the first compiles)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"losses": []}
    for step, (x, y) in enumerate(data):
        if net is not None and step == 1:
            net.reset_stats()
        loss = lm_loss(forward(local_slice(x, rank)), local_slice(y, rank))
        loss.backward()
        if net is not None and step == 1:
            out["stats"] = net.stats()
        if step == 0:
            out["grads0"] = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    return out


def training_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fsdp_compile.inspection.graphinfo import collective_counts

    net = fsdp_compile.EmulatedNetwork("500MB/s", latency="20us")
    net.init_process_group(timeout=PG_TIMEOUT)
    plain = dist.new_group(list(range(world)), backend="gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, 2)
    out: dict[str, Any] = {}
    for network, group in (("gloo", plain), ("emulated", None)):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        options = {} if group is None else {"process_groups": group}
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager", **options)
        backend.shard(model)
        result = _train(model, torch.compile(model, backend=backend), data, rank,
                        net if network == "emulated" else None)
        if network == "emulated":
            graphs: dict[str, int] = {}
            for record in backend.graphs:
                for gm in (record.forward, record.backward):
                    for kind, count in collective_counts(gm).items():
                        graphs[kind] = graphs.get(kind, 0) + count
            result["graph_counts"] = graphs
        out[f"fsdp_compile {network}"] = result

        model = copy.deepcopy(base)
        mesh = init_device_mesh("cpu", (world,)) if group is None else DeviceMesh.from_group(group, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[f"fsdp2 {network}"] = _train(model, model, data, rank)

        model = copy.deepcopy(base)
        ddp = DDP(model, process_group=group)
        out[f"ddp {network}"] = _train(model, ddp, data, rank)
    _end()
    return out


@functools.cache
def training_run() -> list[dict]:
    return run_workers(training_worker, 2, default_group=False)


@pytest.mark.parametrize("trainer", ["fsdp_compile", "fsdp2", "ddp"])
def test_training_is_bitwise_that_of_plain_gloo(trainer: str) -> None:
    for rank, r in enumerate(training_run()):
        gloo, emulated = r[f"{trainer} gloo"], r[f"{trainer} emulated"]
        assert emulated["losses"] == gloo["losses"], rank
        assert_bitwise(emulated["grads0"], gloo["grads0"], f"{trainer} first-step gradients, rank {rank}")
        assert_bitwise(emulated["params"], gloo["params"], f"{trainer} parameters after 2 steps, rank {rank}")


def test_stats_count_the_collectives_of_the_compiled_graphs() -> None:
    for rank, r in enumerate(training_run()):
        result = r["fsdp_compile emulated"]
        graphs = {kind: count for kind, count in result["graph_counts"].items() if count}
        assert graphs.get("all_gather") and graphs.get("reduce_scatter")
        assert result["stats"].counts() == graphs, rank


# ---------------------------------------------------------------- 2 nodes x 2 devices at world 4
def hybrid_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.inspection.graphinfo import collectives

    net = fsdp_compile.EmulatedNetwork(**SLOW, devices_per_node=2)
    net.init_process_group(timeout=PG_TIMEOUT)
    out: dict[str, Any] = {"world_link": dist.group.WORLD.link}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    intra, inter = mesh.get_group("shard"), mesh.get_group("replicate")
    out["mesh_links"] = (intra.link, inter.link)
    plain = dist.new_group(list(range(world)), backend="gloo", timeout=PG_TIMEOUT)

    # An all-reduce across nodes runs at the inter-node bandwidth.
    x = torch.randn(16 * 1024)  # 64 KiB: 2 MB/s inter -> ~66 ms
    dist.barrier(group=plain)
    start = time.monotonic()
    work = dist.all_reduce(x, group=inter, async_op=True)
    work.wait()
    returned = time.monotonic()
    _wait_observed(work)
    out["inter"] = {"elapsed": returned - start, "seconds": work.seconds,
                    "expected": net.inter.latency + x.nbytes / net.inter.bandwidth,
                    "in_time": _returned_in_time(returned, work)}

    # The two links are separate: an inter-node all-reduce issued while the intra-node link is
    # busy starts at once (checked on the model's own clock, not the wall clock).
    dist.barrier(group=plain)
    big = torch.randn(1024 * 1024)  # a 4 MiB all-gather: ~0.2 s on the intra-node link
    gather = dist.all_gather_into_tensor(big, big[: big.numel() // 2].clone(), group=intra, async_op=True)
    reduce = dist.all_reduce(x.clone(), group=inter, async_op=True)
    gather.wait()
    reduce.wait()
    out["overlap"] = {"intra_end": gather.modeled_end, "inter_issued": reduce.issued_at,
                      "inter_start": reduce.modeled_start, "links": (gather.link, reduce.link)}

    # fsdp_compile's hybrid groups come from new_group: gathers and reduce-scatters inside a
    # node, all-reduces across nodes, each counted on its link as the graphs hold them.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(TEST_CONFIG)
    backend = fsdp_compile.backend("HYBRID_SHARD", compiler="aot_eager", shard_size=2)
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    x, y = batches(TEST_CONFIG, world, 1)[0]
    lm_loss(compiled(local_slice(x, rank)), local_slice(y, rank)).backward()  # compiles
    net.reset_stats()
    lm_loss(compiled(local_slice(x, rank)), local_slice(y, rank)).backward()
    counted = net.stats()
    from torch.distributed.distributed_c10d import _resolve_process_group

    graphs: dict[tuple[str, str], int] = {}
    for record in backend.graphs:
        for gm in (record.forward, record.backward):
            for c in collectives(gm):
                key = (c.kind, _resolve_process_group(c.group).link)
                graphs[key] = graphs.get(key, 0) + 1
    out["hybrid"] = {"stats": {key: use.count for key, use in counted.usage.items() if use.count}, "graphs": graphs}

    # torch's FSDP2 in HSDP on a 2 x 2 mesh of its own: the same split of the links.
    torch.manual_seed(0)
    model = fsdp2_model(GPT(TEST_CONFIG), fsdp_compile.ShardingStrategy.HYBRID_SHARD, world)
    net.reset_stats()
    lm_loss(model(local_slice(x, rank)), local_slice(y, rank)).backward()
    out["fsdp2_hsdp"] = {key: use.count for key, use in net.stats().usage.items() if use.count}
    _end()
    return out


@functools.cache
def hybrid_run() -> list[dict]:
    return run_workers(hybrid_worker, 4, default_group=False)


def test_groups_spanning_nodes_run_at_the_inter_node_bandwidth() -> None:
    for rank, r in enumerate(hybrid_run()):
        assert r["world_link"] == "inter"
        assert r["mesh_links"] == ("intra", "inter")
        inter = r["inter"]
        assert inter["seconds"] == pytest.approx(inter["expected"], rel=1e-9), rank
        assert inter["elapsed"] >= inter["seconds"], rank
        in_time, what = inter["in_time"]
        assert in_time, f"rank {rank}, across nodes: {what}"


def test_intra_and_inter_node_links_do_not_wait_for_each_other() -> None:
    for rank, r in enumerate(hybrid_run()):
        o = r["overlap"]
        assert o["links"] == ("intra", "inter")
        assert o["intra_end"] > o["inter_issued"], f"rank {rank}: the intra-node gather was over; inconclusive"
        assert o["inter_start"] == o["inter_issued"], f"rank {rank}: {o}"


def test_hybrid_stats_count_the_graphs_collectives_on_their_links() -> None:
    for rank, r in enumerate(hybrid_run()):
        h = r["hybrid"]
        assert h["graphs"].get(("all_gather", "intra")) and h["graphs"].get(("reduce_scatter", "intra"))
        assert h["graphs"].get(("all_reduce", "inter"))
        assert h["stats"] == h["graphs"], rank


def test_fsdp2_hybrid_shards_within_nodes_and_all_reduces_across_them() -> None:
    for rank, r in enumerate(hybrid_run()):
        counts = r["fsdp2_hsdp"]
        assert set(counts) == {("all_gather", "intra"), ("reduce_scatter", "intra"), ("all_reduce", "inter")}, \
            f"rank {rank}: {counts}"
