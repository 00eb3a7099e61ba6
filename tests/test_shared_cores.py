"""Ranks time-slicing a machine's cores, played together (``planning.host.shared_cores``), and the
drift they are played at (``calibration.drift``)."""

from __future__ import annotations

import pytest
import torch

from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.planning import Cluster, ClusterError, plan
from fsdp_compile.planning.simulate import simulate_events
from fsdp_compile_lab.host import HostCPU
from fsdp_compile_lab.host.shared_cores import partition, quantum, shared_step, shares, spread

LOCKSTEP = HostCPU()  # one rank's timeline, whose events carry the host's numbers

DRIFT = 0.03  # about what a 2-core machine measures for 4 ranks (calibration.drift)


def test_each_ranks_group_follows_rank_0s_layout():
    assert partition((0, 1), 4) == [(0, 1), (2, 3)]  # a node's ranks
    assert partition((0, 2), 4) == [(0, 2), (1, 3)]  # across nodes (a mesh's other dimension)
    assert partition((0, 1, 2, 3), 4) == [(0, 1, 2, 3)]
    assert partition((0, 2), 8) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert partition((0, 3), 4) is None and partition((1, 2), 4) is None and partition((0, 1, 3), 4) is None


def test_the_cores_go_in_proportion_to_the_weights_none_above_one():
    assert shares([0, 1], [1.0, 5.0], 2) == {0: 1.0, 1: 1.0}  # a core each: weights do not matter
    even = shares([0, 1, 2, 3], [1.0] * 4, 2)
    assert even == {r: 0.5 for r in range(4)}
    uneven = shares([0, 1, 2], [10.0, 1.0, 1.0], 2)
    assert uneven[0] == 1.0 and uneven[1] == uneven[2] == pytest.approx(0.5)
    assert sum(shares([0, 1, 2, 3], [3.0, 1.0, 0.5, 0.2], 2).values()) == pytest.approx(2.0)


def test_the_quantum_reproduces_the_drift_the_machine_measured():
    for drift in (0.015, DRIFT, 0.05):
        played = spread(0.2, quantum(drift, 4, 2), 4, 2)
        assert played == pytest.approx(drift, rel=0.15)
    assert quantum(2 * DRIFT, 4, 2) == pytest.approx(4 * quantum(DRIFT, 4, 2))  # spread grows as its root
    with pytest.raises(ValueError, match="drift"):
        quantum(0.0, 4, 2)


def cpu_cluster() -> Cluster:
    return Cluster(name="toy-cpu", nodes=2, devices_per_node=2, device_memory=2e9,
                   peak_flops={torch.float32: 5e10}, memory_bandwidth=1e10, intra_node_bandwidth=1e8,
                   inter_node_bandwidth=2e7, intra_node_latency=1e-5, inter_node_latency=5e-5, device_type="cpu")


def step(events, **kw):
    groups = {e[1]: partition((0, 1, 2, 3), 4) for e in events if e[0] == "issue"}
    return shared_step([events], groups, world=4, per_machine=4, cores=2, drift=kw.pop("drift", DRIFT), **kw)


def test_compute_alone_takes_the_slowest_ranks_time():
    # priced at the share of a core each rank gets while all compute: 4 x 0.2 s over 2 cores
    # The cores never idle while a rank has work: at worst the slowest rank gets no core until
    # the other three are done (0.3 core-seconds on 2 cores, 0.15 s), then finishes its 0.1
    # core-seconds on a core of its own, at 0.25 s, however far apart the ranks drift.
    played = step([("compute", 0.2)])
    assert 0.2 < played <= 0.25
    assert played < step([("compute", 0.2)], drift=2 * DRIFT) <= 0.25  # further apart, the last later


def rounds(n: int, before: float, after: float, link: float) -> list:
    events = []
    for i in range(n):
        # the backend's own work (2 ms) is far shorter than the link's, as on an emulated network
        events += [("compute", before), ("issue", i, link, "inter", 0, 0.0, 0.002), ("compute", after), ("wait", i)]
    return events


def test_a_wait_others_compute_through_costs_the_machine_less_than_lockstep():
    # FULL_SHARD-like: a prefetched collective waited for mid-step, compute after it
    events = rounds(12, 0.02, 0.002, 0.015)
    lockstep = simulate_events(events, host=LOCKSTEP).seconds
    waits = lockstep - 12 * 0.022
    assert waits == pytest.approx(12 * 0.013)
    # Nor below the compute alone: 4 ranks' 0.264 s each at half a core is all 2 cores can do.
    assert 12 * 0.022 <= step(events) < lockstep - 0.3 * waits


def test_a_wait_every_rank_reaches_with_nothing_left_costs_all_of_it():
    # NO_SHARD-like: the last reduction, waited for at the end of backward
    events = [("compute", 0.1), ("issue", 0, 0.06, "inter", 0, 0.0, 0.002), ("wait", 0)]
    # and no more: the last rank issues it when its compute ends (the same draws as compute
    # alone), and every wait returns the link's 0.06 s after that at the latest.
    assert simulate_events(events, host=LOCKSTEP).seconds <= step(events) <= step([("compute", 0.1)]) + 0.06 + 1e-9


def test_the_backend_starts_when_the_groups_last_rank_has_issued():
    # backend work (7th field) longer than the link: every rank waits for the last one's issue plus it
    events = [("compute", 0.05), ("issue", 0, 0.001, "inter", 0, 0.0, 0.02), ("wait", 0)]
    alone = step([("compute", 0.05)])
    # and not later: the link (1 ms) started earlier and ends before it.
    assert alone + 0.02 - 1e-9 <= step(events) <= alone + 0.02 + 1e-9
    with pytest.raises(ValueError, match="core of its own"):
        shared_step([events], {0: [(0, 1)]}, world=2, per_machine=2, cores=2, drift=DRIFT)


def test_plan_plays_the_step_on_every_rank_where_ranks_share_the_cores():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, d_model=64)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(2, 32, dtype=torch.long)
    cluster = cpu_cluster()
    kw = {"loss_fn": lambda out: out.float().square().mean(), "prefetch": (1,), "strategies": ["FULL_SHARD"],
          "world_size": 4}
    lockstep = plan(model, (tokens,), cluster=cluster, **kw).row("FULL_SHARD")
    shared = plan(model, (tokens,), cluster=cluster.replace(host=HostCPU(core_sharing=(4, 2), rank_drift=DRIFT)),
                  **kw).row("FULL_SHARD")
    # Playing every rank moves how much communication the step exposes: some, never more than
    # all of it (the step is nearly all communication here: 52 ms of 53).
    assert 0 < abs(shared.step_seconds - lockstep.step_seconds) <= lockstep.comm_seconds
    # the difference is communication's: compute and memory are priced as before
    assert shared.exposed_comm_seconds - lockstep.exposed_comm_seconds == pytest.approx(
        shared.step_seconds - lockstep.step_seconds)
    assert shared.compute_seconds == lockstep.compute_seconds and shared.peak_bytes == lockstep.peak_bytes
    # measured sharing without a drift (or a world with a core per rank) plans in lockstep
    none = plan(model, (tokens,), cluster=cluster.replace(host=HostCPU(core_sharing=(4, 2))), **kw).row("FULL_SHARD")
    assert none.step_seconds == lockstep.step_seconds


def test_core_sharing_must_say_more_ranks_than_cores():
    cluster = cpu_cluster()
    for bad in ((2, 2), (4,), (4, 0), (4.0, 2)):
        with pytest.raises(ClusterError, match="core_sharing"):
            cluster.replace(host=HostCPU(core_sharing=bad))
    with pytest.raises(ClusterError, match="rank_drift"):
        cluster.replace(host=HostCPU()).with_host(rank_drift=-0.01)


def drift_worker(rank: int, world: int) -> tuple:
    from fsdp_compile_lab.calibration.drift import core_sharing, rank_drift

    return core_sharing(torch.device("cpu")), rank_drift(None, torch.device("cpu"), 3)


def test_the_drift_is_measured_only_where_ranks_outnumber_the_cores(monkeypatch):
    import os

    from distributed import run_workers

    from fsdp_compile_lab.calibration import cores, drift

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert drift.core_sharing(torch.device("cpu")) is None  # a core per rank
    assert drift.rank_drift(None, torch.device("cpu"), 3) == 0.0  # nothing runs: no process group here
    assert drift.core_sharing(torch.device("cuda")) is None
    monkeypatch.undo()
    cores = len(os.sched_getaffinity(0))
    results = run_workers(drift_worker, 4)
    if cores >= 4:
        pytest.skip(f"{cores} cores: 4 ranks have one each")
    assert {r[0] for r in results} == {(4, cores)}
    assert len({r[1] for r in results}) == 1 and 0.0 < results[0][1] < 1.0, results  # the same on every rank
