"""An emulated cluster network: a process-group backend that moves data through gloo and completes
each collective when a link of a chosen bandwidth and latency would have finished it.

Every process group of the run is an :class:`EmulatedProcessGroup`, which hands each collective
to a plain gloo group on the same store (results are bit for bit gloo's) and returns an
:class:`EmulatedWork` that completes at the modeled time. The model, per rank:

* Two links, each a separate resource: intra-node (NVLink-like) for a group within this rank's
  node, inter-node (the NIC, the bottleneck) for one that spans nodes. So HSDP's intra-node
  reduce-scatter and inter-node all-reduce overlap, as on real hardware.
* A collective starts when issued or when its link is free, whichever is later (one at a time
  per link, like one NCCL stream), and lasts ``latency + wire bytes / bandwidth``
  (:mod:`fsdp_compile.network.links`). A coalesced call is one collective (one latency), as
  NCCL's one launch; a group of one rank takes no time.
* The start is fixed at issue from this rank's clock only. Gloo makes the collective wait for
  every rank, so a late peer, like gloo being slower than the link, shows up as an *overrun* in
  :meth:`EmulatedNetwork.stats`: the emulation holds only where the model is slower than gloo.

Nodes are consecutive blocks of ``devices_per_node`` global ranks.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .completion import Alarm, Watchers, sleep_until
from .links import Link, format_bandwidth, format_seconds, parse_bandwidth, parse_latency, wire_bytes
from .stats import NetworkStats, StatsRecorder

logger = logging.getLogger(__name__)

BACKEND_NAME = "emulated"
_LOCAL = "local"  # the "link" of a group of one rank, which communicates with nobody
_NO_TIMEOUT = datetime.timedelta(0)  # c10d's "no timeout" for Work.wait

_active: EmulatedNetwork | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _pass_through(inner: str, name: str) -> Callable:
    """A method that calls the same method of the object in attribute ``inner``."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, inner), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class EmulatedWork(dist.Work):
    """A collective in flight on an emulated link: complete once gloo finished it and the modeled
    end has come. Times are ``time.monotonic()`` seconds; ``gloo_done_at`` is None in flight. A
    send or receive is seen to finish only by its own ``wait()``, so a late wait on one can
    report an overrun that was not.
    """

    def __init__(self, inner: dist.Work, network: EmulatedNetwork, kind: str, link: str,
                 issued_at: float, start: float, seconds: float) -> None:
        super().__init__()
        self._inner = inner
        self._network = network
        self._future: torch.futures.Future | None = None
        self.kind, self.link = kind, link
        self.issued_at, self.modeled_start, self.seconds = issued_at, start, seconds
        self.modeled_end = start + seconds
        self.gloo_done_at: float | None = None
        self._watched = kind not in ("send", "recv")
        if self._watched:
            network._watchers.watch(inner, self._gloo_done)

    def _gloo_done(self, when: float, error: BaseException | None) -> None:
        self.gloo_done_at = when
        if error is None:
            self._network._recorder.completed(self.kind, self.link, when - self.modeled_end)

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        if self._watched:
            self._inner.wait(timeout)
        elif self.gloo_done_at is None:  # gloo's send / receive may be waited on once only
            self._inner.wait(timeout)
            self._gloo_done(time.monotonic(), None)
        sleep_until(self.modeled_end)
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed() and time.monotonic() >= self.modeled_end

    is_success = _pass_through("_inner", "is_success")
    exception = _pass_through("_inner", "exception")
    result = _pass_through("_inner", "result")
    source_rank = _pass_through("_inner", "source_rank")
    synchronize = _pass_through("_inner", "synchronize")

    def block_current_stream(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """Gloo's result from the modeled end on (DDP's reducer waits on it); gloo's error where
        its work has no future (reduce-scatter, send, recv)."""
        if self._future is None:
            inner = self._inner.get_future()
            future: torch.futures.Future = torch.futures.Future()
            alarm, end = self._network._alarm, self.modeled_end

            def forward(done: torch.futures.Future) -> None:
                try:
                    value = done.value()
                except Exception as exc:  # gloo failed: the caller sees its error at once
                    future.set_exception(exc)
                    return
                alarm.at(end, future.set_result, value)

            inner.add_done_callback(forward)
            self._future = future
        return self._future

    def __repr__(self) -> str:
        return (f"EmulatedWork({self.kind} on {self.link}, {format_seconds(self.seconds)} modeled, "
                f"ends at {self.modeled_end:.6f})")


def _collective(name: str, kind: str, buffer: int | None) -> Callable:
    """A process-group method that issues ``kind`` on the emulated link and passes its arguments
    to gloo's method of the same name unchanged (every overload behaves as on gloo); the bytes of
    positional argument ``buffer`` (None: no data) are the collective's buffer."""

    def method(self: EmulatedProcessGroup, *args: Any, **kwargs: Any) -> EmulatedWork:
        nbytes = 0 if buffer is None else _nbytes(args[buffer])
        return self._issue(kind, self.link, nbytes, getattr(self._gloo, name), args, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` through gloo, completed at the modeled end of a {kind}."
    return method


class EmulatedProcessGroup(dist.ProcessGroup):
    """A process group of an :class:`EmulatedNetwork`: gloo's results at the link's pace; ``link``
    is "intra" (one node), "inter" (several) or "local" (a group of one rank)."""

    def __init__(self, network: EmulatedNetwork, store: dist.Store, rank: int, size: int,
                 timeout: datetime.timedelta, global_ranks: list[int], gloo_ranks: list[int], name: str) -> None:
        # A Python subclass must use the (rank, size) constructor: pybind refuses the one taking
        # a store for a class it has to wrap in its trampoline.
        super().__init__(rank, size)
        self.network = network
        self.global_ranks = global_ranks
        self.timeout = timeout
        self.link = network.link_of(global_ranks)
        self._name = name
        self._desc = "undefined"
        self._gloo = _gloo_group(store, rank, size, timeout, gloo_ranks, name)
        self._issued = 0

    def _issue(self, kind: str, link: str, buffer_bytes: int, call: Callable, args: tuple,
               kwargs: dict) -> EmulatedWork:
        # Issued before gloo's call (its reduce-scatter clones its input: compute, not link
        # time); booked after, so a call gloo refuses books nothing.
        issued_at = time.monotonic()
        inner = call(*args, **kwargs)
        start, seconds = self.network._reserve(kind, link, buffer_bytes, self.size(), issued_at)
        work = EmulatedWork(inner, self.network, kind, link, issued_at, start, seconds)
        self.network._recorded_issue(tuple(self.global_ranks), self._issued, work)
        self._issued += 1  # the i-th collective of a group is the same on every member
        return work

    # ---- the names torch sets and reads; a Python group must hold them itself
    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name
        self._gloo._set_group_name(name)

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc
        self._gloo._set_group_desc(desc)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def gather(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> EmulatedWork:
        """``gather`` through gloo; the buffer is the gathered whole (every rank's input)."""
        return self._issue("gather", self.link, _nbytes(inputs) * self.size(), self._gloo.gather,
                           (outputs, inputs, *args), kwargs)

    def scatter(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> EmulatedWork:
        """``scatter`` through gloo; the buffer is the scattered whole (every rank's output)."""
        return self._issue("scatter", self.link, _nbytes(outputs) * self.size(), self._gloo.scatter,
                           (outputs, inputs, *args), kwargs)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        """``send`` through gloo, on the link to the peer's node."""
        link = self.network.link_of([self.global_ranks[self.rank()], self.global_ranks[dst]])
        return self._issue("send", link, _nbytes(tensors), self._gloo.send, (tensors, dst, tag), {})

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        """``recv`` through gloo, on the link to the peer's node."""
        link = self.network.link_of([self.global_ranks[self.rank()], self.global_ranks[src]])
        return self._issue("recv", link, _nbytes(tensors), self._gloo.recv, (tensors, src, tag), {})

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> EmulatedWork:
        """``recv`` from any rank: the peer is unknown when it is issued, so the group's link."""
        return self._issue("recv", self.link, _nbytes(tensors), self._gloo.recv_anysource, (tensors, tag), {})

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Gloo's monitored barrier, unmodeled (``dist.monitored_barrier`` takes gloo groups only)."""
        backend = self._gloo._get_backend(torch.device("cpu"))
        backend.monitored_barrier(self.timeout if timeout is None else timeout, wait_all_ranks)

    shutdown = _pass_through("_gloo", "shutdown")
    abort = _pass_through("_gloo", "abort")

    def __repr__(self) -> str:
        return f"EmulatedProcessGroup({self._name!r}, ranks {self.global_ranks}, {self.link} link)"


# The collectives torch 2.13 calls from C++ and Python (old names where it falls back): each name's
# modeled kind and the positional argument whose bytes are its buffer (None: no data).
for _kind, _buffer, _names in (
        ("all_reduce", 0, "allreduce allreduce_coalesced"), ("broadcast", 0, "broadcast"), ("reduce", 0, "reduce"),
        ("all_gather", 0, "allgather allgather_coalesced _allgather_base all_gather_single "
                          "all_gather_single_coalesced allgather_into_tensor_coalesced"),
        ("reduce_scatter", 1, "reduce_scatter _reduce_scatter_base reduce_scatter_single "
                              "reduce_scatter_single_coalesced reduce_scatter_tensor_coalesced"),
        ("all_to_all", 1, "all_to_all_single alltoall_base alltoall"), ("barrier", None, "barrier")):
    for _name in _names.split():
        setattr(EmulatedProcessGroup, _name, _collective(_name, _kind, _buffer))


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: list[int],
                name: str) -> dist.ProcessGroup:
    """A plain gloo group, built as ``new_group`` builds one but registered nowhere."""
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo.options.global_ranks_in_group = global_ranks
    gloo.options.group_name = name
    gloo._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_group_name(name)
    return group


def _create_group(options: Any, backend_options: Any) -> EmulatedProcessGroup:
    """The backend's creator (``extended_api=True``: it receives the global ranks, which decide the link)."""
    if _active is None:
        raise RuntimeError(f"the {BACKEND_NAME!r} process-group backend is set up by "
                           "fsdp_compile.EmulatedNetwork(...).init_process_group(); call that instead of "
                           f"torch.distributed.init_process_group({BACKEND_NAME!r})")
    return _active._create_group(options)


class EmulatedNetwork:
    """A cluster network emulated on one machine, for every process group of the run.

    ``intra_node`` / ``inter_node``: bandwidth of a rank's link within its node and to other
    nodes (bytes per second, or "2GB/s", "10Gbit/s", "1.5GiB/s"; ``inter_node`` defaults to
    ``intra_node``; ``float("inf")``: unlimited); ``latency``: paid once per collective (seconds,
    or "20us"; default 10 us, about NCCL's on NVLink or InfiniBand); ``devices_per_node``: ranks
    per node (default ``LOCAL_WORLD_SIZE``, else one node). Call :meth:`init_process_group`
    instead of ``torch.distributed.init_process_group("gloo")``: every group made afterwards
    runs on this network (see :mod:`fsdp_compile.network.emulated` for the model).

        net = fsdp_compile.EmulatedNetwork(intra_node="2GB/s", inter_node="200MB/s", latency="20us",
                                           devices_per_node=2)
        net.init_process_group()
        ...  # train
        print(net.stats())
    """

    def __init__(self, intra_node: float | str, inter_node: float | str | None = None,
                 latency: float | str = "10us", devices_per_node: int | None = None) -> None:
        seconds = parse_latency(latency, "latency")
        self.intra = Link("intra", parse_bandwidth(intra_node, "intra_node"), seconds)
        self.inter = Link("inter", parse_bandwidth(intra_node if inter_node is None else inter_node,
                                                   "inter_node"), seconds)
        if devices_per_node is not None and (isinstance(devices_per_node, bool)
                                             or not isinstance(devices_per_node, int) or devices_per_node < 1):
            raise ValueError(f"devices_per_node={devices_per_node!r} must be a positive int (ranks per node), "
                             "or None to read LOCAL_WORLD_SIZE")
        self._devices_per_node = devices_per_node
        self._lock = threading.Lock()
        self._free_at = {"intra": 0.0, "inter": 0.0}
        self._recorder = StatsRecorder()
        self._records: list[tuple[tuple[int, ...], int, EmulatedWork]] | None = None
        self._alarm = Alarm()
        self._watchers = Watchers()

    @property
    def devices_per_node(self) -> int | None:
        """Ranks per node; ``None`` until :meth:`init_process_group` resolved the default."""
        return self._devices_per_node

    def links(self) -> dict[str, Link]:
        return {"intra": self.intra, "inter": self.inter}

    def set_links(self, intra_node: float | str | None = None, inter_node: float | str | None = None,
                  latency: float | str | None = None) -> None:
        """Change the links of a running network (``None`` keeps a value), to sweep link speeds
        over the same compiled models in one process. Collectives issued before keep their times;
        later ones run at the new speed. Call it on every rank with the same values between
        steps (ranks modeling one collective differently show overruns). Bad values are refused
        as by the constructor and change nothing.
        """
        seconds = self.intra.latency if latency is None else parse_latency(latency, "latency")
        intra = self.intra.bandwidth if intra_node is None else parse_bandwidth(intra_node, "intra_node")
        inter = self.inter.bandwidth if inter_node is None else parse_bandwidth(inter_node, "inter_node")
        with self._lock:  # _reserve reads both links' durations; never a mix of old and new
            self.intra = Link("intra", intra, seconds)
            self.inter = Link("inter", inter, seconds)

    def init_process_group(self, **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` on this network: the keyword arguments
        (``init_method``, ``store``, ``rank``, ``world_size``, ``timeout``, ...) pass through."""
        global _active
        if "backend" in kwargs:
            raise TypeError("EmulatedNetwork.init_process_group() chooses the backend itself; drop backend= "
                            "(collectives run through gloo underneath)")
        if dist.is_initialized():
            raise RuntimeError(
                f"EmulatedNetwork.init_process_group(): a default process group already exists (backend "
                f"{dist.get_backend()!r}); groups made before the network would bypass it. Call it instead of "
                "torch.distributed.init_process_group(), or call torch.distributed.destroy_process_group() first")
        world = kwargs.get("world_size", -1)
        if world == -1 and "store" not in kwargs and os.environ.get("WORLD_SIZE", "").isdigit():
            world = int(os.environ["WORLD_SIZE"])
        if world > 0:  # else the creator checks it, once the rendezvous has told the world size
            self._resolve_devices_per_node(world)
        _register_backend()
        _active = self
        dist.init_process_group(backend=BACKEND_NAME, **kwargs)

    def _create_group(self, options: Any) -> EmulatedProcessGroup:
        gloo_ranks = list(options.global_ranks_in_group)
        size = options.group_size
        if not gloo_ranks:  # the default group: its ranks are the world's
            self._devices_per_node = self._resolve_devices_per_node(size)
        global_ranks = gloo_ranks or list(range(size))
        return EmulatedProcessGroup(self, options.store, options.group_rank, size, options.timeout,
                                    global_ranks, gloo_ranks, str(options.group_id))

    def _resolve_devices_per_node(self, world: int) -> int:
        per_node = self._devices_per_node
        if per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                return world
            per_node = int(env) if env.strip().isdigit() else 0
            if per_node < 1:
                raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a positive int; fix it or pass "
                                 "EmulatedNetwork(devices_per_node=...)")
        if world % per_node:
            raise ValueError(f"devices_per_node={per_node} does not divide the world size {world}: nodes must "
                             "hold equal numbers of ranks; pass a devices_per_node that divides it")
        return per_node

    def link_of(self, global_ranks: Sequence[int]) -> str:
        """The link a group of these global ranks uses from here: "local" for one rank, "intra"
        when they share a node, "inter" when they span nodes."""
        if len(set(global_ranks)) <= 1:
            return _LOCAL
        per_node = self._devices_per_node
        if per_node is None:
            raise RuntimeError("EmulatedNetwork: the network has no world yet; call init_process_group() first")
        return "inter" if len({r // per_node for r in global_ranks}) > 1 else "intra"

    def seconds(self, kind: str, buffer_bytes: float, group_size: int, link: str = "intra") -> float:
        """The modeled duration of one collective (without waiting for a busy link)."""
        if link == _LOCAL:
            return 0.0
        return self.links()[link].seconds(kind, buffer_bytes, group_size)

    def _reserve(self, kind: str, link: str, buffer_bytes: int, group_size: int,
                 issued_at: float) -> tuple[float, float]:
        """Book the link for one collective issued at ``issued_at``: (modeled start, seconds)."""
        with self._lock:
            seconds = self.seconds(kind, buffer_bytes, group_size, link)
            start = issued_at if link == _LOCAL else max(issued_at, self._free_at[link])
            if link != _LOCAL:
                self._free_at[link] = start + seconds
        self._recorder.issued(kind, link, wire_bytes(kind, buffer_bytes, group_size), buffer_bytes, seconds)
        return start, seconds

    def stats(self) -> NetworkStats:
        """What this rank's links carried since the start (or :meth:`reset_stats`), per collective
        kind and link, with the overruns (gloo finishing after the modeled end)."""
        return self._recorder.snapshot()

    def reset_stats(self) -> None:
        """Count afresh (after warm-up, say); collectives in flight complete in the new window."""
        self._recorder.reset()

    def record(self, on: bool = True) -> None:
        """Keep every collective issued from now on, with its work, for :meth:`recorded` and
        :func:`~.lateness.lateness_causes` (``on=False``: stop; either way the kept ones go)."""
        with self._lock:
            self._records = [] if on else None

    def recorded(self) -> list[tuple[tuple[int, ...], int, EmulatedWork]]:
        """Since :meth:`record`, in issue order: (group's global ranks, number in the group, work)."""
        with self._lock:
            return list(self._records or [])

    def _recorded_issue(self, group_ranks: tuple[int, ...], index: int, work: EmulatedWork) -> None:
        with self._lock:
            if self._records is not None:
                self._records.append((group_ranks, index, work))

    def __repr__(self) -> str:
        latency = format_seconds(self.intra.latency)
        return (f"EmulatedNetwork(intra_node={format_bandwidth(self.intra.bandwidth)}, "
                f"inter_node={format_bandwidth(self.inter.bandwidth)}, latency={latency}, "
                f"devices_per_node={self._devices_per_node})")


def _register_backend() -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=["cpu"])
