"""The host-CPU model sits behind one seam (``Cluster.host``, a host model of
:mod:`fsdp_compile.planning.host_model`'s protocol) and in the lab (``lab/fsdp_compile_lab``), not
in the package: a GPU cluster carries none of its numbers, the GPU cost model and simulator never
consult it, ``import fsdp_compile`` loads neither the calibrations nor the emulated network, and no
module of the package imports the lab or, outside it and the command that sets one up, the
emulated network."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_compile.planning import Cluster, ClusterError
from fsdp_compile.planning.cost import Group, collective_cost
from fsdp_compile.planning.host_model import HostModel
from fsdp_compile.planning.simulate import simulate_events
from fsdp_compile_lab import HOST_NUMBERS, HostCPU

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_compile"
# Where the package hands a user the emulated network they asked for: its lazy export, the
# ``compare --emulate`` command that sets one up, and ``compare``'s steps on its links unlimited.
USERS_OF_THE_NETWORK = ("__init__.py", "planning/cli.py", "planning/compare.py")


def test_import_loads_neither_the_emulated_network_nor_the_host_model() -> None:
    code = ("import sys, fsdp_compile\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('fsdp_compile.network', "
            "'fsdp_compile.planning.calibration', 'fsdp_compile_lab')))\n"
            "print(loaded)\n"
            "print(fsdp_compile.EmulatedNetwork.__module__)\n")  # still there, loaded when asked for
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["[]", "fsdp_compile.network.emulated"], done.stdout


def test_no_module_of_the_package_imports_the_lab_or_the_emulated_network() -> None:
    """The lab plugs in through ``Cluster(host=...)`` only; the emulated network is a testing tool
    that the package's own work never needs (``compare --emulate`` sets one up on request)."""
    importers = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if re.search(r"^\s*(from|import) fsdp_compile_lab\b|import_module\([\"']fsdp_compile_lab", text, re.M):
            importers[relative] = "the lab"
        elif (not relative.startswith("network/") and relative not in USERS_OF_THE_NETWORK
              and re.search(r"^\s*from \.+network[. ]", text, re.M)):
            importers[relative] = "the emulated network"
    assert importers == {}


def test_a_gpu_cluster_has_no_host_numbers() -> None:
    assert not set(HOST_NUMBERS) & {f.name for f in dataclasses.fields(Cluster)}
    for name in Cluster.presets():
        assert Cluster.preset(name).host is None, name
    assert isinstance(HostCPU(), HostModel)
    # a host number given to the devices is named, with where it goes
    cpu = Cluster.preset("a10g").replace(device_type="cpu", host=HostCPU())
    with pytest.raises(ClusterError, match=r"op_overhead: numbers of the host CPU model \(Cluster.host\).*"
                                           r"cluster.with_host\(op_overhead=...\)"):
        cpu.replace(op_overhead=1e-5)
    with pytest.raises(ClusterError, match="Cluster has no number op_overhead"):
        Cluster.preset("h100-sxm").replace(op_overhead=1e-5)
    with pytest.raises(ClusterError, match=r"has no host model to change op_overhead of: .*replace\(host=...\)"):
        Cluster.preset("h100-sxm").with_host(op_overhead=1e-5)
    with pytest.raises(ClusterError, match="must be a host model"):
        Cluster.preset("h100-sxm").replace(host="cpu")
    with pytest.raises(ClusterError, match="Cluster has no number overlap"):
        Cluster.preset("h100-sxm").replace(overlap=0.5)


def test_the_gpu_model_prices_and_plays_without_a_host() -> None:
    h100 = Cluster.preset("h100-sxm", nodes=2)
    cost = collective_cost("all_gather", 1 << 20, Group(8, 1), h100)
    assert cost.host is None  # nothing but the link's time
    on_host = collective_cost("all_gather", 1 << 20, Group(8, 1), h100.replace(host=HostCPU(collective_issue={
        "all_gather": (1e-3, 0.0)})))
    assert on_host.seconds == cost.seconds and on_host.host.issue_seconds == 1e-3
    # events that carry a host's numbers are refused by the GPU simulator, not read as its own
    with pytest.raises(ValueError, match="carries a host model's numbers: simulate it with host="):
        simulate_events([("issue", "x", 1.0, "intra", 0, 0.5), ("wait", "x")])
    with pytest.raises(ValueError, match="a host model's event: simulate it with host="):
        simulate_events([("backend_cpu", 1.0)])
    assert simulate_events([("backend_cpu", 1.0)], host=HostCPU()).backend_cpu_seconds == 1.0
    assert torch.bfloat16 in h100.peak_flops
