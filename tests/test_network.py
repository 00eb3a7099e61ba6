"""The emulated network's model and input checks, in one process.

A user states link speeds the way vendors print them ("2GB/s", "100Gb/s", "1.5GiB/s", "20us"),
so each accepted form must mean what it says (a bit/byte mix-up is off by 8x), and anything else
must be refused with the argument's name and the forms that work. The ring model must be the
one the graph inspection and the planner use, or the network would time other collectives than
the planner predicts. Stats must say plainly when gloo overran the model.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdp_compile
from fsdp_compile.network import Link, parse_bandwidth, parse_latency, wire_bytes
from fsdp_compile.network.stats import Overruns, StatsRecorder
from fsdp_compile.passes.graph import Collective
from fsdp_compile.runtime import ring


@pytest.mark.parametrize("text, bytes_per_second", [
    ("2GB/s", 2e9), ("200MB/s", 2e8), ("10Gbit/s", 1.25e9), ("100Gb/s", 12.5e9), ("1.5GiB/s", 1.5 * 2 ** 30),
    ("25Gbps", 3.125e9), ("800 kB/s", 8e5), ("3TB/s", 3e12), (5e8, 5e8), (7, 7.0), (math.inf, math.inf),
])
def test_bandwidth_forms(text, bytes_per_second) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second, rel=1e-12)


@pytest.mark.parametrize("text, seconds", [
    ("20us", 2e-5), ("20µs", 2e-5), ("0.5ms", 5e-4), ("1e-5s", 1e-5), ("800ns", 8e-7), ("2 ms", 2e-3),
    (2e-5, 2e-5),
])
def test_latency_forms(text, seconds) -> None:
    assert parse_latency(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"intra_node": "2GB"}, ValueError, "intra_node='2GB' is not a bandwidth this understands; pass a number of bytes per second"),
    ({"intra_node": "fast"}, ValueError, "intra_node='fast' is not a bandwidth"),
    ({"intra_node": "1GB/s", "inter_node": 0}, ValueError, "inter_node=0: a bandwidth must be positive"),
    ({"intra_node": "-2GB/s"}, ValueError, "intra_node='-2GB/s': a bandwidth must be positive"),
    ({"intra_node": "1GB/s", "inter_node": float("nan")}, ValueError, "inter_node=nan: a bandwidth must be positive"),
    ({"intra_node": None}, TypeError, "intra_node= must be a number of bytes per second"),
    ({"intra_node": True}, TypeError, "intra_node= must be a number of bytes per second"),
    ({"intra_node": "1GB/s", "latency": "20"}, ValueError, "latency='20' is not a latency this understands; pass a number of seconds"),
    ({"intra_node": "1GB/s", "latency": "-1us"}, ValueError, "latency='-1us': a latency must be a positive, finite number of seconds"),
    ({"intra_node": "1GB/s", "latency": "0us"}, ValueError, "latency='0us': a latency must be a positive, finite number of seconds"),
    ({"intra_node": "1GB/s", "latency": -1e-6}, ValueError, "latency=-1e-06: a latency must be"),
    ({"intra_node": "1GB/s", "devices_per_node": 0}, ValueError, "devices_per_node=0 must be a positive int"),
    ({"intra_node": "1GB/s", "devices_per_node": 1.5}, ValueError, "devices_per_node=1.5 must be a positive int"),
])
def test_bad_network_arguments_are_refused_with_the_accepted_forms(kwargs, error, message) -> None:
    with pytest.raises(error) as raised:
        fsdp_compile.EmulatedNetwork(**kwargs)
    assert message in str(raised.value)
    if "bandwidth" in message or "must be a number of bytes" in message:
        assert '"2GB/s", "200MB/s"' in str(raised.value) and '"10Gbit/s"' in str(raised.value)
    elif "latency" in message:
        assert '"20us", "0.5ms", "1e-5s"' in str(raised.value)


def test_ring_model() -> None:
    mib = 2 ** 20
    assert wire_bytes("all_gather", 4 * mib, 4) == 3 * mib
    assert wire_bytes("reduce_scatter", 4 * mib, 4) == 3 * mib
    assert wire_bytes("all_reduce", 4 * mib, 4) == 6 * mib
    assert wire_bytes("broadcast", 4 * mib, 4) == 4 * mib
    assert wire_bytes("barrier", 4 * mib, 4) == 0
    assert wire_bytes("send", mib, 2) == mib
    assert wire_bytes("all_reduce", mib, 1) == 0  # nobody to talk to
    # The network times collectives by the ring model the graph inspection and the planner use.
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert wire_bytes(kind, 4 * mib, 4) == ring.wire_bytes(kind, 4 * mib, 4)
        assert Collective(kind, "g", 4, torch.float32, 4 * mib).wire_bytes == wire_bytes(kind, 4 * mib, 4)
    with pytest.raises(ValueError, match="unknown collective kind 'gossip'"):
        wire_bytes("gossip", mib, 2)


def test_link_time_is_latency_plus_wire_bytes_over_bandwidth() -> None:
    link = Link("inter", bandwidth=1e8, latency=2e-5)
    assert link.seconds("all_reduce", 10 ** 8, 2) == pytest.approx(2e-5 + 1.0)
    assert link.seconds("all_gather", 10 ** 8, 2) == pytest.approx(2e-5 + 0.5)
    assert link.seconds("barrier", 0, 8) == 2e-5
    assert link.seconds("all_reduce", 10 ** 8, 1) == 0.0
    net = fsdp_compile.EmulatedNetwork(intra_node="1GB/s", inter_node="100MB/s", latency="20us")
    assert net.seconds("all_gather", 10 ** 8, 2, "inter") == pytest.approx(2e-5 + 0.5)
    assert net.seconds("all_gather", 10 ** 8, 2, "intra") == pytest.approx(2e-5 + 0.05)
    assert net.seconds("all_gather", 10 ** 8, 1, "local") == 0.0
    unlimited = fsdp_compile.EmulatedNetwork(math.inf, latency="1ns")
    assert unlimited.seconds("all_reduce", 10 ** 9, 8) == 1e-9


def test_links_of_a_running_network_can_be_changed_and_bad_values_change_nothing() -> None:
    # A sweep over link speeds reuses the compiled models of one process, so the speed has to
    # change after the default group exists.
    net = fsdp_compile.EmulatedNetwork(intra_node="1GB/s", inter_node="100MB/s", latency="20us")
    net.set_links(intra_node="500MB/s")
    assert (net.intra.bandwidth, net.inter.bandwidth) == (5e8, 1e8) and net.intra.latency == pytest.approx(2e-5)
    assert net.seconds("all_gather", 10 ** 8, 2, "intra") == pytest.approx(2e-5 + 0.1)
    net.set_links(inter_node=math.inf, latency="1ms")
    assert net.inter.bandwidth == math.inf and net.intra.bandwidth == 5e8
    assert net.intra.latency == net.inter.latency == 1e-3
    assert net.seconds("all_reduce", 10 ** 9, 2, "inter") == 1e-3
    before = net.links()
    with pytest.raises(ValueError, match="inter_node='fast' is not a bandwidth"):
        net.set_links(intra_node="2GB/s", inter_node="fast")
    with pytest.raises(ValueError, match="latency=0: a latency must be a positive"):
        net.set_links(intra_node="2GB/s", latency=0)
    assert net.links() == before


def test_stats_sum_by_kind_and_link_and_say_how_gloo_overran() -> None:
    recorder = StatsRecorder()
    recorder.issued("all_gather", "intra", 75.0, 100, 0.5)
    recorder.issued("all_gather", "intra", 75.0, 100, 0.5)
    recorder.issued("all_reduce", "inter", 100.0, 100, 1.0)
    recorder.completed("all_gather", "intra", -0.1)  # before the modeled end: held
    recorder.completed("all_gather", "intra", 0.002)
    recorder.completed("all_reduce", "inter", 0.25)
    stats = recorder.snapshot()
    assert stats.counts() == {"all_gather": 2, "all_reduce": 1}
    assert stats.count(link="intra") == 2 and stats.count("all_reduce", "inter") == 1
    intra = stats.total(link="intra")
    assert (intra.wire_bytes, intra.buffer_bytes, intra.busy_seconds) == (150.0, 200, 1.0)
    total = stats.overruns()
    assert (total.observed, total.count, total.held()) == (3, 2, False)
    assert total.max_seconds == 0.25 and total.total_seconds == pytest.approx(0.252)
    assert stats.overruns(link="intra") == Overruns(1, 2, 0.002, 0.002)
    assert stats.overrun_summary() == ("emulation overran in 2 of 3 observed collectives: gloo finished up to "
                                       "250ms after the model (252ms in total)")
    assert stats.to_dict()["overruns"] == {"count": 2, "observed": 3, "max_seconds": 0.25,
                                           "total_seconds": pytest.approx(0.252)}
    assert stats.to_dict()["usage"]["all_reduce/inter"]["overrun_max_seconds"] == 0.25
    assert "all_reduce     inter" in str(stats)
    recorder.reset()
    assert recorder.snapshot().overrun_summary() == "emulation held: no overrun in 0 observed collectives"


def test_stats_of_two_windows_add_up() -> None:
    first, second = StatsRecorder(), StatsRecorder()
    first.issued("all_gather", "intra", 75.0, 100, 0.5)
    first.completed("all_gather", "intra", 0.003)
    second.issued("all_gather", "intra", 75.0, 100, 0.5)
    second.completed("all_gather", "intra", 0.001)
    second.issued("all_reduce", "inter", 100.0, 100, 1.0)
    summed = first.snapshot() + second.snapshot()
    assert summed.counts() == {"all_gather": 2, "all_reduce": 1}
    assert summed.total(link="intra").busy_seconds == 1.0
    assert summed.overruns() == Overruns(2, 2, 0.003, pytest.approx(0.004))
    assert first.snapshot().counts() == {"all_gather": 1}  # the operands are left as they were


def test_a_network_is_set_up_only_as_the_default_group() -> None:
    import torch.distributed as dist

    from fsdp_compile.network import emulated

    net = fsdp_compile.EmulatedNetwork("1GB/s")
    with pytest.raises(TypeError, match="chooses the backend itself; drop backend="):
        net.init_process_group(backend="gloo")
    # The backend name alone, without a network, says where to start.
    previous, emulated._active = emulated._active, None
    try:
        with pytest.raises(RuntimeError, match=r"set up by fsdp_compile.EmulatedNetwork\(...\).init_process_group\(\)"):
            emulated._create_group(None, None)
    finally:
        emulated._active = previous
    assert not dist.is_initialized()


def test_lateness_is_split_between_a_late_peer_and_gloo() -> None:
    from fsdp_compile.network.lateness import split_lateness

    pair = (0, 1)
    records = [
        # (group ranks, index, kind, link, issued_at, modeled_end, gloo_done_at)
        [(pair, 0, "all_reduce", "intra", 0.0, 0.003, 0.302),   # rank 1 came 0.3 s late: gloo waited for it
         (pair, 1, "all_gather", "intra", 1.0, 1.003, 1.050),   # both on time, gloo slow: its own lateness
         (pair, 2, "all_gather", "intra", 2.0, 2.100, 2.010),   # on time
         (pair, 3, "all_gather", "intra", 3.0, 3.003, None),    # completion never seen: not counted
         ((0, 2), 0, "all_reduce", "inter", 4.0, 4.003, 4.5)],  # rank 2 recorded nothing: not counted
        [(pair, 0, "all_reduce", "intra", 0.3, 0.303, 0.302),   # the late rank itself was not late
         (pair, 1, "all_gather", "intra", 1.0, 1.003, 1.050),
         (pair, 2, "all_gather", "intra", 2.0, 2.100, 2.010),
         (pair, 3, "all_gather", "intra", 3.0, 3.003, None)],
    ]
    causes = split_lateness(records)
    assert (causes.collectives, causes.late) == (6, 3)
    assert causes.lateness_seconds == pytest.approx(0.299 + 2 * 0.047)
    # had gloo finished when rank 1 issued, rank 0 would still have been 0.297 s late; the slow
    # gather owes nothing to a peer
    assert causes.from_peers_seconds == pytest.approx(0.297)
    assert causes.by_kind["all_gather/intra"]["from_peers_seconds"] == 0.0
    assert causes.by_kind["all_reduce/intra"]["late"] == 1
    assert causes.peer_wait_seconds[1] == pytest.approx(0.0) and causes.peer_wait_seconds[2] > 0.2
    assert "from the group's last rank arriving late" in causes.summary()
    assert split_lateness([[], []]).summary() == "none of 0 recorded collectives finished after the model"
