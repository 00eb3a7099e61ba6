"""The planner on an emulated network: ``Cluster.measure()`` measures the links it runs on.

On a network of two nodes whose inter-node link is ten times slower than the intra-node one,
``Cluster.measure()`` fits the intra-node collectives on groups of one node's ranks and the
inter-node ones on groups of one rank per node, so a plan prices a hybrid strategy's
all-reduce across nodes on the slow link. The links' fits are what the network charged the
collectives it ran (an emulated collective's wall time is the later of its link and gloo);
gloo's own time is fitted apart, with the links unlimited, by the lab's host model
(``Cluster.measure(host=HostCPU)``). Timing still fits plain gloo and
the ring model (``test_collective_fits_recover_the_emulated_link``).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import pytest
from distributed import run_workers

import fsdp_compile
from fsdp_compile.planning.cli import _emulated_network
from fsdp_compile.sharding.groups import end_process_group
from fsdp_compile_lab import HostCPU

INTRA, INTER = 200e6, 20e6


@contextlib.contextmanager
def collectives_timed_alone() -> Iterator[None]:
    """These tests check that a fit recovers the link it ran on. Where ranks fill the cores the
    calibration times collectives beside a computing thread, whose competition for the cores
    delays each wake-up from a wait by a varying amount, and the fitted line can then tilt
    either way; what that costs a step is the calibration's business, not these tests'. The
    ranks serve one test after another, so the switch is put back."""
    from fsdp_compile_lab.calibration import cores

    before = cores._cores_per_thread
    cores._cores_per_thread = lambda: 2.0
    try:
        yield
    finally:
        cores._cores_per_thread = before


def measure_worker(rank: int, world: int) -> dict:
    net = fsdp_compile.EmulatedNetwork(intra_node=INTRA, inter_node=INTER, latency="50us", devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(seconds=120))
    try:
        with collectives_timed_alone():
            cluster = fsdp_compile.Cluster.measure(nodes=2, sizes=(1 << 18, 1 << 20), repeats=1, device_memory=1 << 30,
                                                   host=HostCPU)
            return {"intra": {k: v.bandwidth for k, v in cluster.measured_collectives.items()},
                    "inter": {k: v.bandwidth for k, v in cluster.measured_inter_collectives.items()},
                    "backend_inter": {k: v.bandwidth for k, v in cluster.host.backend_inter_collectives.items()},
                    "links": (cluster.intra_node_bandwidth, cluster.inter_node_bandwidth)}
    finally:
        end_process_group()


@pytest.mark.slow
def test_cluster_measure_fits_each_emulated_link() -> None:
    out = run_workers(measure_worker, 4, default_group=False)[0]
    assert set(out["intra"]) == set(out["inter"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    for kind in out["inter"]:  # the network's own account of its links (_modeled_seconds)
        assert out["inter"][kind] == pytest.approx(INTER, rel=1e-6), kind
        assert out["intra"][kind] == pytest.approx(INTRA, rel=1e-6), kind
    assert out["links"] == (out["intra"]["all_gather"], out["inter"]["all_gather"])
    # gloo's own time, timed with the links unlimited, is faster than the slow link
    assert set(out["backend_inter"]) == set(out["inter"])
    assert all(out["backend_inter"][kind] > 2 * out["inter"][kind] for kind in out["inter"]), out


LINK, LATENCY = 50e6, 1e-3


def fit_worker(rank: int, world: int) -> dict:
    import torch

    from fsdp_compile.planning.calibration.collective_fits import _collectives
    from fsdp_compile.runtime.ring import ring_steps

    net = fsdp_compile.EmulatedNetwork(intra_node=LINK, latency=LATENCY, devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(seconds=120))
    try:
        with collectives_timed_alone():
            fits = _collectives(None, torch.device("cpu"), (1 << 16, 1 << 18, 1 << 20), repeats=3)
            return {kind: (fit.step_latency * ring_steps(kind, world), fit.bandwidth) for kind, fit in fits.items()}
    finally:
        end_process_group()


def test_collective_fits_recover_the_emulated_link() -> None:
    """The planner prices a step's collectives by these fits: on a link of known latency and
    bandwidth they must come back as that link, not as the link plus the ranks' skew leaving a
    barrier (timed one at a time, the fit carried 2-5 ms of latency per collective here)."""
    out = run_workers(fit_worker, 2, default_group=False)[0]
    for kind, (latency, bandwidth) in out.items():
        assert 0.5 * LATENCY <= latency <= 2 * LATENCY, (kind, latency)
        # No collective ends before the link would (test_network_distributed), but a straight
        # line through 3 sizes comes out above the link where the time beyond it shrinks with
        # size: by 2.0% and 2.5% in two full runs on a slower host.
        assert 0.9 * LINK <= bandwidth <= 1.05 * LINK, (kind, bandwidth)


FAST, FAST_LATENCY = 1e12, 1e-6  # a link far faster than gloo moves data on this machine


def modeled_fit_worker(rank: int, world: int) -> dict:
    import torch

    from fsdp_compile.planning.calibration.calibrate import _collectives_per_link, _emulated_network, _link_groups
    from fsdp_compile.runtime.ring import ring_steps

    net = fsdp_compile.EmulatedNetwork(intra_node=FAST, latency=FAST_LATENCY, devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(seconds=120))
    try:
        with collectives_timed_alone():
            groups, sizes, cpu = _link_groups(None, 1), (1 << 16, 1 << 18, 1 << 20), torch.device("cpu")
            modeled, _ = _collectives_per_link(groups, cpu, sizes, 1, _emulated_network(None))
            timed, _ = _collectives_per_link(groups, cpu, sizes, 1)
            return {"modeled": {kind: (fit.step_latency * ring_steps(kind, world), fit.bandwidth)
                                for kind, fit in modeled.items()},
                    "timed": {kind: (fit.step_latency * ring_steps(kind, world), fit.bandwidth)
                              for kind, fit in timed.items()}}
    finally:
        end_process_group()


def test_an_emulated_networks_link_fits_are_its_links_not_gloos_time() -> None:
    """An emulated collective ends when both its link and gloo are done, so its wall time is
    the slower of the two. On a link faster than gloo, timed collectives fit gloo's speed (at 2 x 2
    ranks on 2 cores, 0.7-0.9 ms of latency per ring step on a 20 us link); the links' fits read
    what the network charged instead, and gloo's own time has fits of its own."""
    out = run_workers(modeled_fit_worker, 2, default_group=False)[0]
    for kind, (latency, bandwidth) in out["modeled"].items():
        assert latency == pytest.approx(FAST_LATENCY, rel=1e-6), kind
        assert bandwidth == pytest.approx(FAST, rel=1e-6), kind
        # What timing them fits instead: gloo's time, a line that either rises with size far
        # more steeply than this link or starts far above its latency (gloo's times at these
        # sizes are mostly fixed costs, so which of the two varies from run to run).
        timed_latency, timed_bandwidth = out["timed"][kind]
        assert timed_latency > 10 * FAST_LATENCY or timed_bandwidth < FAST / 10, (kind, out["timed"][kind])


def backend_worker(rank: int, world: int) -> dict:
    import torch

    from fsdp_compile.planning.calibration.calibrate import _emulated_network, _link_groups
    from fsdp_compile_lab.calibration.calibrate import _backend_collectives, backend_links

    net = fsdp_compile.EmulatedNetwork(intra_node=LINK, latency=LATENCY, devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(seconds=120))
    try:
        with collectives_timed_alone():
            own, inter = _backend_collectives(_emulated_network(None), _link_groups(None, 1), torch.device("cpu"),
                                              (1 << 16, 1 << 18, 1 << 20), 3)
            link = fsdp_compile.Cluster.preset("a10g").replace(device_type="cpu", devices_per_node=2, host=HostCPU(
                backend_collectives=own, backend_share=(0.5, 1.0)))
            unlimited = backend_links(link)
            return {"found": _emulated_network(None) is net, "own": {k: v.bandwidth for k, v in own.items()},
                    "inter": inter, "put_back": net.links()["intra"].bandwidth,
                    "unlimited": (unlimited.measured_collectives == own, unlimited.host.backend_collectives,
                                  unlimited.intra_node_bandwidth == own["all_gather"].bandwidth,
                                  unlimited.host.backend_share)}
    finally:
        end_process_group()


def test_the_backends_own_collectives_are_timed_with_the_links_unlimited() -> None:
    """On an emulated network the planner also needs gloo's own time per collective (the
    simulator's backend queue; ``compare --exposed``'s plan on unlimited links): timed with the
    links made unlimited for the while, then put back."""
    out = run_workers(backend_worker, 2, default_group=False)[0]
    assert out["found"] and out["inter"] == {} and out["put_back"] == LINK, out
    assert sorted(out["own"]) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(bandwidth > 2 * LINK for bandwidth in out["own"].values()), out  # not the link's pace
    assert out["unlimited"] == (True, {}, True, (0.5, 1.0)), out


def test_backend_links_needs_the_backends_own_collectives() -> None:
    from fsdp_compile.planning.vocabulary import ClusterError
    from fsdp_compile_lab import backend_links

    with pytest.raises(ClusterError, match=r"no backend_collectives: measure it with Cluster.measure\(host=HostCPU\) on an "):
        backend_links(fsdp_compile.Cluster.preset("a10g"))


@pytest.mark.parametrize("spec, message", [
    ("fast", "--emulate 'fast': intra_node='fast' is not a bandwidth"),
    ("1GB/s,0GB/s", "--emulate '1GB/s,0GB/s': inter_node='0GB/s': a bandwidth must be positive"),
    ("1GB/s,2GB/s,3GB/s", "--emulate '1GB/s,2GB/s,3GB/s': give the intra-node bandwidth, and optionally"),
])
def test_compare_emulate_names_the_option_in_its_errors(spec: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        _emulated_network(spec, "10us", None)


def test_compare_emulate_takes_intra_and_inter_bandwidths() -> None:
    net = _emulated_network("1GB/s,100MB/s", "20us", 2)
    assert (net.intra.bandwidth, net.inter.bandwidth) == (1e9, 1e8)
    assert net.inter.latency == pytest.approx(2e-5)
    assert _emulated_network("1GB/s", "20us", None).inter.bandwidth == 1e9
